/* The entry points one kernel source calls in another (all built into one library per instruction set). */
#ifndef SPLITSERVE_KERNELS_H
#define SPLITSERVE_KERNELS_H

#include <stdint.h>

int ss_paged_attention_bf16(const uint16_t *q, int64_t q_row_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                            const int64_t *tables, int64_t max_blocks, const int64_t *row_seq, const int64_t *lens,
                            uint16_t *out, int num_rows, int num_heads, int num_kv_heads, int head_dim, int block_size,
                            float scale, int num_threads);
int ss_paged_attention_f32(const float *q, int64_t q_row_stride, const float *k_cache, const float *v_cache,
                           const int64_t *tables, int64_t max_blocks, const int64_t *row_seq, const int64_t *lens,
                           float *out, int num_rows, int num_heads, int num_kv_heads, int head_dim, int block_size,
                           float scale, int num_threads);
void add_rms_norm_f32_to_f32(float *x, const float *delta, const float *weight, float *out, int64_t num_rows,
                             int64_t n, float eps, int num_threads);
int ss_quant_matmul(const void *x, int x_dtype, int64_t x_stride, int64_t m, int64_t k, const void *w, int wtype,
                    int64_t n, void *y, int out_dtype, int64_t ldy, void *scratch, int num_threads);
int64_t ss_act_block_bytes(void);
int ss_amx_permitted(void);
void ss_silu_mul_f32(const float *gu, int64_t gu_stride, int64_t rows, int64_t n, float *out, int num_threads);

#endif

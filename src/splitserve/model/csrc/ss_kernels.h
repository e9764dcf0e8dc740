/*
 * The kernels' public interface: every function the library exports (all ss_-prefixed), the structs the forward
 * step takes, and the ABI version. The Python bindings (model/kernels.py) declare the same by ctypes; at load
 * they check ss_abi_version() and the structs' sizes against their own, so a library and bindings that disagree
 * are refused instead of reading each other's memory wrong. Change SS_ABI_VERSION with any change here.
 * Every source includes this header, so a definition that drifts from its declaration does not compile.
 */
#ifndef SS_KERNELS_H
#define SS_KERNELS_H

#include <stdint.h>

#define SS_ABI_VERSION 7

/* One decoder layer of ss_forward_step: float32 norm weights and repacked matmul weights (quant_matmul.c), and
 * what some architectures add (NULL or 0 where a layer has none, model/arch.py): float32 biases of the fused q/k/v
 * and of the output projection; the RMSNorm weights applied to each head of q and of k before the rotation; the
 * RMSNorms of the attention's and of the MLP's output before each joins the residual stream (Gemma's sandwich);
 * the layer's own rotary tables (Gemma 3's sliding layers) and its sliding window. */
typedef struct {
    const float *input_norm, *post_norm;   /* [hidden] */
    const void *qkv, *o, *gate_up, *down;  /* repacked weights */
    int32_t qkv_type, o_type, gate_up_type, down_type;
    const float *qkv_bias, *o_bias;        /* [q + 2 kv], [hidden] */
    const float *q_norm, *k_norm;          /* [head_dim] */
    const float *attn_out_norm, *mlp_out_norm; /* [hidden] */
    const float *cos, *sin;                /* [max_positions, head_dim]; NULL: the model's */
    int64_t window;                        /* attends to its last window positions (0: to all) */
} ss_layer;

/* ss_model.activation: the gate of the gated MLP */
#define SS_ACT_SILU 0
#define SS_ACT_GELU_TANH 1

/* A weight stacked from parts in different formats (a fused q/k/v whose v has more bits than q and k, as
 * llama.cpp's Q4_K_M files have): the weight type SS_MIXED, and the weight this header followed by each part's
 * repacked rows (ss_repack), offset[p] bytes from the header's start (a multiple of 64), part p's rows after part
 * p - 1's in the output. */
#define SS_MIXED 1000
#define SS_MIXED_PARTS 4
typedef struct {
    int64_t num_parts;
    int64_t wtype[SS_MIXED_PARTS], n[SS_MIXED_PARTS], offset[SS_MIXED_PARTS];
} ss_mixed;

typedef struct {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps, scale;
    const float *cos, *sin; /* [max_positions, head_dim], rotate-half tables */
    int64_t max_positions;
    const float *final_norm;
    const ss_layer *layers;
    void *kv;          /* [layers, 2, slots, kv_heads, head_dim] (int8, fp8: head_dim + head_dim / 16 bytes, common.h) */
    int64_t num_slots; /* slots per layer */
    int32_t kv_dtype;  /* SS_F32, SS_BF16, SS_INT8 or SS_FP8 */
    int32_t block_size;
    int32_t activation; /* SS_ACT_SILU or SS_ACT_GELU_TANH */
    float attn_softcap; /* attention scores capped to attn_softcap * tanh(x / attn_softcap) (Gemma 2; 0: none) */
} ss_model;

/* The ABI: its version, and sizeof(ss_layer) (which 0), sizeof(ss_model) (1) or sizeof(ss_mixed) (2); -1 for
 * another which. */
int32_t ss_abi_version(void);
int64_t ss_struct_size(int which);

/* forward_step.c */
int ss_forward_step(const ss_model *m, float *x, int num_rows, const int64_t *positions, const int64_t *slots,
                    const int64_t *tables, int64_t max_blocks, const int64_t *row_seq, const int64_t *lens, float *out,
                    int num_threads);

/* cpu_kernels.c */
int ss_paged_attention_bf16(const uint16_t *q, int64_t q_row_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                            const int64_t *tables, int64_t max_blocks, const int64_t *row_seq, const int64_t *lens,
                            uint16_t *out, int num_rows, int num_heads, int num_kv_heads, int head_dim, int block_size,
                            float scale, int64_t window, float softcap, int num_threads);
int ss_paged_attention_packed(const uint16_t *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                              const int64_t *tables, int64_t max_blocks, const int64_t *row_seq, const int64_t *lens,
                              uint16_t *out, int num_rows, int num_heads, int num_kv_heads, int head_dim,
                              int block_size, float scale, int64_t window, float softcap, int num_threads,
                              int format);
void ss_quantize_kv(const float *x, int64_t num_rows, int head_dim, int format, void *out);
int ss_paged_attention_f32(const float *q, int64_t q_row_stride, const float *k_cache, const float *v_cache,
                           const int64_t *tables, int64_t max_blocks, const int64_t *row_seq, const int64_t *lens,
                           float *out, int num_rows, int num_heads, int num_kv_heads, int head_dim, int block_size,
                           float scale, int64_t window, float softcap, int num_threads);
void ss_add_rms_norm_bf16(float *x, const uint16_t *delta, const float *weight, uint16_t *out, int64_t num_rows,
                          int64_t n, float eps, int num_threads);
void ss_add_rms_norm_f32(float *x, const float *delta, const float *weight, float *out, int64_t num_rows, int64_t n,
                         float eps, int num_threads);
void ss_dot_rows_f32(const float *x, int64_t m, int64_t k, const float *w, const int64_t *rows, int64_t per_row,
                     float *out, int num_threads);

/* amx/attention.c (-1 on builds without AMX) */
int ss_prefill_attention_bf16(const uint16_t *q, int64_t q_row_stride, const uint16_t *k_cache,
                              const uint16_t *v_cache, const int64_t *slots, int64_t num_ctx, int64_t num_q,
                              uint16_t *out, int num_heads, int num_kv_heads, int head_dim, float scale,
                              int num_threads);

/* quant_matmul.c, its kernels in arch/ and amx/ */
int ss_quant_matmul(const void *x, int x_dtype, int64_t x_stride, int64_t m, int64_t k, const void *w, int wtype,
                    int64_t n, void *y, int out_dtype, int64_t ldy, void *scratch, int num_threads);
int64_t ss_act_block_bytes(void);
int64_t ss_quant_row_bytes(int wtype, int64_t k);
int64_t ss_packed_bytes(int wtype, int64_t n, int64_t k);
int ss_repack(const void *src, int wtype, int64_t n, int64_t k, void *dst);
int ss_dequantize_rows(const void *w, int wtype, int64_t k, int64_t n0, int64_t n1, float *out);

/* amx/tiles.c */
int ss_amx_permitted(void);

/* elementwise.c */
void ss_silu_mul_bf16(const uint16_t *gu, int64_t gu_stride, int64_t rows, int64_t n, uint16_t *out,
                      int num_threads);
void ss_silu_mul_f32(const float *gu, int64_t gu_stride, int64_t rows, int64_t n, float *out, int num_threads);
void ss_gelu_tanh_mul_f32(const float *gu, int64_t gu_stride, int64_t rows, int64_t n, float *out, int num_threads);
void ss_rotary_bf16(uint16_t *x, int64_t row_stride, int64_t num_tokens, int num_heads, int head_dim,
                    const uint16_t *cos, const uint16_t *sin, int num_threads);

#endif

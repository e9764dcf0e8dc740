/*
 * Matmuls straight from a GGUF's quantized weights, the generic part: quantizing activations, repacking
 * weights, the tiling over threads and the dispatch to each architecture's kernels (quant.h names them).
 *
 * Y[M, N] = X[M, K] . W[N, K]^T, with W in llama.cpp's Q4_0, Q4_1 or Q8_0 blocks (32 weights each, as
 * stored in the file) and X quantized on the fly to 8 bits per block of 32 (scale d, sum s = d * sum(q)),
 * so every block product is an integer dot product:
 *
 *     sum_k w_k x_k = d_w d_x sum_k u_k q_k + m_w s_x      (w_k = d_w u_k + m_w, x_k ~ d_x q_k)
 *
 * where u is the weight code the instruction set multiplies and m_w the offset that makes it exact (each
 * architecture's file says which codes it uses: arch/x86/quant.c, arch/arm/quant.c, arch/scalar/quant.c,
 * amx/quant_matmul.c).
 *
 * The layout is the reading of llama.cpp's ggml-cpu vec_dot_q4_1_q8_1 and friends; the tiling is ours: a
 * tile is up to 4 activation rows x a group of RG weight rows (quant.h), so each decoded weight block serves
 * every row of the tile and each activation block the group's RG weight rows. Threads split the weight rows
 * (OpenMP), so decode (M = 1..32) and prefill (M in the hundreds) both use every core, and each thread's
 * weight rows stay in its cache while it walks all activation rows. From 5 rows on, the amx build runs AMX-INT8
 * tiles (amx/quant_matmul.c) and the avx512 build 512-bit tiles of 8 rows x 16 weight rows
 * (arch/x86/quant_avx512.c), with the same integers and float operations as the row tiles.
 */
#include <stdlib.h>

#include "quant.h"
#include "ss_kernels.h"

_Static_assert(sizeof(block_q4_0) == 18 && sizeof(block_q4_1) == 20 && sizeof(block_q8_0) == 34, "GGML blocks");

int64_t ss_quant_row_bytes(int wtype, int64_t k) {
    const int64_t nb = k / QK;
    switch (wtype) {
        case GGML_Q4_0: return nb * (int64_t)sizeof(block_q4_0);
        case GGML_Q4_1: return nb * (int64_t)sizeof(block_q4_1);
        case GGML_Q8_0: return nb * (int64_t)sizeof(block_q8_0);
        default: return -1;
    }
}

int64_t ss_act_block_bytes(void) { return (int64_t)sizeof(block_q8a); }

/* ------------------------------------------------------------------ activations to 8 bits per block */

#if !defined(SS_AVX2) /* x86 builds have their own (arch/x86/quant.c) */
void quantize_block(const float *x, block_q8a *y) {
    float top = 0.0f;
    for (int k = 0; k < QK; k++) top = fmaxf(top, fabsf(x[k]));
    const float d = top / 127.0f, id = top > 0.0f ? 127.0f / top : 0.0f;
    int sum = 0;
    for (int k = 0; k < QK; k++) {
        const int q = (int)nearbyintf(x[k] * id);
        y->qs[k] = (int8_t)q;
        sum += q;
    }
    y->d = d;
    y->s = d * (float)sum;
}
#endif

/* rows [M, K] of float32 or bfloat16 (row_stride elements apart) -> M * K/32 blocks. */
static void quantize_rows(const void *x, int dtype, int64_t row_stride, int64_t m, int64_t k, block_q8a *out,
                          int num_threads) {
    const int64_t nb = k / QK;
    const int threads = m * k >= (1 << 15) ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < m; r++) {
        float buf[QK];
        for (int64_t b = 0; b < nb; b++) {
            const float *src;
            if (dtype == SS_F32) {
                src = (const float *)x + r * row_stride + b * QK;
            } else {
                const uint16_t *h = (const uint16_t *)x + r * row_stride + b * QK;
                for (int j = 0; j < QK; j++) buf[j] = bf16_to_f32(h[j]);
                src = buf;
            }
            quantize_block(src, out + r * nb + b);
        }
    }
}

/* ------------------------------------------------------------------------- the repacked layout (quant.h) */
int64_t ss_packed_bytes(int wtype, int64_t n, int64_t k) {
    const int64_t groups = (n + RG - 1) / RG, nb = k / QK;
    if (k % QK != 0) return -1;
    switch (wtype) {
        case GGML_Q4_0:
        case GGML_Q4_1: return groups * nb * (int64_t)sizeof(group_q4);
        case GGML_Q8_0: return groups * nb * (int64_t)sizeof(group_q8);
        default: return -1;
    }
}

static void repack_q4(const uint8_t *src, int wtype, int64_t n, int64_t nb, group_q4 *dst) {
    const int64_t row_bytes = ss_quant_row_bytes(wtype, nb * QK);
    for (int64_t g = 0; g < (n + RG - 1) / RG; g++)
        for (int64_t kb = 0; kb < nb; kb++) {
            group_q4 *out = dst + g * nb + kb;
            memset(out, 0, sizeof *out);
            for (int r = 0; r < RG && g * RG + r < n; r++) {
                const uint8_t *blk = src + (g * RG + r) * row_bytes;
                const uint8_t *qs;
                if (wtype == GGML_Q4_0) {
                    const block_q4_0 *b = (const block_q4_0 *)blk + kb;
                    out->d[r] = b->d;
                    out->m[r] = f32_to_f16(-8.0f * f16_to_f32(b->d)); /* exact: a power of two */
                    qs = b->qs;
                } else {
                    const block_q4_1 *b = (const block_q4_1 *)blk + kb;
                    out->d[r] = b->d;
                    out->m[r] = b->m;
                    qs = b->qs;
                }
                /* GGUF byte t holds weight t (low nibble) and t + 16 (high): byte 4 v + j is qs[v][4 r + j] */
                for (int v = 0; v < 4; v++) memcpy(&out->qs[v][4 * r], qs + 4 * v, 4);
            }
        }
}

static void repack_q8(const uint8_t *src, int64_t n, int64_t nb, group_q8 *dst) {
    const int64_t row_bytes = ss_quant_row_bytes(GGML_Q8_0, nb * QK);
    for (int64_t g = 0; g < (n + RG - 1) / RG; g++)
        for (int64_t kb = 0; kb < nb; kb++) {
            group_q8 *out = dst + g * nb + kb;
            memset(out, 0, sizeof *out);
            for (int r = 0; r < RG && g * RG + r < n; r++) {
                const block_q8_0 *b = (const block_q8_0 *)(src + (g * RG + r) * row_bytes) + kb;
                out->d[r] = b->d;
                for (int c = 0; c < 8; c++)
                    for (int j = 0; j < 4; j++) out->qs[c][4 * r + j] = (uint8_t)(b->qs[4 * c + j] + Q8_OFFSET);
            }
        }
}

/* GGUF rows [N, K] of wtype -> the grouped layout (ss_packed_bytes(wtype, N, K) bytes). Returns 0 or -1. */
int ss_repack(const void *src, int wtype, int64_t n, int64_t k, void *dst) {
    if (ss_packed_bytes(wtype, n, k) < 0) return -1;
    if (wtype == GGML_Q8_0)
        repack_q8((const uint8_t *)src, n, k / QK, (group_q8 *)dst);
    else
        repack_q4((const uint8_t *)src, wtype, n, k / QK, (group_q4 *)dst);
    return 0;
}

/* Weight groups per OpenMP task: a task's groups stay in cache while it walks every activation row. */
#define GROUPS_PER_TASK 4

/* Y = Xq . W^T for already-quantized activations and repacked weights; the body of an OpenMP region (call
 * it inside one, or alone for one thread). Y is [M, N] of out_dtype, rows ldy elements apart. */
static void qgemm_body(const void *w, int wtype, int64_t n, int64_t k, const block_q8a *xq, int64_t m, void *y,
                       int out_dtype, int64_t ldy) {
    const int is_q8 = wtype == GGML_Q8_0;
    const int64_t nb = k / QK, groups = (n + RG - 1) / RG;
    const int64_t group_bytes = nb * (int64_t)(is_q8 ? sizeof(group_q8) : sizeof(group_q4));
    const int64_t num_tasks = (groups + GROUPS_PER_TASK - 1) / GROUPS_PER_TASK;
#pragma omp for schedule(static)
    for (int64_t task = 0; task < num_tasks; task++) {
        const int64_t g0 = task * GROUPS_PER_TASK;
        const int64_t g1 = g0 + GROUPS_PER_TASK < groups ? g0 + GROUPS_PER_TASK : groups;
        for (int64_t i = 0; i < m; i += 4) {
            const int rows = m - i >= 4 ? 4 : (int)(m - i);
            const block_q8a *x[4];
            for (int r = 0; r < rows; r++) x[r] = xq + (i + r) * nb;
            for (int64_t g = g0; g < g1; g++) {
                float tmp[4 * RG];
                group_kernel((const uint8_t *)w + g * group_bytes, is_q8, x, rows, nb, tmp);
                const int cols = n - g * RG >= RG ? RG : (int)(n - g * RG);
                for (int r = 0; r < rows; r++) {
                    const int64_t base = (i + r) * ldy + g * RG;
                    if (out_dtype == SS_F32)
                        memcpy((float *)y + base, tmp + r * RG, sizeof(float) * (size_t)cols);
                    else
                        for (int c = 0; c < cols; c++) ((uint16_t *)y)[base + c] = f32_to_bf16(tmp[r * RG + c]);
                }
            }
        }
    }
}

/* Y[M, N] (out_dtype, rows ldy apart) = X[M, K] (x_dtype, rows x_stride apart) . W[N, K]^T with W repacked by
 * ss_repack, K a multiple of 32. scratch holds M * K/32 activation blocks (ss_act_block_bytes each), or is
 * NULL to allocate. Returns 0, or -1 for an unknown weight type, a K not a multiple of 32 or no memory. */
int ss_quant_matmul(const void *x, int x_dtype, int64_t x_stride, int64_t m, int64_t k, const void *w, int wtype,
                    int64_t n, void *y, int out_dtype, int64_t ldy, void *scratch, int num_threads) {
    if (ss_packed_bytes(wtype, n, k) < 0) return -1;
    block_q8a *xq = scratch != NULL ? (block_q8a *)scratch : malloc(sizeof(block_q8a) * (size_t)(m * (k / QK)));
    if (xq == NULL) return -1;
    quantize_rows(x, x_dtype, x_stride, m, k, xq, num_threads);
    const int threads = m * n * k >= (1 << 16) ? num_threads : 1;
#if defined(SS_AMX)
    if (m >= AMX_MIN_ROWS && amx_quant_matmul(xq, m, k, w, wtype, n, y, out_dtype, ldy, threads) == 0) {
        if (scratch == NULL) free(xq);
        return 0;
    }
#endif
#if defined(SS_WIDE)
    if (m >= WIDE_MIN_ROWS && wide_quant_matmul(xq, m, k, w, wtype, n, y, out_dtype, ldy, threads) == 0) {
        if (scratch == NULL) free(xq);
        return 0;
    }
#endif
#pragma omp parallel num_threads(threads)
    qgemm_body(w, wtype, n, k, xq, m, y, out_dtype, ldy);
    if (scratch == NULL) free(xq);
    return 0;
}

/* Dequantize weight rows [n0, n1) to float32 [n1 - n0, K] (tests and the PyTorch reference). */
int ss_dequantize_rows(const void *w, int wtype, int64_t k, int64_t n0, int64_t n1, float *out) {
    const int64_t nb = k / QK, row_bytes = ss_quant_row_bytes(wtype, k);
    if (row_bytes < 0 || k % QK != 0) return -1;
    for (int64_t r = n0; r < n1; r++) {
        const uint8_t *row = (const uint8_t *)w + r * row_bytes;
        float *o = out + (r - n0) * k;
        for (int64_t b = 0; b < nb; b++) {
            if (wtype == GGML_Q8_0) {
                const block_q8_0 *blk = (const block_q8_0 *)row + b;
                for (int j = 0; j < QK; j++) o[b * QK + j] = f16_to_f32(blk->d) * blk->qs[j];
                continue;
            }
            const uint8_t *qs;
            float d, mn;
            if (wtype == GGML_Q4_0) {
                const block_q4_0 *blk = (const block_q4_0 *)row + b;
                qs = blk->qs, d = f16_to_f32(blk->d), mn = -8.0f * d;
            } else {
                const block_q4_1 *blk = (const block_q4_1 *)row + b;
                qs = blk->qs, d = f16_to_f32(blk->d), mn = f16_to_f32(blk->m);
            }
            for (int j = 0; j < QK / 2; j++) {
                o[b * QK + j] = d * (float)(qs[j] & 0x0F) + mn;
                o[b * QK + j + QK / 2] = d * (float)(qs[j] >> 4) + mn;
            }
        }
    }
    return 0;
}

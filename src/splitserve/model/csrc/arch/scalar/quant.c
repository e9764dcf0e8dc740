/*
 * The quantized matmul's portable kernels, for builds with neither x86 vectors nor NEON (the `scalar` level,
 * and any other architecture): the same repacked layout (../../quant.h) in plain loops, signed codes (Q4_0
 * q - 8 through m_w = -8 d, Q4_1 through its min, Q8_0 as stored).
 */
#include "../../quant.h"

#if !defined(SS_AVX2) && !defined(SS_NEON)
/* Block kb of a group: each row's 32 codes, and row r's scale d_w and offset m_w in d[r] and m[r]. */
static void unpack_block(const void *w, int is_q8, int64_t kb, int16_t (*u)[QK], float *d, float *m) {
    if (is_q8) {
        const group_q8 *b = (const group_q8 *)w + kb;
        for (int r = 0; r < RG; r++) {
            d[r] = f16_to_f32(b->d[r]), m[r] = 0.0f;
            for (int c = 0; c < 8; c++)
                for (int j = 0; j < 4; j++) u[r][4 * c + j] = (int8_t)b->qs[c][4 * r + j];
        }
    } else {
        const group_q4 *b = (const group_q4 *)w + kb;
        for (int r = 0; r < RG; r++) {
            d[r] = f16_to_f32(b->d[r]), m[r] = f16_to_f32(b->m[r]);
            for (int v = 0; v < 4; v++)
                for (int j = 0; j < 4; j++) {
                    u[r][4 * v + j] = b->qs[v][4 * r + j] & 0x0F;
                    u[r][16 + 4 * v + j] = b->qs[v][4 * r + j] >> 4;
                }
        }
    }
}

void group_kernel(const void *w, int is_q8, const block_q8a *const *x, int rows, int64_t nb, float *out) {
    float acc[4][RG] = {{0.0f}};
    for (int64_t kb = 0; kb < nb; kb++) {
        int16_t u[RG][QK];
        float d[RG], m[RG];
        unpack_block(w, is_q8, kb, u, d, m);
        for (int r = 0; r < RG; r++) {
            const float dw = d[r], mw = m[r];
            for (int i = 0; i < rows; i++) {
                const block_q8a *xb = x[i] + kb;
                int32_t dot = 0;
                for (int t = 0; t < QK; t++) dot += (int32_t)u[r][t] * xb->qs[t];
                acc[i][r] += dw * xb->d * (float)dot + mw * xb->s;
            }
        }
    }
    for (int i = 0; i < rows; i++)
        for (int r = 0; r < RG; r++) out[i * RG + r] = acc[i][r];
}
#endif

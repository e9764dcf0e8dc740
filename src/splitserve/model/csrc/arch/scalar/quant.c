/*
 * The quantized matmul's portable kernels, for builds with neither x86 vectors nor NEON (the `scalar` level,
 * and any other architecture): the same repacked layout (../../quant.h) in plain loops, with the unsigned codes
 * of every format but Q8_0 (signed, as stored).
 */
#include "../../quant.h"

#if !defined(SS_AVX2) && !defined(SS_NEON)
/* Codes of row r from a group's nibbles, and the fifth bit (qh) or bits 4-5 (qh6) where the format has them. */
static void row_codes(const uint8_t (*qs)[RG * 4], const uint8_t *qh, const uint8_t (*qh6)[RG * 4], int r,
                      int16_t *u) {
    for (int v = 0; v < 4; v++)
        for (int j = 0; j < 4; j++) {
            u[4 * v + j] = qs[v][4 * r + j] & 0x0F;
            u[16 + 4 * v + j] = qs[v][4 * r + j] >> 4;
        }
    for (int c = 0; c < 8; c++)
        for (int j = 0; j < 4; j++) {
            if (qh != NULL) u[4 * c + j] |= (int16_t)(((qh[4 * r + j] >> c) & 1) << 4);
            if (qh6 != NULL) u[4 * c + j] |= (int16_t)(((qh6[c / 4][4 * r + j] >> (2 * (c % 4))) & 3) << 4);
        }
}

/* Block kb of a group: each row's 32 codes, and row r's scale d_w and offset m_w in d[r] and m[r] (Q6_K: its
 * fp16 d, and the half blocks' integer scales in s0[r], s1[r]; Q2_K: also -dmin in m[r] and the half blocks'
 * mins in m0[r], m1[r]). */
static void unpack_block(const void *w, int fmt, int64_t kb, int16_t (*u)[QK], float *d, float *m, int *s0,
                         int *s1, int *m0, int *m1) {
    const int j = (int)(kb & 7);
    for (int r = 0; r < RG; r++) switch (fmt) {
            case FMT_Q8: {
                const group_q8 *b = (const group_q8 *)w + kb;
                d[r] = f16_to_f32(b->d[r]), m[r] = 0.0f;
                for (int c = 0; c < 8; c++)
                    for (int t = 0; t < 4; t++) u[r][4 * c + t] = (int8_t)b->qs[c][4 * r + t];
                break;
            }
            case FMT_Q4: {
                const group_q4 *b = (const group_q4 *)w + kb;
                d[r] = f16_to_f32(b->d[r]), m[r] = f16_to_f32(b->m[r]);
                row_codes(b->qs, NULL, NULL, r, u[r]);
                break;
            }
            case FMT_Q5: {
                const group_q5 *b = (const group_q5 *)w + kb;
                d[r] = f16_to_f32(b->d[r]), m[r] = f16_to_f32(b->m[r]);
                row_codes(b->qs, b->qh, NULL, r, u[r]);
                break;
            }
            case FMT_Q4K: {
                const group_q4k *g = (const group_q4k *)w + kb / 8;
                d[r] = f16_to_f32(g->d[r]) * (float)g->sc[j][r];
                m[r] = f16_to_f32(g->dmin[r]) * (float)(-(int)g->mn[j][r]);
                row_codes(g->qs[j], NULL, NULL, r, u[r]);
                break;
            }
            case FMT_Q5K: {
                const group_q5k *g = (const group_q5k *)w + kb / 8;
                d[r] = f16_to_f32(g->d[r]) * (float)g->sc[j][r];
                m[r] = f16_to_f32(g->dmin[r]) * (float)(-(int)g->mn[j][r]);
                row_codes(g->qs[j], g->qh[j], NULL, r, u[r]);
                break;
            }
            case FMT_IQ4: {
                const group_iq4 *b = (const group_iq4 *)w + kb;
                d[r] = f16_to_f32(b->d[r]), m[r] = 0.0f;
                row_codes(b->qs, NULL, NULL, r, u[r]);
                for (int t = 0; t < QK; t++) u[r][t] = IQ4_CODES[u[r][t]];
                break;
            }
            case FMT_IQ4K: {
                const group_iq4k *g = (const group_iq4k *)w + kb / 8;
                d[r] = f16_to_f32(g->d[r]) * (float)g->sc[j][r], m[r] = 0.0f;
                row_codes(g->qs[j], NULL, NULL, r, u[r]);
                for (int t = 0; t < QK; t++) u[r][t] = IQ4_CODES[u[r][t]];
                break;
            }
            case FMT_Q2K: {
                const group_q2k *g = (const group_q2k *)w + kb / 8;
                d[r] = f16_to_f32(g->d[r]), m[r] = -f16_to_f32(g->dmin[r]);
                s0[r] = g->sc[2 * j][r] & 0x0F, s1[r] = g->sc[2 * j + 1][r] & 0x0F;
                m0[r] = g->sc[2 * j][r] >> 4, m1[r] = g->sc[2 * j + 1][r] >> 4;
                for (int c = 0; c < 8; c++)
                    for (int t = 0; t < 4; t++) u[r][4 * c + t] = (g->qs[j][c / 4][4 * r + t] >> (2 * (c % 4))) & 3;
                break;
            }
            default: { /* FMT_Q6K */
                const group_q6k *g = (const group_q6k *)w + kb / 8;
                d[r] = f16_to_f32(g->d[r]), m[r] = 0.0f;
                s0[r] = g->sc[2 * j][r], s1[r] = g->sc[2 * j + 1][r];
                row_codes(g->ql[j], NULL, g->qh[j], r, u[r]);
                break;
            }
        }
}

void group_kernel(const void *w, int fmt, const block_q8a *const *x, int rows, int64_t nb, float *out) {
    float acc[4][RG] = {{0.0f}};
    for (int64_t kb = 0; kb < nb; kb++) {
        int16_t u[RG][QK];
        float d[RG], m[RG];
        int s0[RG], s1[RG], m0[RG], m1[RG];
        unpack_block(w, fmt, kb, u, d, m, s0, s1, m0, m1);
        for (int r = 0; r < RG; r++) {
            const float dw = d[r], mw = m[r];
            for (int i = 0; i < rows; i++) {
                const block_q8a *xb = x[i] + kb;
                int32_t dot0 = 0, dot1 = 0;
                for (int t = 0; t < QK / 2; t++) dot0 += (int32_t)u[r][t] * xb->qs[t];
                for (int t = QK / 2; t < QK; t++) dot1 += (int32_t)u[r][t] * xb->qs[t];
                if (fmt == FMT_Q6K) {
                    const int32_t isum = s0[r] * (dot0 - 32 * xb->h[0]) + s1[r] * (dot1 - 32 * xb->h[1]);
                    acc[i][r] += dw * xb->d * (float)isum;
                } else if (fmt == FMT_Q2K) {
                    const int32_t isum = s0[r] * dot0 + s1[r] * dot1, msum = m0[r] * xb->h[0] + m1[r] * xb->h[1];
                    acc[i][r] += dw * xb->d * (float)isum;
                    acc[i][r] += mw * xb->d * (float)msum;
                } else {
                    acc[i][r] += dw * xb->d * (float)(dot0 + dot1) + mw * xb->s;
                }
            }
        }
    }
    for (int i = 0; i < rows; i++)
        for (int r = 0; r < RG; r++) out[i * RG + r] = acc[i][r];
}
#endif

/*
 * The quantized matmul's ARM kernels (NEON, and ARMv8.2's 8-bit dot products where the build has them):
 * activation blocks to 8 bits, and the group kernels over the repacked layout (../../quant.h, 4 rows a group),
 * with signed codes (Q4_0 q - 8 through m_w = -8 d, Q4_1 through its min, Q8_0 as stored).
 */
#include "../../quant.h"

#if defined(SS_NEON)
static inline int32x4_t dot_lane(int32x4_t acc, int8x16_t w, int8x16_t x, const int lane) {
#if defined(__ARM_FEATURE_DOTPROD)
    switch (lane) {
        case 0: return vdotq_laneq_s32(acc, w, x, 0);
        case 1: return vdotq_laneq_s32(acc, w, x, 1);
        case 2: return vdotq_laneq_s32(acc, w, x, 2);
        default: return vdotq_laneq_s32(acc, w, x, 3);
    }
#else
    int32x4_t lanes = vreinterpretq_s32_s8(x);
    int8x16_t xb;
    switch (lane) {
        case 0: xb = vreinterpretq_s8_s32(vdupq_laneq_s32(lanes, 0)); break;
        case 1: xb = vreinterpretq_s8_s32(vdupq_laneq_s32(lanes, 1)); break;
        case 2: xb = vreinterpretq_s8_s32(vdupq_laneq_s32(lanes, 2)); break;
        default: xb = vreinterpretq_s8_s32(vdupq_laneq_s32(lanes, 3)); break;
    }
    const int16x8_t lo = vmull_s8(vget_low_s8(w), vget_low_s8(xb)), hi = vmull_high_s8(w, xb);
    return vaddq_s32(acc, vpaddlq_s16(vpaddq_s16(lo, hi)));
#endif
}

/* RG lanes of int32: for each row, the dot product of its 32 codes u (8 chunks of 4) with the block's bytes */
static inline int32x4_t dot_codes(const int8x16_t *u, const int8_t *xq) {
    const int8x16_t x0 = vld1q_s8(xq), x1 = vld1q_s8(xq + 16);
    int32x4_t dot = vdupq_n_s32(0);
    dot = dot_lane(dot, u[0], x0, 0);
    dot = dot_lane(dot, u[1], x0, 1);
    dot = dot_lane(dot, u[2], x0, 2);
    dot = dot_lane(dot, u[3], x0, 3);
    dot = dot_lane(dot, u[4], x1, 0);
    dot = dot_lane(dot, u[5], x1, 1);
    dot = dot_lane(dot, u[6], x1, 2);
    return dot_lane(dot, u[7], x1, 3);
}

static inline float32x4_t load_f16x4(const uint16_t *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }

/* Block kb of a group: its scales dw, offsets mw and codes u (8 vectors of 4 codes per row). */
static inline void unpack_block(const void *w, int is_q8, int64_t kb, float32x4_t *dw, float32x4_t *mw,
                                int8x16_t *u) {
    if (is_q8) {
        const group_q8 *b = (const group_q8 *)w + kb;
        *dw = load_f16x4(b->d), *mw = vdupq_n_f32(0.0f);
        for (int c = 0; c < 8; c++) u[c] = vld1q_s8((const int8_t *)b->qs[c]);
    } else {
        const group_q4 *b = (const group_q4 *)w + kb;
        *dw = load_f16x4(b->d), *mw = load_f16x4(b->m);
        for (int v = 0; v < 4; v++) {
            const uint8x16_t raw = vld1q_u8(b->qs[v]);
            u[v] = vreinterpretq_s8_u8(vandq_u8(raw, vdupq_n_u8(0x0F)));
            u[v + 4] = vreinterpretq_s8_u8(vshrq_n_u8(raw, 4));
        }
    }
}

/* The group kernel for `rows` activation rows: inlined into one copy per (format, rows), whose constant row
 * count unrolls the loops and keeps the accumulators in registers. */
static inline __attribute__((always_inline)) void group_rows(const void *w, const int is_q8, const block_q8a *const *x,
                                                             const int rows, int64_t nb, float *out) {
    float32x4_t acc[4];
    for (int i = 0; i < rows; i++) acc[i] = vdupq_n_f32(0.0f);
    for (int64_t kb = 0; kb < nb; kb++) {
        float32x4_t dw, mw;
        int8x16_t u[8];
        unpack_block(w, is_q8, kb, &dw, &mw, u);
        for (int i = 0; i < rows; i++) {
            const block_q8a *xb = x[i] + kb;
            const float32x4_t dot = vcvtq_f32_s32(dot_codes(u, xb->qs));
            acc[i] = vfmaq_f32(acc[i], dot, vmulq_n_f32(dw, xb->d));
            acc[i] = vfmaq_n_f32(acc[i], mw, xb->s);
        }
    }
    for (int i = 0; i < rows; i++) vst1q_f32(out + i * RG, acc[i]);
}

#include "../group_kernel.h"
#endif

/*
 * The quantized matmul's ARM kernels (NEON, and ARMv8.2's 8-bit dot products where the build has them):
 * activation blocks to 8 bits, and the group kernels over the repacked layout (../../quant.h, 4 rows a group),
 * with signed 8-bit dot products: the unsigned codes of every format but Q8_0 (at most 63) as positive bytes, Q8_0
 * as stored.
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

/* RG lanes of int32: for each row, the dot product of its codes in chunks c0 .. c0 + 3 (4 codes each) with the
 * block's bytes 4 c0 .. 4 c0 + 15 */
static inline int32x4_t dot_half(const int8x16_t *u, const int8_t *xq, int c0) {
    const int8x16_t xv = vld1q_s8(xq + 4 * c0);
    int32x4_t dot = vdupq_n_s32(0);
    dot = dot_lane(dot, u[c0], xv, 0);
    dot = dot_lane(dot, u[c0 + 1], xv, 1);
    dot = dot_lane(dot, u[c0 + 2], xv, 2);
    return dot_lane(dot, u[c0 + 3], xv, 3);
}
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
static inline int32x4_t bytes_to_i32(const void *p, int is_signed) { /* RG bytes, one per row */
    uint32_t v;
    memcpy(&v, p, sizeof v);
    const uint8x8_t b = vreinterpret_u8_u32(vdup_n_u32(v));
    if (is_signed) return vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_u8(b))));
    return vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(vmovl_u8(b))));
}

static inline void nibbles(const uint8_t (*qs)[RG * 4], int8x16_t *u) {
    for (int v = 0; v < 4; v++) {
        const uint8x16_t raw = vld1q_u8(qs[v]);
        u[v] = vreinterpretq_s8_u8(vandq_u8(raw, vdupq_n_u8(0x0F)));
        u[v + 4] = vreinterpretq_s8_u8(vshrq_n_u8(raw, 4));
    }
}
static inline void fifth_bits(const uint8_t *qh, int8x16_t *u) {
    const uint8x16_t h = vld1q_u8(qh);
    for (int c = 0; c < 8; c++) {
        const uint8x16_t bit = vandq_u8(vshlq_u8(h, vdupq_n_s8((int8_t)-c)), vdupq_n_u8(1));
        u[c] = vorrq_s8(u[c], vreinterpretq_s8_u8(vshlq_n_u8(bit, 4)));
    }
}
/* IQ4_NL's and IQ4_XS's indices (from nibbles) to the table's values, as Q8_0's codes. */
static inline void iq4_codes(int8x16_t *u) {
    const int8x16_t table = vld1q_s8(IQ4_CODES);
    for (int c = 0; c < 8; c++) u[c] = vqtbl1q_s8(table, vreinterpretq_u8_s8(u[c]));
}
/* Codes of 2 bits (group_q2k's qs, group_q6k's qh layout). */
static inline void crumbs(const uint8_t (*q)[RG * 4], int8x16_t *u) {
    for (int p = 0; p < 2; p++) {
        const uint8x16_t h = vld1q_u8(q[p]);
        for (int i = 0; i < 4; i++)
            u[4 * p + i] = vreinterpretq_s8_u8(vandq_u8(vshlq_u8(h, vdupq_n_s8((int8_t)(-2 * i))), vdupq_n_u8(3)));
    }
}
static inline void high_pairs(const uint8_t (*qh)[RG * 4], int8x16_t *u) {
    int8x16_t high[8];
    crumbs(qh, high);
    for (int c = 0; c < 8; c++) u[c] = vorrq_s8(u[c], vshlq_n_s8(high[c], 4));
}
/* d (fp16 per row) times a byte per row, negated where `negate`: exact, as the x86 kernels' */
static inline float32x4_t scaled(const uint16_t *d, const uint8_t *bytes, int negate) {
    int32x4_t ints = bytes_to_i32(bytes, 0);
    if (negate) ints = vnegq_s32(ints);
    return vmulq_f32(load_f16x4(d), vcvtq_f32_s32(ints));
}

/* Block kb of a group of any format but Q6_K and Q2_K: its scales dw, offsets mw and codes u (8 vectors of 4 codes per
 * row). */
static inline void unpack_block(const void *w, const int fmt, int64_t kb, float32x4_t *dw, float32x4_t *mw,
                                int8x16_t *u) {
    const int j = (int)(kb & 7);
    switch (fmt) {
        case FMT_Q8: {
            const group_q8 *b = (const group_q8 *)w + kb;
            *dw = load_f16x4(b->d), *mw = vdupq_n_f32(0.0f);
            for (int c = 0; c < 8; c++) u[c] = vld1q_s8((const int8_t *)b->qs[c]);
            break;
        }
        case FMT_Q4: {
            const group_q4 *b = (const group_q4 *)w + kb;
            *dw = load_f16x4(b->d), *mw = load_f16x4(b->m);
            nibbles(b->qs, u);
            break;
        }
        case FMT_Q5: {
            const group_q5 *b = (const group_q5 *)w + kb;
            *dw = load_f16x4(b->d), *mw = load_f16x4(b->m);
            nibbles(b->qs, u);
            fifth_bits(b->qh, u);
            break;
        }
        case FMT_Q4K: {
            const group_q4k *g = (const group_q4k *)w + kb / 8;
            *dw = scaled(g->d, g->sc[j], 0), *mw = scaled(g->dmin, g->mn[j], 1);
            nibbles(g->qs[j], u);
            break;
        }
        case FMT_IQ4: {
            const group_iq4 *b = (const group_iq4 *)w + kb;
            *dw = load_f16x4(b->d), *mw = vdupq_n_f32(0.0f);
            nibbles(b->qs, u);
            iq4_codes(u);
            break;
        }
        case FMT_IQ4K: {
            const group_iq4k *g = (const group_iq4k *)w + kb / 8;
            *dw = vmulq_f32(load_f16x4(g->d), vcvtq_f32_s32(bytes_to_i32(g->sc[j], 1))), *mw = vdupq_n_f32(0.0f);
            nibbles(g->qs[j], u);
            iq4_codes(u);
            break;
        }
        default: { /* FMT_Q5K */
            const group_q5k *g = (const group_q5k *)w + kb / 8;
            *dw = scaled(g->d, g->sc[j], 0), *mw = scaled(g->dmin, g->mn[j], 1);
            nibbles(g->qs[j], u);
            fifth_bits(g->qh[j], u);
            break;
        }
    }
}

/* The group kernel for `rows` activation rows of one format: inlined into one copy per (format, rows), whose
 * constants fold the format's branches, unroll the loops and keep the accumulators in registers. */
static inline __attribute__((always_inline)) void group_rows(const void *w, const int fmt, const block_q8a *const *x,
                                                             const int rows, int64_t nb, float *out) {
    float32x4_t acc[4];
    for (int i = 0; i < rows; i++) acc[i] = vdupq_n_f32(0.0f);
    for (int64_t kb = 0; kb < nb; kb++) {
        int8x16_t u[8];
        if (fmt == FMT_Q6K) { /* per half block h: s_h (D_h - 32 h_h), summed in integers */
            const group_q6k *g = (const group_q6k *)w + kb / 8;
            const int j = (int)(kb & 7);
            const float32x4_t dw = load_f16x4(g->d);
            const int32x4_t s0 = bytes_to_i32(g->sc[2 * j], 1), s1 = bytes_to_i32(g->sc[2 * j + 1], 1);
            nibbles(g->ql[j], u);
            high_pairs(g->qh[j], u);
            for (int i = 0; i < rows; i++) {
                const block_q8a *xb = x[i] + kb;
                const int32x4_t d0 = vsubq_s32(dot_half(u, xb->qs, 0), vdupq_n_s32(32 * xb->h[0]));
                const int32x4_t d1 = vsubq_s32(dot_half(u, xb->qs, 4), vdupq_n_s32(32 * xb->h[1]));
                const int32x4_t isum = vaddq_s32(vmulq_s32(s0, d0), vmulq_s32(s1, d1));
                acc[i] = vfmaq_f32(acc[i], vcvtq_f32_s32(isum), vmulq_n_f32(dw, xb->d));
            }
        } else if (fmt == FMT_Q2K) { /* per half block h: d sc_h D_h - dmin mn_h h_h, each part summed in integers */
            const group_q2k *g = (const group_q2k *)w + kb / 8;
            const int j = (int)(kb & 7);
            const float32x4_t dw = load_f16x4(g->d), mw = vnegq_f32(load_f16x4(g->dmin));
            const int32x4_t b0 = bytes_to_i32(g->sc[2 * j], 0), b1 = bytes_to_i32(g->sc[2 * j + 1], 0);
            const int32x4_t s0 = vandq_s32(b0, vdupq_n_s32(0x0F)), s1 = vandq_s32(b1, vdupq_n_s32(0x0F));
            const int32x4_t m0 = vshrq_n_s32(b0, 4), m1 = vshrq_n_s32(b1, 4);
            crumbs(g->qs[j], u);
            for (int i = 0; i < rows; i++) {
                const block_q8a *xb = x[i] + kb;
                const int32x4_t isum = vaddq_s32(vmulq_s32(s0, dot_half(u, xb->qs, 0)), vmulq_s32(s1, dot_half(u, xb->qs, 4)));
                const int32x4_t msum = vaddq_s32(vmulq_n_s32(m0, xb->h[0]), vmulq_n_s32(m1, xb->h[1]));
                acc[i] = vfmaq_f32(acc[i], vcvtq_f32_s32(isum), vmulq_n_f32(dw, xb->d));
                acc[i] = vfmaq_f32(acc[i], vcvtq_f32_s32(msum), vmulq_n_f32(mw, xb->d));
            }
        } else {
            float32x4_t dw, mw;
            unpack_block(w, fmt, kb, &dw, &mw, u);
            for (int i = 0; i < rows; i++) {
                const block_q8a *xb = x[i] + kb;
                const float32x4_t dot = vcvtq_f32_s32(dot_codes(u, xb->qs));
                acc[i] = vfmaq_f32(acc[i], dot, vmulq_n_f32(dw, xb->d));
                acc[i] = vfmaq_n_f32(acc[i], mw, xb->s);
            }
        }
    }
    for (int i = 0; i < rows; i++) vst1q_f32(out + i * RG, acc[i]);
}

#include "../group_kernel.h"
#endif

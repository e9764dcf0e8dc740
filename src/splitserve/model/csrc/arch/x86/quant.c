/*
 * The quantized matmul's x86 kernels (AVX2, AVX-VNNI, AVX-512 VNNI on 256-bit vectors): activation blocks to 8
 * bits, and the group kernels over the repacked layout (../../quant.h). The codes the instructions multiply:
 * - AVX2 (maddubs: unsigned x signed bytes): Q4/Q5/Q6 codes as unsigned (0..15, 0..31, 0..63), their 16-bit pair
 *   sums widened to 32 bits before they can overflow (every 8, 4 and 2 chunks of 4 codes); Q8_0 through the sign
 *   trick (|w| x sign(x, w)), m_w = 0.
 * - AVX-VNNI / AVX-512 VNNI (dpbusd): the same unsigned codes, and Q8_0 as w + 128 with m_w = -128 d.
 */
#include "../../quant.h"

#if defined(SS_AVX2)
void quantize_block(const float *x, block_q8a *y) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(x + 8 * j);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[j]));
    }
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(amax, 1), _mm256_castps256_ps128(amax));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float top = _mm_cvtss_f32(m4);
    const float d = top / 127.0f, id = top > 0.0f ? 127.0f / top : 0.0f;
    const __m256 mul = _mm256_set1_ps(id);
    __m256i q[4];
    for (int j = 0; j < 4; j++)
        q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], mul), _MM_FROUND_TO_NEAREST_INT));
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_extracti128_si256(sum, 1), _mm256_castsi256_si128(sum));
    s4 = _mm_hadd_epi32(s4, s4);
    s4 = _mm_hadd_epi32(s4, s4);
    const __m256i p16a = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
    const __m256i p8 = _mm256_packs_epi16(p16a, p16b); /* lanes interleaved by the 128-bit packs */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256((__m256i *)y->qs, _mm256_permutevar8x32_epi32(p8, order));
    y->d = d;
    y->s = d * (float)_mm_cvtsi128_si32(s4);
    half_sums(y);
}

static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

#if defined(SS_VNNI)
static inline __m256i dpbusd(__m256i acc, __m256i u, __m256i x) {
#if defined(SS_AVXVNNI)
    return _mm256_dpbusd_avx_epi32(acc, u, x);
#else
    return _mm256_dpbusd_epi32(acc, u, x);
#endif
}
#endif

static inline __m256i load32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline __m256 f16x8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline __m256i bytes_to_i32(const void *p, int is_signed) { /* 8 bytes, one per row */
    const __m128i v = _mm_loadl_epi64((const __m128i *)p);
    return is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
}

/* The integer dot product of chunks c0 .. c0 + nc - 1 (4 codes of each row per chunk) with the block's bytes, in
 * RG lanes of int32. Without VNNI the 16-bit pair sums of `per` chunks are added before widening: per x 2 x
 * (largest code) x 127 must stay below 2^15. */
static inline __m256i dot_chunks(const __m256i *u, const int8_t *xq, int c0, int nc, int per) {
    __m256i dot = _mm256_setzero_si256();
#if defined(SS_VNNI)
    (void)per;
    for (int c = c0; c < c0 + nc; c++) dot = dpbusd(dot, u[c], bcast4(xq + 4 * c));
#else
    for (int c = c0; c < c0 + nc; c += per) {
        __m256i pairs = _mm256_maddubs_epi16(u[c], bcast4(xq + 4 * c));
        for (int e = 1; e < per; e++) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(u[c + e], bcast4(xq + 4 * (c + e))));
        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    }
#endif
    return dot;
}

static inline __m256i dot_q8(const __m256i *w, const int8_t *xq) {
#if defined(SS_VNNI)
    return dot_chunks(w, xq, 0, 8, 8);
#else /* |w| x sign(x, w); each pair sum may reach 2 * 127 * 127, so widen every chunk */
    __m256i dot = _mm256_setzero_si256();
    for (int c = 0; c < 8; c++) {
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w[c], w[c]), _mm256_sign_epi8(bcast4(xq + 4 * c), w[c]));
        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    }
    return dot;
#endif
}

/* A block's full dot product for a format of unsigned codes (all but Q8). */
static inline __m256i dot_block(const __m256i *u, const int8_t *xq, const int fmt) {
    if (has_q8_codes(fmt)) return dot_q8(u, xq);
    return dot_chunks(u, xq, 0, 8, fmt == FMT_Q4 || fmt == FMT_Q4K ? 8 : 4);
}

/* Codes from nibbles (group_q4's qs layout), then the fifth bit (group_q5's qh) or bits 4-5 (group_q6k's qh). */
static inline void nibbles(const uint8_t (*qs)[RG * 4], __m256i *u) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int v = 0; v < 4; v++) {
        const __m256i raw = load32(qs[v]);
        u[v] = _mm256_and_si256(raw, low);
        u[v + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    }
}
static inline void fifth_bits(const uint8_t *qh, __m256i *u) {
    const __m256i h = load32(qh), one = _mm256_set1_epi8(1);
    for (int c = 0; c < 8; c++)
        u[c] = _mm256_or_si256(u[c], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, c), one), 4));
}
/* IQ4_NL's and IQ4_XS's indices (from nibbles) to the table's values, as Q8_0's codes. */
static inline void iq4_codes(__m256i *u) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_CODES));
    for (int c = 0; c < 8; c++) u[c] = _mm256_shuffle_epi8(table, u[c]);
}
/* Codes of 2 bits (group_q2k's qs, group_q6k's qh layout). */
static inline void crumbs(const uint8_t (*q)[RG * 4], __m256i *u) {
    const __m256i three = _mm256_set1_epi8(3);
    for (int p = 0; p < 2; p++) {
        const __m256i h = load32(q[p]);
        for (int i = 0; i < 4; i++) u[4 * p + i] = _mm256_and_si256(_mm256_srli_epi16(h, 2 * i), three);
    }
}
static inline void high_pairs(const uint8_t (*qh)[RG * 4], __m256i *u) {
    __m256i high[8];
    crumbs(qh, high);
    for (int c = 0; c < 8; c++) u[c] = _mm256_or_si256(u[c], _mm256_slli_epi16(high[c], 4));
}

/* A Q4_K or Q5_K block's scales d_w = d sc and offsets m_w = -dmin mn (exact products) for the group's rows. */
static inline void k_scales(const uint16_t *d, const uint16_t *dmin, const uint8_t *sc, const uint8_t *mn, __m256 *dw,
                            __m256 *mw) {
    *dw = _mm256_mul_ps(f16x8(d), _mm256_cvtepi32_ps(bytes_to_i32(sc, 0)));
    *mw = _mm256_mul_ps(f16x8(dmin), _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_setzero_si256(), bytes_to_i32(mn, 0))));
}

/* Block kb of a group of any format but Q6_K and Q2_K: its scales dw, offsets mw and codes u (8 vectors of 4 codes per
 * row). */
static inline void unpack_block(const void *w, const int fmt, int64_t kb, __m256 *dw, __m256 *mw, __m256i *u) {
    switch (fmt) {
        case FMT_Q8: {
            const group_q8 *b = (const group_q8 *)w + kb;
            prefetch_ahead(b, sizeof *b);
            *dw = f16x8(b->d);
            *mw = _mm256_mul_ps(*dw, _mm256_set1_ps(-(float)Q8_OFFSET));
            for (int c = 0; c < 8; c++) u[c] = load32(b->qs[c]);
            break;
        }
        case FMT_Q4: {
            const group_q4 *b = (const group_q4 *)w + kb;
            prefetch_ahead(b, sizeof *b);
            *dw = f16x8(b->d), *mw = f16x8(b->m);
            nibbles(b->qs, u);
            break;
        }
        case FMT_Q5: {
            const group_q5 *b = (const group_q5 *)w + kb;
            prefetch_ahead(b, sizeof *b);
            *dw = f16x8(b->d), *mw = f16x8(b->m);
            nibbles(b->qs, u);
            fifth_bits(b->qh, u);
            break;
        }
        case FMT_Q4K: {
            const group_q4k *g = (const group_q4k *)w + kb / 8;
            const int j = (int)(kb & 7);
            prefetch_k_unit(g, sizeof *g, kb);
            k_scales(g->d, g->dmin, g->sc[j], g->mn[j], dw, mw);
            nibbles(g->qs[j], u);
            break;
        }
        case FMT_IQ4: {
            const group_iq4 *b = (const group_iq4 *)w + kb;
            prefetch_ahead(b, sizeof *b);
            *dw = f16x8(b->d);
            *mw = _mm256_mul_ps(*dw, _mm256_set1_ps(-(float)Q8_OFFSET));
            nibbles(b->qs, u);
            iq4_codes(u);
            break;
        }
        case FMT_IQ4K: {
            const group_iq4k *g = (const group_iq4k *)w + kb / 8;
            const int j = (int)(kb & 7);
            prefetch_k_unit(g, sizeof *g, kb);
            *dw = _mm256_mul_ps(f16x8(g->d), _mm256_cvtepi32_ps(bytes_to_i32(g->sc[j], 1)));
            *mw = _mm256_mul_ps(*dw, _mm256_set1_ps(-(float)Q8_OFFSET));
            nibbles(g->qs[j], u);
            iq4_codes(u);
            break;
        }
        default: { /* FMT_Q5K */
            const group_q5k *g = (const group_q5k *)w + kb / 8;
            const int j = (int)(kb & 7);
            prefetch_k_unit(g, sizeof *g, kb);
            k_scales(g->d, g->dmin, g->sc[j], g->mn[j], dw, mw);
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
    __m256 acc[4];
    for (int i = 0; i < rows; i++) acc[i] = _mm256_setzero_ps();
    if (fmt == FMT_Q6K) {
        /* per half block h: s_h (D_h - 32 h_h), D_h the codes' dot product, summed in integers */
        for (int64_t kb = 0; kb < nb; kb++) {
            const group_q6k *g = (const group_q6k *)w + kb / 8;
            const int j = (int)(kb & 7);
            prefetch_k_unit(g, sizeof *g, kb);
            const __m256 dw = f16x8(g->d);
            const __m256i s0 = bytes_to_i32(g->sc[2 * j], 1), s1 = bytes_to_i32(g->sc[2 * j + 1], 1);
            __m256i u[8];
            nibbles(g->ql[j], u);
            high_pairs(g->qh[j], u);
            for (int i = 0; i < rows; i++) {
                const block_q8a *xb = x[i] + kb;
                const __m256i d0 = _mm256_sub_epi32(dot_chunks(u, xb->qs, 0, 4, 2), _mm256_set1_epi32(32 * xb->h[0]));
                const __m256i d1 = _mm256_sub_epi32(dot_chunks(u, xb->qs, 4, 4, 2), _mm256_set1_epi32(32 * xb->h[1]));
                const __m256i isum = _mm256_add_epi32(_mm256_mullo_epi32(s0, d0), _mm256_mullo_epi32(s1, d1));
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, _mm256_set1_ps(xb->d)), acc[i]);
            }
        }
    } else if (fmt == FMT_Q2K) {
        /* per half block h: d sc_h D_h - dmin mn_h h_h, each part summed in integers */
        const __m256i low = _mm256_set1_epi32(0x0F);
        for (int64_t kb = 0; kb < nb; kb++) {
            const group_q2k *g = (const group_q2k *)w + kb / 8;
            const int j = (int)(kb & 7);
            prefetch_k_unit(g, sizeof *g, kb);
            const __m256 dw = f16x8(g->d), mw = _mm256_sub_ps(_mm256_setzero_ps(), f16x8(g->dmin));
            const __m256i b0 = bytes_to_i32(g->sc[2 * j], 0), b1 = bytes_to_i32(g->sc[2 * j + 1], 0);
            const __m256i s0 = _mm256_and_si256(b0, low), s1 = _mm256_and_si256(b1, low);
            const __m256i m0 = _mm256_srli_epi32(b0, 4), m1 = _mm256_srli_epi32(b1, 4);
            __m256i u[8];
            crumbs(g->qs[j], u);
            for (int i = 0; i < rows; i++) {
                const block_q8a *xb = x[i] + kb;
                const __m256i isum = _mm256_add_epi32(_mm256_mullo_epi32(s0, dot_chunks(u, xb->qs, 0, 4, 4)),
                                                      _mm256_mullo_epi32(s1, dot_chunks(u, xb->qs, 4, 4, 4)));
                const __m256i msum = _mm256_add_epi32(_mm256_mullo_epi32(m0, _mm256_set1_epi32(xb->h[0])),
                                                      _mm256_mullo_epi32(m1, _mm256_set1_epi32(xb->h[1])));
                const __m256 xd = _mm256_set1_ps(xb->d);
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, xd), acc[i]);
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(mw, xd), acc[i]);
            }
        }
    } else {
        for (int64_t kb = 0; kb < nb; kb++) {
            __m256 dw, mw;
            __m256i u[8];
            unpack_block(w, fmt, kb, &dw, &mw, u);
            for (int i = 0; i < rows; i++) {
                const block_q8a *xb = x[i] + kb;
                const __m256 dot = _mm256_cvtepi32_ps(dot_block(u, xb->qs, fmt));
                acc[i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dw, _mm256_set1_ps(xb->d)), acc[i]);
                acc[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xb->s), acc[i]);
            }
        }
    }
    for (int i = 0; i < rows; i++) _mm256_storeu_ps(out + i * RG, acc[i]);
}

#include "../group_kernel.h"
#endif

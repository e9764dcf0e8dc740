/*
 * The quantized matmul's x86 kernels (AVX2, AVX-VNNI, AVX-512 VNNI on 256-bit vectors): activation blocks to 8
 * bits, and the group kernels over the repacked layout (../../quant.h). The codes the instructions multiply:
 * - AVX2 (maddubs: unsigned x signed bytes): Q4 codes 0..15 with m_w = -8 d (Q4_0) or the block min (Q4_1);
 *   Q8_0 through the sign trick (|w| x sign(x, w)), m_w = 0.
 * - AVX-VNNI / AVX-512 VNNI (dpbusd): as AVX2, but Q8_0 as w + 128 (unsigned) with m_w = -128 d.
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

/* RG lanes of int32: for each row, the dot product of its 32 codes u (8 chunks of 4) with the block's bytes */
static inline __m256i dot_q4(const __m256i *u, const int8_t *xq) {
#if defined(SS_VNNI)
    __m256i dot = _mm256_setzero_si256();
    for (int c = 0; c < 8; c++) dot = dpbusd(dot, u[c], bcast4(xq + 4 * c));
    return dot;
#else /* codes are at most 15, so eight 16-bit pair sums stay below 2^15 */
    __m256i pairs = _mm256_maddubs_epi16(u[0], bcast4(xq));
    for (int c = 1; c < 8; c++) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(u[c], bcast4(xq + 4 * c)));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

static inline __m256i dot_q8(const __m256i *w, const int8_t *xq) {
    __m256i dot = _mm256_setzero_si256();
#if defined(SS_VNNI)
    for (int c = 0; c < 8; c++) dot = dpbusd(dot, w[c], bcast4(xq + 4 * c));
#else /* |w| x sign(x, w); each pair sum may reach 2 * 127 * 127, so widen every chunk */
    for (int c = 0; c < 8; c++) {
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w[c], w[c]), _mm256_sign_epi8(bcast4(xq + 4 * c), w[c]));
        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    }
#endif
    return dot;
}

/* Block kb of a group: its scales dw, offsets mw and codes u (8 vectors of 4 codes per row). */
static inline void unpack_block(const void *w, int is_q8, int64_t kb, __m256 *dw, __m256 *mw, __m256i *u) {
    if (is_q8) {
        const group_q8 *b = (const group_q8 *)w + kb;
        prefetch_ahead(b, sizeof *b);
        *dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b->d));
        *mw = _mm256_mul_ps(*dw, _mm256_set1_ps(-(float)Q8_OFFSET));
        for (int c = 0; c < 8; c++) u[c] = _mm256_loadu_si256((const __m256i *)b->qs[c]);
    } else {
        const group_q4 *b = (const group_q4 *)w + kb;
        prefetch_ahead(b, sizeof *b);
        *dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b->d));
        *mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b->m));
        const __m256i low = _mm256_set1_epi8(0x0F);
        for (int v = 0; v < 4; v++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)b->qs[v]);
            u[v] = _mm256_and_si256(raw, low);
            u[v + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        }
    }
}

/* The group kernel for `rows` activation rows: inlined into one copy per (format, rows), whose constant row
 * count unrolls the loops and keeps the accumulators in registers. */
static inline __attribute__((always_inline)) void group_rows(const void *w, const int is_q8, const block_q8a *const *x,
                                                             const int rows, int64_t nb, float *out) {
    __m256 acc[4];
    for (int i = 0; i < rows; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t kb = 0; kb < nb; kb++) {
        __m256 dw, mw;
        __m256i u[8];
        unpack_block(w, is_q8, kb, &dw, &mw, u);
        for (int i = 0; i < rows; i++) {
            const block_q8a *xb = x[i] + kb;
            const __m256 dot = _mm256_cvtepi32_ps(is_q8 ? dot_q8(u, xb->qs) : dot_q4(u, xb->qs));
            acc[i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dw, _mm256_set1_ps(xb->d)), acc[i]);
            acc[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xb->s), acc[i]);
        }
    }
    for (int i = 0; i < rows; i++) _mm256_storeu_ps(out + i * RG, acc[i]);
}

#include "../group_kernel.h"
#endif

/*
 * The quantized matmul for many activation rows on AVX-512 VNNI (../../quant.h): 512-bit dpbusd over two
 * repacked groups at once (16 weight rows per vector), for up to WIDE_ROWS activation rows per tile. A tile's
 * codes are unpacked once into a buffer and then serve every row tile, and each activation block's 4-byte chunks
 * are broadcast to every lane, so a block costs each row 8 dpbusd (and their broadcasts) and 4 float
 * operations. The integers are those of the 256-bit group kernel (arch/x86/quant.c) and of
 * the AMX tiles, and each block's float work is theirs too, in the same order: acc += d_w d_x dot, then
 * acc += m_w s_x. So every row's result has the same bits whichever kernel computed it.
 *
 * The register budget: 8 code vectors, the scales and offsets, and one accumulator per row.
 */
#include <omp.h>
#include <stdlib.h>

#include "../../quant.h"
#include "../../simd.h"

#if defined(SS_AVX512) && defined(SS_VNNI) && !defined(SS_AVXVNNI)

#define WIDE_ROWS 8

/* One block of a 16-row tile, unpacked: the codes as the dpbusd reads them, the scales and the offsets (Q6_K:
 * its d and the half blocks' integer scales s0, s1; Q2_K: also -dmin in mw and the half blocks' mins m0, m1). */
typedef struct {
    __m512i u[8];
    __m512 dw, mw;
    __m512i s0, s1, m0, m1;
} wide_block;

/* Block kb of two Q6_K groups (gb NULL: zeros) for 16 weight rows: the codes, d, and the two half blocks' integer
 * scales. */
static inline void unpack16_q6k(const uint8_t *ga, const uint8_t *gb, int64_t kb, __m512i *u, __m512 *dw, __m512i *s0,
                                __m512i *s1) {
    const group_q6k *a = (const group_q6k *)ga + kb / 8, *b = gb != NULL ? (const group_q6k *)gb + kb / 8 : NULL;
    const int j = (int)(kb & 7);
    const __m512i low = _mm512_set1_epi8(0x0F), three = _mm512_set1_epi8(3);
    *dw = join_groups_f16(a->d, b != NULL ? b->d : NULL);
    for (int h = 0; h < 2; h++) {
        const __m128i lo = _mm_loadl_epi64((const __m128i *)a->sc[2 * j + h]);
        const __m128i hi = b != NULL ? _mm_loadl_epi64((const __m128i *)b->sc[2 * j + h]) : _mm_setzero_si128();
        *(h == 0 ? s0 : s1) = _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(lo, hi));
    }
    for (int v = 0; v < 4; v++) {
        const __m512i raw = join_groups(a->ql[j][v], b != NULL ? b->ql[j][v] : NULL);
        u[v] = _mm512_and_si512(raw, low);
        u[v + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
    for (int p = 0; p < 2; p++) {
        const __m512i h = join_groups(a->qh[j][p], b != NULL ? b->qh[j][p] : NULL);
        for (int i = 0; i < 4; i++)
            u[4 * p + i] = _mm512_or_si512(u[4 * p + i], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 2 * i), three), 4));
    }
}

/* Block kb of two Q2_K groups (gb NULL: zeros) for 16 weight rows: the codes, d, -dmin, and the two half blocks'
 * integer scales and mins. */
static inline void unpack16_q2k(const uint8_t *ga, const uint8_t *gb, int64_t kb, wide_block *out) {
    const group_q2k *a = (const group_q2k *)ga + kb / 8, *b = gb != NULL ? (const group_q2k *)gb + kb / 8 : NULL;
    const int j = (int)(kb & 7);
    const __m512i three = _mm512_set1_epi8(3), low = _mm512_set1_epi32(0x0F);
    out->dw = join_groups_f16(a->d, b != NULL ? b->d : NULL);
    out->mw = _mm512_sub_ps(_mm512_setzero_ps(), join_groups_f16(a->dmin, b != NULL ? b->dmin : NULL));
    for (int h = 0; h < 2; h++) {
        const __m128i lo = _mm_loadl_epi64((const __m128i *)a->sc[2 * j + h]);
        const __m128i hi = b != NULL ? _mm_loadl_epi64((const __m128i *)b->sc[2 * j + h]) : _mm_setzero_si128();
        const __m512i both = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(lo, hi));
        *(h == 0 ? &out->s0 : &out->s1) = _mm512_and_si512(both, low);
        *(h == 0 ? &out->m0 : &out->m1) = _mm512_srli_epi32(both, 4);
    }
    for (int p = 0; p < 2; p++) {
        const __m512i q = join_groups(a->qs[j][p], b != NULL ? b->qs[j][p] : NULL);
        for (int i = 0; i < 4; i++) out->u[4 * p + i] = _mm512_and_si512(_mm512_srli_epi16(q, 2 * i), three);
    }
}

/* Block kb of groups ga and gb (gb NULL: zero codes and scales), any format. */
static inline void wide_unpack_block(const uint8_t *ga, const uint8_t *gb, const int fmt, int64_t kb, wide_block *out) {
    if (fmt == FMT_Q6K)
        unpack16_q6k(ga, gb, kb, out->u, &out->dw, &out->s0, &out->s1);
    else if (fmt == FMT_Q2K)
        unpack16_q2k(ga, gb, kb, out);
    else
        unpack16(ga, gb, fmt, kb, out->u, &out->dw, &out->mw);
}

/* Groups ga and gb block by block into out[nb]. */
static void wide_unpack(const uint8_t *ga, const uint8_t *gb, int fmt, int64_t nb, wide_block *out) {
    for (int64_t kb = 0; kb < nb; kb++) wide_unpack_block(ga, gb, fmt, kb, out + kb);
}

static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

/* acc plus one unpacked block's product with one activation row's block, for the tile's 16 weight rows: the
 * integers and float operations of every kernel (quant.h), written once for the buffered tiles and the decode
 * rows alike. `half`: FMT_Q6K or FMT_Q2K for those formats' half-block sums, else any other format. */
static inline __attribute__((always_inline)) __m512 block_row(const wide_block *b, const block_q8a *xb, const int half,
                                                              __m512 acc) {
    if (half == FMT_Q2K) { /* per half block h: d sc_h D_h - dmin mn_h h_h, each part summed in integers */
        __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
        for (int c = 0; c < 4; c++) {
            d0 = _mm512_dpbusd_epi32(d0, b->u[c], bcast4(xb->qs + 4 * c));
            d1 = _mm512_dpbusd_epi32(d1, b->u[c + 4], bcast4(xb->qs + 4 * (c + 4)));
        }
        const __m512i isum = _mm512_add_epi32(_mm512_mullo_epi32(b->s0, d0), _mm512_mullo_epi32(b->s1, d1));
        const __m512i msum = _mm512_add_epi32(_mm512_mullo_epi32(b->m0, _mm512_set1_epi32(xb->h[0])),
                                              _mm512_mullo_epi32(b->m1, _mm512_set1_epi32(xb->h[1])));
        const __m512 xd = _mm512_set1_ps(xb->d);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(b->dw, xd), acc);
        return _mm512_fmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(b->mw, xd), acc);
    }
    if (half == FMT_Q6K) { /* per half block h: s_h (D_h - 32 h_h), summed in integers */
        __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
        for (int c = 0; c < 4; c++) {
            d0 = _mm512_dpbusd_epi32(d0, b->u[c], bcast4(xb->qs + 4 * c));
            d1 = _mm512_dpbusd_epi32(d1, b->u[c + 4], bcast4(xb->qs + 4 * (c + 4)));
        }
        d0 = _mm512_sub_epi32(d0, _mm512_set1_epi32(32 * xb->h[0]));
        d1 = _mm512_sub_epi32(d1, _mm512_set1_epi32(32 * xb->h[1]));
        const __m512i isum = _mm512_add_epi32(_mm512_mullo_epi32(b->s0, d0), _mm512_mullo_epi32(b->s1, d1));
        return _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(b->dw, _mm512_set1_ps(xb->d)), acc);
    }
    /* two chains of four, added: the same integer as one chain of eight */
    __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), b->u[0], bcast4(xb->qs));
    __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), b->u[1], bcast4(xb->qs + 4));
    for (int c = 2; c < 8; c += 2) {
        d0 = _mm512_dpbusd_epi32(d0, b->u[c], bcast4(xb->qs + 4 * c));
        d1 = _mm512_dpbusd_epi32(d1, b->u[c + 1], bcast4(xb->qs + 4 * c + 4));
    }
    const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1));
    acc = _mm512_fmadd_ps(dot, _mm512_mul_ps(b->dw, _mm512_set1_ps(xb->d)), acc);
    return _mm512_fmadd_ps(b->mw, _mm512_set1_ps(xb->s), acc);
}

/* `rows` activation rows (nb blocks each, consecutive) x the tile's 16 weight rows, into acc. Inlined into one
 * copy per row count, so the loops unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void wide_rows(const wide_block *wb, const block_q8a *x, const int rows,
                                                            int64_t nb, const int half, __m512 *acc) {
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < nb; kb++)
        for (int r = 0; r < rows; r++) acc[r] = block_row(wb + kb, x + r * nb + kb, half, acc[r]);
}

#define SS_WIDE_ROWS(Q)                                          \
    switch (rows) {                                              \
        case 1: wide_rows(wb, x, 1, nb, Q, acc); break;          \
        case 2: wide_rows(wb, x, 2, nb, Q, acc); break;          \
        case 3: wide_rows(wb, x, 3, nb, Q, acc); break;          \
        case 4: wide_rows(wb, x, 4, nb, Q, acc); break;          \
        case 5: wide_rows(wb, x, 5, nb, Q, acc); break;          \
        case 6: wide_rows(wb, x, 6, nb, Q, acc); break;          \
        case 7: wide_rows(wb, x, 7, nb, Q, acc); break;          \
        default: wide_rows(wb, x, WIDE_ROWS, nb, Q, acc); break; \
    }

static void wide_tile(const wide_block *wb, const block_q8a *x, int rows, int64_t nb, int fmt, __m512 *acc) {
    if (fmt == FMT_Q6K) {
        SS_WIDE_ROWS(FMT_Q6K)
    } else if (fmt == FMT_Q2K) {
        SS_WIDE_ROWS(FMT_Q2K)
    } else {
        SS_WIDE_ROWS(FMT_Q8)
    }
}
#undef SS_WIDE_ROWS

static inline void store_row(void *y, int out_dtype, int64_t base, __mmask16 keep, __m512 v) {
    if (out_dtype == SS_F32) {
        _mm512_mask_storeu_ps((float *)y + base, keep, v);
        return;
    }
    _mm256_mask_storeu_epi16((uint16_t *)y + base, keep, vto_bf16(v));
}

static void wide_qgemm_body(const void *w, int wtype, int64_t n, int64_t k, const block_q8a *xq, int64_t m,
                            void *y, int out_dtype, int64_t ldy, wide_block *wb) {
    const int fmt = format_of(wtype);
    const int64_t nb = k / QK, groups = (n + RG - 1) / RG, tiles = (groups + 1) / 2;
    const int64_t group_bytes = group_bytes_of(fmt, nb);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *ga = (const uint8_t *)w + 2 * t * group_bytes;
        const uint8_t *gb = 2 * t + 1 < groups ? ga + group_bytes : NULL;
        wide_unpack(ga, gb, fmt, nb, wb);
        if (t + 1 < tiles) { /* the next tile's weights on their way while this one computes (a decode step's
                              * few rows: on a Zen 4, every matrix of SmolLM2 once at 8 rows 8.0-8.3 -> 7.4 ms,
                              * at 16 rows 11.7-12.0 -> 11.0) */
            const uint8_t *next = ga + 2 * group_bytes;
            const int64_t bytes = (2 * t + 3 < groups ? 2 : 1) * group_bytes;
            for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)next + b, _MM_HINT_T1);
        }
        const int cols = n - 2 * t * RG >= 16 ? 16 : (int)(n - 2 * t * RG);
        const __mmask16 keep = (__mmask16)((1u << cols) - 1);
        for (int64_t i0 = 0; i0 < m; i0 += WIDE_ROWS) {
            const int rows = m - i0 >= WIDE_ROWS ? WIDE_ROWS : (int)(m - i0);
            __m512 acc[WIDE_ROWS];
            wide_tile(wb, xq + i0 * nb, rows, nb, fmt, acc);
            for (int r = 0; r < rows; r++) store_row(y, out_dtype, (i0 + r) * ldy + 2 * t * RG, keep, acc[r]);
        }
    }
}

/* Up to 4 activation rows (a decode step's) straight from the repacked groups, two groups (16 weight rows) per
 * 512-bit vector and no buffer: half the instructions per weight byte of the 256-bit group kernels, which a
 * single stream's step, bound by how fast one core can pull weights through, feels (a 1B-sized pass of Q4_K
 * weights at one row: 34 -> 29 ms on 2 AMX-class cores, Q6_K 55 -> 48; software prefetch made no difference
 * here). The same integers and float operations as every other kernel: a row's bits do not change. Built for
 * the amx build only: on a Zen 4 (the avx512 build) it loses to the 256-bit group kernels (every matrix of
 * SmolLM2 once at one row, both cores: 6.5 against 4.4 ms; 4 rows 9.5 against 6.9; prefetch did not help). */
#if defined(SS_AMX)
static inline __attribute__((always_inline)) void stream_rows(const uint8_t *ga, const uint8_t *gb, const int fmt,
                                                              const block_q8a *const *x, const int rows, int64_t nb,
                                                              __m512 *acc) {
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < nb; kb++) {
        wide_block b;
        wide_unpack_block(ga, gb, fmt, kb, &b);
        for (int r = 0; r < rows; r++) acc[r] = block_row(&b, x[r] + kb, fmt, acc[r]);
    }
}

#define SS_STREAM_ROWS(F)                                                 \
    switch (rows) {                                                       \
        case 1: stream_rows(ga, gb, F, x, 1, nb, acc); break;             \
        case 2: stream_rows(ga, gb, F, x, 2, nb, acc); break;             \
        case 3: stream_rows(ga, gb, F, x, 3, nb, acc); break;             \
        default: stream_rows(ga, gb, F, x, 4, nb, acc); break;            \
    }

static void stream_tile(const uint8_t *ga, const uint8_t *gb, int fmt, const block_q8a *const *x, int rows, int64_t nb,
                        __m512 *acc) {
    switch (fmt) {
        case FMT_Q4: SS_STREAM_ROWS(FMT_Q4) break;
        case FMT_Q5: SS_STREAM_ROWS(FMT_Q5) break;
        case FMT_Q8: SS_STREAM_ROWS(FMT_Q8) break;
        case FMT_IQ4: SS_STREAM_ROWS(FMT_IQ4) break;
        case FMT_Q4K: SS_STREAM_ROWS(FMT_Q4K) break;
        case FMT_Q5K: SS_STREAM_ROWS(FMT_Q5K) break;
        case FMT_Q2K: SS_STREAM_ROWS(FMT_Q2K) break;
        case FMT_IQ4K: SS_STREAM_ROWS(FMT_IQ4K) break;
        default: SS_STREAM_ROWS(FMT_Q6K) break;
    }
}
#undef SS_STREAM_ROWS

int stream_quant_matmul(const block_q8a *xq, int64_t m, int64_t k, const void *w, int wtype, int64_t n, void *y,
                        int out_dtype, int64_t ldy, int threads) {
    const int fmt = format_of(wtype);
    if (m > 4) return -1;
    const int64_t nb = k / QK, groups = (n + RG - 1) / RG, tiles = (groups + 1) / 2;
    const int64_t group_bytes = group_bytes_of(fmt, nb);
    const block_q8a *x[4];
    for (int64_t r = 0; r < m; r++) x[r] = xq + r * nb;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *ga = (const uint8_t *)w + 2 * t * group_bytes;
        const uint8_t *gb = 2 * t + 1 < groups ? ga + group_bytes : NULL;
        const int cols = n - 2 * t * RG >= 16 ? 16 : (int)(n - 2 * t * RG);
        const __mmask16 keep = (__mmask16)((1u << cols) - 1);
        __m512 acc[4];
        stream_tile(ga, gb, fmt, x, (int)m, nb, acc);
        for (int r = 0; r < m; r++) store_row(y, out_dtype, r * ldy + 2 * t * RG, keep, acc[r]);
    }
    return 0;
}
#endif

int wide_quant_matmul(const block_q8a *xq, int64_t m, int64_t k, const void *w, int wtype, int64_t n, void *y,
                      int out_dtype, int64_t ldy, int threads) {
    const int64_t nb = k / QK;
    wide_block *buffers = aligned_alloc(64, sizeof(wide_block) * (size_t)(nb * threads));
    if (buffers == NULL) return -1;
#pragma omp parallel num_threads(threads)
    wide_qgemm_body(w, wtype, n, k, xq, m, y, out_dtype, ldy, buffers + (int64_t)omp_get_thread_num() * nb);
    free(buffers);
    return 0;
}
#endif

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

/* One block of a 16-row tile, unpacked: the codes as the dpbusd reads them, the scales and the offsets. */
typedef struct {
    __m512i u[8];
    __m512 dw, mw;
} wide_block;

/* Groups ga and gb (gb NULL: zero codes and scales) block by block into out[nb]. */
static void wide_unpack(const uint8_t *ga, const uint8_t *gb, int fmt, int64_t nb, wide_block *out) {
    for (int64_t kb = 0; kb < nb; kb++) unpack16(ga, gb, fmt, kb, out[kb].u, &out[kb].dw, &out[kb].mw);
}

static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

/* `rows` activation rows (nb blocks each, consecutive) x the tile's 16 weight rows, into acc. Inlined into one
 * copy per row count, so the loops unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void wide_rows(const wide_block *wb, const block_q8a *x, const int rows,
                                                            int64_t nb, __m512 *acc) {
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < nb; kb++) {
        const wide_block *b = wb + kb;
        for (int r = 0; r < rows; r++) {
            const block_q8a *xb = x + r * nb + kb;
            /* two chains of four, added: the same integer as one chain of eight */
            __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), b->u[0], bcast4(xb->qs));
            __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), b->u[1], bcast4(xb->qs + 4));
            for (int c = 2; c < 8; c += 2) {
                d0 = _mm512_dpbusd_epi32(d0, b->u[c], bcast4(xb->qs + 4 * c));
                d1 = _mm512_dpbusd_epi32(d1, b->u[c + 1], bcast4(xb->qs + 4 * c + 4));
            }
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1));
            acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(b->dw, _mm512_set1_ps(xb->d)), acc[r]);
            acc[r] = _mm512_fmadd_ps(b->mw, _mm512_set1_ps(xb->s), acc[r]);
        }
    }
}

static void wide_tile(const wide_block *wb, const block_q8a *x, int rows, int64_t nb, __m512 *acc) {
    switch (rows) {
        case 1: wide_rows(wb, x, 1, nb, acc); break;
        case 2: wide_rows(wb, x, 2, nb, acc); break;
        case 3: wide_rows(wb, x, 3, nb, acc); break;
        case 4: wide_rows(wb, x, 4, nb, acc); break;
        case 5: wide_rows(wb, x, 5, nb, acc); break;
        case 6: wide_rows(wb, x, 6, nb, acc); break;
        case 7: wide_rows(wb, x, 7, nb, acc); break;
        default: wide_rows(wb, x, WIDE_ROWS, nb, acc); break;
    }
}

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
        const int cols = n - 2 * t * RG >= 16 ? 16 : (int)(n - 2 * t * RG);
        const __mmask16 keep = (__mmask16)((1u << cols) - 1);
        for (int64_t i0 = 0; i0 < m; i0 += WIDE_ROWS) {
            const int rows = m - i0 >= WIDE_ROWS ? WIDE_ROWS : (int)(m - i0);
            __m512 acc[WIDE_ROWS];
            wide_tile(wb, xq + i0 * nb, rows, nb, acc);
            for (int r = 0; r < rows; r++) store_row(y, out_dtype, (i0 + r) * ldy + 2 * t * RG, keep, acc[r]);
        }
    }
}

int wide_quant_matmul(const block_q8a *xq, int64_t m, int64_t k, const void *w, int wtype, int64_t n, void *y,
                      int out_dtype, int64_t ldy, int threads) {
    const int64_t nb = k / QK;
    if (format_of(wtype) == FMT_Q6K) return -1; /* its half-block scales: the group kernels */
    wide_block *buffers = aligned_alloc(64, sizeof(wide_block) * (size_t)(nb * threads));
    if (buffers == NULL) return -1;
#pragma omp parallel num_threads(threads)
    wide_qgemm_body(w, wtype, n, k, xq, m, y, out_dtype, ldy, buffers + (int64_t)omp_get_thread_num() * nb);
    free(buffers);
    return 0;
}
#endif

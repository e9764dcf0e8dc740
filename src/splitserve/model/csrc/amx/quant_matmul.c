/*
 * The quantized matmul on AMX-INT8 tiles: from AMX_MIN_ROWS activation rows on (../quant.h), each block
 * product runs on AMX tiles: 16 activation rows x 16 weight rows (two repacked groups) per TDPBSUD (signed
 * activation bytes x unsigned weight codes, K = one block of 32). The repacked layout already holds each weight row's codes 4 at a time, which is the tile's VNNI form:
 * B row v is group A's qs[v] beside group B's, low nibbles (weights 4v..4v+3), and row v + 4 their high
 * nibbles (16 + 4v..); Q8_0 codes are byte-for-byte B rows. The same integers as the AVX-512 VNNI path; each
 * block's int32 tile is then scaled in float32 as there (d_w d_x, plus m_w s_x). A thread unpacks a weight
 * tile's codes once (amx_weights) and runs every 16-row chunk of the activations over them (amx_chunk).
 */
#include <stdlib.h>

#include "../quant.h"
#include "../ss_kernels.h"

#if defined(SS_AMX)

/* Blocks between starting a block's product and scaling its dot products: at least 2, since a block's tile
 * is stored one iteration after its product starts (amx_chunk). */
#define AMX_AHEAD 2
#define AMX_RING 4 /* dot-product buffers, more than AMX_AHEAD: blocks kb - AMX_AHEAD .. kb - 1 */
_Static_assert(AMX_AHEAD >= 2 && AMX_RING > AMX_AHEAD, "amx_chunk's pipeline");

static void amx_configure(int rows) {
    ss_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 6; t += 3) { /* two sets, so that consecutive blocks need not wait for each other */
        cfg.rows[t] = (uint8_t)rows, cfg.colsb[t] = 64;         /* C: rows x 16 int32 */
        cfg.rows[t + 1] = (uint8_t)rows, cfg.colsb[t + 1] = QK; /* A: rows x 32 activation bytes */
        cfg.rows[t + 2] = QK / 4, cfg.colsb[t + 2] = 64;        /* B: 8 rows of 16 weight rows x 4 codes */
    }
    _tile_loadconfig(&cfg);
}

/* Block kb of groups ga and gb (gb may be NULL: zero codes) as one B tile of codes, with its 16 scales and
 * offsets. */
static inline void amx_codes(const uint8_t *ga, const uint8_t *gb, int fmt, int64_t kb, uint8_t codes[8][64],
                             __m512 *dw, __m512 *mw) {
    const size_t unit = format_unit_bytes(fmt);
    if (!is_k_format(fmt)) {
        prefetch_ahead(ga + kb * (int64_t)unit, unit);
        if (gb != NULL) prefetch_ahead(gb + kb * (int64_t)unit, unit);
    } else {
        prefetch_k_unit(ga + kb / 8 * (int64_t)unit, unit, kb);
        if (gb != NULL) prefetch_k_unit(gb + kb / 8 * (int64_t)unit, unit, kb);
    }
    __m512i u[8];
    unpack16(ga, gb, fmt, kb, u, dw, mw);
    for (int c = 0; c < 8; c++) _mm512_store_si512(codes[c], u[c]);
}

/* One block of up to 16 activation rows as an A tile (rows 32 bytes apart: aligned, unlike block_q8a's). */
typedef struct {
    int8_t qs[16][QK];
    float d[16], s[16];
} amx_act;

/* The activation blocks [m][nb] as [m / 16 chunks][nb] A tiles. */
static void amx_activations(const block_q8a *xq, int64_t m, int64_t nb, amx_act *out) {
    for (int64_t i0 = 0; i0 < m; i0 += 16)
        for (int64_t kb = 0; kb < nb; kb++) {
            amx_act *a = out + (i0 / 16) * nb + kb;
            for (int r = 0; r < 16 && i0 + r < m; r++) {
                const block_q8a *x = xq + (i0 + r) * nb + kb;
                memcpy(a->qs[r], x->qs, QK);
                a->d[r] = x->d, a->s[r] = x->s;
            }
        }
}

/* acc[r] += d_w d_x dot + m_w s_x for each activation row of block a. */
SS_INLINE void amx_scale(__m512 *acc, int rows, int32_t dots[16][16], const amx_act *a, __m512 dw, __m512 mw) {
    for (int r = 0; r < rows; r++) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(dots[r]));
        acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, _mm512_set1_ps(a->d[r])), acc[r]);
        acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a->s[r]), acc[r]);
    }
}

/* One block's integer dot products on tile set (C, A, B), left in C (stored a block later: AMX_STORE). */
#define AMX_BLOCK(C, A, B, act, codes) \
    do {                               \
        _tile_zero(C);                 \
        _tile_loadd(A, (act)->qs, QK); \
        _tile_loadd(B, codes, 64);     \
        _tile_dpbsud(C, A, B);         \
    } while (0)
#define AMX_STORE(C, dots) _tile_stored(C, dots, 64)

/* One weight tile's blocks, unpacked once for every chunk of activation rows: B tiles of codes and the 16
 * rows' scales and offsets per block. */
typedef struct {
    uint8_t codes[QK / 4][64];
    __m512 dw, mw;
} amx_weights;

/* Rows i0 .. i0 + rows - 1 (rows a constant where it is 16, so the accumulators stay in registers) of one
 * weight tile (wt: its nb blocks), into y's columns col0 .. col0 + cols - 1. A pipeline over blocks, the two
 * tile sets in turn: each iteration first scales the dot products of block kb - AMX_AHEAD (stored an iteration
 * ago), then starts block kb's product, then stores block kb - 1's, so that no store waits on the product just
 * issued and no vector load queues behind a tile store (measured on Sapphire Rapids: each of the two orders
 * cost about a quarter of the time, and the accumulators spilled to the stack while rows was not a constant:
 * gate/up at 1,024 rows 8.1 -> 3.8-5.3 ms on 2 cores, the VM's spread). */
SS_INLINE void amx_chunk(const amx_weights *wt, int64_t nb, const amx_act *xb, int rows, int cols, void *y,
                         int out_dtype, int64_t ldy, int64_t i0, int64_t col0) {
    __m512 acc[16];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    _Alignas(64) int32_t dots[AMX_RING][16][16];
    for (int64_t kb = 0; kb < nb; kb++) {
        if (kb >= AMX_AHEAD) {
            const int64_t old = kb - AMX_AHEAD;
            amx_scale(acc, rows, dots[old % AMX_RING], xb + old, wt[old].dw, wt[old].mw);
        }
        if (kb & 1) {
            AMX_BLOCK(3, 4, 5, xb + kb, wt[kb].codes);
            AMX_STORE(0, dots[(kb - 1) % AMX_RING]);
        } else {
            AMX_BLOCK(0, 1, 2, xb + kb, wt[kb].codes);
            if (kb > 0) AMX_STORE(3, dots[(kb - 1) % AMX_RING]);
        }
    }
    if ((nb - 1) & 1)
        AMX_STORE(3, dots[(nb - 1) % AMX_RING]);
    else
        AMX_STORE(0, dots[(nb - 1) % AMX_RING]);
    for (int64_t kb = nb > AMX_AHEAD ? nb - AMX_AHEAD : 0; kb < nb; kb++)
        amx_scale(acc, rows, dots[kb % AMX_RING], xb + kb, wt[kb].dw, wt[kb].mw);
    const __mmask16 keep = (__mmask16)((1u << cols) - 1);
    for (int r = 0; r < rows; r++) {
        const int64_t base = (i0 + r) * ldy + col0;
        if (out_dtype == SS_F32)
            _mm512_mask_storeu_ps((float *)y + base, keep, acc[r]);
        else
            _mm256_mask_storeu_epi16((uint16_t *)y + base, keep, (__m256i)_mm512_cvtneps_pbh(acc[r]));
    }
}

static void amx_qgemm_body(const void *w, int wtype, int64_t n, int64_t k, const amx_act *xa, int64_t m, void *y,
                           int out_dtype, int64_t ldy, amx_weights *wt) {
    const int fmt = format_of(wtype);
    const int64_t nb = k / QK, groups = (n + RG - 1) / RG, tiles = (groups + 1) / 2;
    const int64_t group_bytes = group_bytes_of(fmt, nb);
    int configured = 0;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *ga = (const uint8_t *)w + 2 * t * group_bytes;
        const uint8_t *gb = 2 * t + 1 < groups ? ga + group_bytes : NULL;
        const int cols = n - 2 * t * RG >= 16 ? 16 : (int)(n - 2 * t * RG);
        for (int64_t kb = 0; kb < nb; kb++) amx_codes(ga, gb, fmt, kb, wt[kb].codes, &wt[kb].dw, &wt[kb].mw);
        for (int64_t i0 = 0; i0 < m; i0 += 16) {
            const int rows = m - i0 >= 16 ? 16 : (int)(m - i0);
            if (rows != configured) amx_configure(configured = rows);
            if (rows == 16)
                amx_chunk(wt, nb, xa + (i0 / 16) * nb, 16, cols, y, out_dtype, ldy, i0, 2 * t * RG);
            else
                amx_chunk(wt, nb, xa + (i0 / 16) * nb, rows, cols, y, out_dtype, ldy, i0, 2 * t * RG);
        }
    }
    if (configured) _tile_release();
}

int amx_quant_matmul(const block_q8a *xq, int64_t m, int64_t k, const void *w, int wtype, int64_t n, void *y,
                     int out_dtype, int64_t ldy, int threads) {
    if (!ss_amx_permitted() || is_half_format(format_of(wtype))) return -1; /* Q6_K, Q2_K: the VNNI tiles */
    amx_act *xa = aligned_alloc(64, sizeof(amx_act) * (size_t)((m + 15) / 16 * (k / QK)));
    if (xa == NULL) return -1;
    amx_activations(xq, m, k / QK, xa);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        amx_weights *wt = aligned_alloc(64, sizeof(amx_weights) * (size_t)(k / QK));
        if (wt == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) amx_qgemm_body(w, wtype, n, k, xa, m, y, out_dtype, ldy, wt);
        free(wt);
    }
    free(xa);
    return failed ? -1 : 0;
}
#endif

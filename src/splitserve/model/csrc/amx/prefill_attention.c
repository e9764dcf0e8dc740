/*
 * Prefill attention on AMX tiles: a chunk of Q query tokens of one sequence attends causally to its C context
 * tokens (a cached prefix plus the chunk itself), bfloat16 in and out, float32 softmax.
 *
 * Only the `amx` build computes it (AMX-BF16 tiles for both matmuls, AVX-512 for the softmax); every other
 * build returns -1 and the caller uses PyTorch's SDPA. Why a kernel of our own: PyTorch's CPU flash attention
 * reaches about 550 GFLOP/s on 2 cores here and spends half of a cold prefill. This one works transposed, so
 * that the softmax never reduces across a vector:
 *
 *   S^T [16 keys x 16 queries] = K [16 keys x 32 dims] . Q^T        (A = keys straight from a packed copy)
 *   O^T [16 dims x 16 queries] += V^T [16 dims x 32 keys] . P^T     (B = probabilities, VNNI pairs of keys)
 *
 * Each vector is one key's (or one dimension's) values for 16 queries, so the running max and sum of a query
 * are plain lane-wise operations over the block's 32 rows. The output accumulates in four tiles across the
 * whole key loop: the running max is kept stale until a block's max exceeds it by 2^8 (the probabilities stay
 * below 256, far from float32's range), and only then are the accumulators rescaled. Blocks entirely above
 * the causal diagonal are not computed; blocks crossing it are masked lane by lane.
 *
 * Per call: keys are gathered from the paged cache by slot into [kv_head][key][dim] (A tiles of 16 keys),
 * values are transposed into [kv_head][block of 32 keys][dim tile][16 dims][32 keys] (A tiles of V^T). Then
 * one work item per (head, 16 queries), heaviest (last) query blocks first.
 */
#include "../common.h"
#include "../simd.h"
#include "../ss_kernels.h"

#include <stdlib.h>

#if defined(SS_AMX)
#define KEYS 32        /* keys per block: one B tile of P^T (16 pairs) */
#define QROWS 16       /* queries per work item: the lanes of a vector */
#define HEAD_DIM 64    /* the one head size this kernel takes */
#define RESCALE_AT 8.f /* log2 units: rescale the accumulators only when a max grows by more than 2^8 */

static void configure_tiles(void) {
    ss_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

static inline __m512 bf16x16_to_ps(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Sixteen vectors of 16 32-bit elements, transposed in place (row i, lane j -> row j, lane i). */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
            t[8 * i + j + 4] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
}

/* Thread-local scratch that grows as needed (the engine thread calls this once per layer). */
static void *scratch(size_t bytes) {
    static __thread void *buffer;
    static __thread size_t capacity;
    if (bytes > capacity) {
        free(buffer);
        capacity = (bytes + 4095) & ~(size_t)4095;
        buffer = aligned_alloc(64, capacity);
        if (buffer == NULL) capacity = 0;
    }
    return buffer;
}

/* One kv head's block of 32 keys: K rows gathered in key order; V transposed into four 16 x 32 A tiles, i.e.
 * [dim][key]. Keys 2j and 2j+1 interleaved are 32-bit pairs (V[2j][d], V[2j+1][d]); a 16 x 16 transpose of those
 * over the 16 pairs gives, per dim, its 32 keys in order. Keys past the context are zero. */
static void pack_block(const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *slots, int64_t num_ctx,
                       int num_kv_heads, int kvh, int64_t key0, uint16_t *kp, uint16_t *vt) {
    const uint16_t *vrows[KEYS];
    for (int r = 0; r < KEYS; r++) {
        const int64_t key = key0 + r;
        if (key < num_ctx) {
            const int64_t at = (slots[key] * num_kv_heads + kvh) * HEAD_DIM;
            memcpy(kp + r * HEAD_DIM, k_cache + at, HEAD_DIM * sizeof(uint16_t));
            vrows[r] = v_cache + at;
        } else {
            memset(kp + r * HEAD_DIM, 0, HEAD_DIM * sizeof(uint16_t));
            vrows[r] = NULL;
        }
    }
    for (int h = 0; h < 2; h++) { /* dims 32h .. 32h + 31 */
        __m512i lo[16], hi[16];
        for (int j = 0; j < 16; j++) {
            const __m512i a = vrows[2 * j] ? _mm512_loadu_si512(vrows[2 * j] + h * 32) : _mm512_setzero_si512();
            const __m512i b = vrows[2 * j + 1] ? _mm512_loadu_si512(vrows[2 * j + 1] + h * 32) : _mm512_setzero_si512();
            lo[j] = _mm512_unpacklo_epi16(a, b); /* pairs for dims 8L + 0..3 of each 128-bit lane L */
            hi[j] = _mm512_unpackhi_epi16(a, b); /* dims 8L + 4..7 */
        }
        transpose16(lo);
        transpose16(hi);
        for (int e = 0; e < 16; e++) {
            const int d = h * 32 + 8 * (e / 4) + e % 4;
            _mm512_store_si512(vt + d * KEYS, lo[e]);
            _mm512_store_si512(vt + (d + 4) * KEYS, hi[e]);
        }
    }
}

/* The 16 queries' rows of one head as two B tiles of Q^T: [half][dim pair][query][2]. */
static void pack_queries(const uint16_t *q, int64_t q_stride, int64_t q0, int nq, uint16_t qt[2][16][32]) {
    for (int h = 0; h < 2; h++) {
        __m512i r[16];
        for (int i = 0; i < QROWS; i++)
            r[i] = i < nq ? _mm512_loadu_si512(q + (q0 + i) * q_stride + h * 32) : _mm512_setzero_si512();
        transpose16(r);
        for (int j = 0; j < 16; j++) _mm512_store_si512(qt[h][j], r[j]);
    }
}

/* S^T of one block of 32 keys into tiles 0 and 1 (keys 0-15, 16-31), from the packed keys and Q^T. */
static inline void scores(const uint16_t *kb, uint16_t qt[2][16][32]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, qt[0], 64);
    _tile_loadd(3, kb, HEAD_DIM * 2);
    _tile_dpbf16ps(0, 3, 2);
    _tile_loadd(3, kb + 16 * HEAD_DIM, HEAD_DIM * 2);
    _tile_dpbf16ps(1, 3, 2);
    _tile_loadd(2, qt[1], 64);
    _tile_loadd(3, kb + 32, HEAD_DIM * 2);
    _tile_dpbf16ps(0, 3, 2);
    _tile_loadd(3, kb + 16 * HEAD_DIM + 32, HEAD_DIM * 2);
    _tile_dpbf16ps(1, 3, 2);
}

typedef struct {
    __m512 m, l; /* per query: the running max (log2 units, possibly stale by < 2^8) and sum */
} softmax_state;

/* One block's probabilities as a B tile of P^T in pt; rescales the accumulators (tiles 4-7) when a max grows.
 * `masked`: the block crosses the causal diagonal (keys after a query's position get probability 0). */
static inline void probabilities(float s[KEYS][16], int masked, int64_t key0, __m512i pos, __m512 c, int first,
                                 softmax_state *st, uint16_t pt[16][32], float acc[4][16][16]) {
    __m512 rows[KEYS];
    __mmask16 visible[KEYS];
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int r = 0; r < KEYS; r++) {
        rows[r] = _mm512_load_ps(s[r]);
        if (masked) {
            visible[r] = _mm512_cmp_epi32_mask(_mm512_set1_epi32((int32_t)(key0 + r)), pos, _MM_CMPINT_LE);
            top = _mm512_mask_max_ps(top, visible[r], top, rows[r]);
        } else {
            top = _mm512_max_ps(top, rows[r]);
        }
    }
    top = _mm512_mul_ps(top, c);
    const __mmask16 grow = _mm512_cmp_ps_mask(top, _mm512_add_ps(st->m, _mm512_set1_ps(RESCALE_AT)), _CMP_GT_OQ);
    if (grow) {
        const __m512 new_m = _mm512_mask_mov_ps(st->m, grow, top);
        if (!first) { /* the first block has nothing accumulated yet */
            const __m512 alpha = vexp2(_mm512_sub_ps(st->m, new_m));
            st->l = _mm512_mul_ps(st->l, alpha);
            _tile_stored(4, acc[0], 64);
            _tile_stored(5, acc[1], 64);
            _tile_stored(6, acc[2], 64);
            _tile_stored(7, acc[3], 64);
            for (int t = 0; t < 4; t++)
                for (int d = 0; d < 16; d++)
                    _mm512_store_ps(acc[t][d], _mm512_mul_ps(_mm512_load_ps(acc[t][d]), alpha));
            _tile_loadd(4, acc[0], 64);
            _tile_loadd(5, acc[1], 64);
            _tile_loadd(6, acc[2], 64);
            _tile_loadd(7, acc[3], 64);
        }
        st->m = new_m;
    }
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23,
                                                7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    for (int r = 0; r < KEYS; r += 2) {
        __m512 p0 = vexp2(_mm512_fmsub_ps(rows[r], c, st->m));
        __m512 p1 = vexp2(_mm512_fmsub_ps(rows[r + 1], c, st->m));
        if (masked) {
            p0 = _mm512_maskz_mov_ps(visible[r], p0);
            p1 = _mm512_maskz_mov_ps(visible[r + 1], p1);
        }
        /* keys r and r+1 as row r/2 of the VNNI tile: [query][key pair] */
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0); /* p0 in words 0-15, p1 in 16-31 */
        /* the sum takes the probabilities as the tile multiplies them (rounded to bfloat16): the weights then
         * sum to one exactly as used, which matters when one key dominates and its weight is not a power of 2 */
        sum0 = _mm512_add_ps(sum0, bf16x16_to_ps(_mm512_castsi512_si256(both)));
        sum1 = _mm512_add_ps(sum1, bf16x16_to_ps(_mm512_extracti64x4_epi64(both, 1)));
        _mm512_store_si512(pt[r / 2], _mm512_permutexvar_epi16(interleave, both));
    }
    st->l = _mm512_add_ps(st->l, _mm512_add_ps(sum0, sum1));
}

static void attend(const uint16_t *q, int64_t q_stride, const uint16_t *kp, const uint16_t *vt, int64_t num_ctx,
                   int64_t num_q, int64_t q0, float scale, uint16_t *out, int64_t out_stride) {
    const int nq = num_q - q0 < QROWS ? (int)(num_q - q0) : QROWS;
    const int64_t first_pos = num_ctx - num_q + q0, last_pos = first_pos + nq - 1;
    _Alignas(64) uint16_t qt[2][16][32];
    _Alignas(64) float s[2][KEYS][16];
    _Alignas(64) uint16_t pt[16][32];
    _Alignas(64) float acc[4][16][16];
    pack_queries(q, q_stride, q0, nq, qt);
    int32_t lane_pos[QROWS];
    for (int i = 0; i < QROWS; i++) lane_pos[i] = (int32_t)(first_pos + (i < nq ? i : nq - 1));
    const __m512i pos = _mm512_loadu_si512(lane_pos);
    const __m512 c = _mm512_set1_ps(scale * 1.44269504f); /* scores to log2 units */
    softmax_state st = {_mm512_set1_ps(-INFINITY), _mm512_setzero_ps()};
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    const int64_t num_blocks = last_pos / KEYS + 1;
    scores(kp, qt);
    _tile_stored(0, s[0][0], 64);
    _tile_stored(1, s[0][16], 64);
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t key0 = b * KEYS;
        if (b + 1 < num_blocks) scores(kp + (key0 + KEYS) * HEAD_DIM, qt); /* the tiles work while we softmax */
        if (key0 + KEYS - 1 > first_pos)
            probabilities(s[b & 1], 1, key0, pos, c, b == 0, &st, pt, acc);
        else
            probabilities(s[b & 1], 0, key0, pos, c, b == 0, &st, pt, acc);
        const uint16_t *vb = vt + key0 * HEAD_DIM; /* this block's four V^T tiles, 16 dims x 32 keys each */
        _tile_loadd(2, pt, 64);
        _tile_loadd(3, vb, KEYS * 2);
        _tile_dpbf16ps(4, 3, 2);
        _tile_loadd(3, vb + 16 * KEYS, KEYS * 2);
        _tile_dpbf16ps(5, 3, 2);
        _tile_loadd(3, vb + 32 * KEYS, KEYS * 2);
        _tile_dpbf16ps(6, 3, 2);
        _tile_loadd(3, vb + 48 * KEYS, KEYS * 2);
        _tile_dpbf16ps(7, 3, 2);
        if (b + 1 < num_blocks) {
            _tile_stored(0, s[(b + 1) & 1][0], 64);
            _tile_stored(1, s[(b + 1) & 1][16], 64);
        }
    }
    _tile_stored(4, acc[0], 64);
    _tile_stored(5, acc[1], 64);
    _tile_stored(6, acc[2], 64);
    _tile_stored(7, acc[3], 64);
    _Alignas(64) float inv[16];
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), st.l));
    for (int t = 0; t < 4; t++) { /* O^T [dims x queries] to O rows, divided by each query's sum */
        __m512i r[16];
        for (int d = 0; d < 16; d++) r[d] = _mm512_load_si512(acc[t][d]);
        transpose16(r);
        for (int i = 0; i < nq; i++) {
            const __m512 o = _mm512_mul_ps(_mm512_castsi512_ps(r[i]), _mm512_set1_ps(inv[i]));
            _mm256_storeu_si256((__m256i *)(out + (q0 + i) * out_stride + t * 16), (__m256i)_mm512_cvtneps_pbh(o));
        }
    }
}
#endif

/*
 * q: [num_q, num_heads, 64] bfloat16, token rows q_row_stride elements apart (heads packed); k_cache/v_cache:
 * [slots, num_kv_heads, 64]; slots: [num_ctx] the cache slot of each context position; out: [num_q, num_heads,
 * 64] contiguous. Query i sits at position num_ctx - num_q + i. Returns 0, or -1 where this build or CPU cannot
 * (the caller then uses PyTorch).
 */
int ss_prefill_attention_bf16(const uint16_t *q, int64_t q_row_stride, const uint16_t *k_cache,
                              const uint16_t *v_cache, const int64_t *slots, int64_t num_ctx, int64_t num_q,
                              uint16_t *out, int num_heads, int num_kv_heads, int head_dim, float scale,
                              int num_threads) {
#if defined(SS_AMX)
    if (head_dim != HEAD_DIM || num_q < 1 || num_ctx < num_q || num_heads % num_kv_heads || !ss_amx_permitted())
        return -1;
    const int group = num_heads / num_kv_heads;
    const int64_t num_blocks = (num_ctx + KEYS - 1) / KEYS, padded = num_blocks * KEYS;
    const size_t kv_elems = (size_t)num_kv_heads * padded * HEAD_DIM;
    uint16_t *kp = scratch(2 * kv_elems * sizeof(uint16_t));
    if (kp == NULL) return -1;
    uint16_t *vt = kp + kv_elems;
    const int64_t num_qblocks = (num_q + QROWS - 1) / QROWS, num_items = num_qblocks * num_heads;
    const int64_t out_stride = (int64_t)num_heads * HEAD_DIM;
#pragma omp parallel num_threads(num_threads)
    {
        configure_tiles();
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_kv_heads * num_blocks; item++) {
            const int kvh = (int)(item / num_blocks);
            const int64_t b = item % num_blocks, at = ((int64_t)kvh * padded + b * KEYS) * HEAD_DIM;
            pack_block(k_cache, v_cache, slots, num_ctx, num_kv_heads, kvh, b * KEYS, kp + at, vt + at);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; item++) { /* the last query blocks see the most keys: first */
            const int64_t qb = num_qblocks - 1 - item / num_heads;
            const int head = (int)(item % num_heads), kvh = head / group;
            const int64_t at = (int64_t)kvh * padded * HEAD_DIM;
            attend(q + head * HEAD_DIM, q_row_stride, kp + at, vt + at, num_ctx, num_q, qb * QROWS, scale,
                   out + head * HEAD_DIM, out_stride);
        }
        _tile_release();
    }
    return 0;
#else
    (void)q, (void)q_row_stride, (void)k_cache, (void)v_cache, (void)slots, (void)num_ctx, (void)num_q, (void)out;
    (void)num_heads, (void)num_kv_heads, (void)head_dim, (void)scale, (void)num_threads;
    return -1;
#endif
}

/*
 * Attention on AMX tiles, bfloat16 K/V with head size 64: the amx build's paged attention for every row of a
 * forward step (decode rows and prefill chunks alike, one arithmetic per query), and the float path's prefill
 * attention (ss_prefill_attention_bf16), which is the same computation over a chunk's gathered slots.
 *
 * Both matmuls run on AMX-BF16 tiles and the softmax in AVX-512, transposed, so that the softmax never reduces
 * across a vector: a vector holds one key's (or one dimension's) values for 16 *lanes*, each lane a query row
 * of one head:
 *
 *   S^T [16 keys x 16 lanes] = K [16 keys x 32 dims] . Q^T        (A = keys, packed per block of 32)
 *   O^T [16 dims x 16 lanes] += V^T [16 dims x 32 keys] . P^T     (B = probabilities, VNNI pairs of keys)
 *
 * **One arithmetic per lane.** A tile's element depends on its own row of A and column of B alone, whatever the
 * tile's shape or the other rows (checked on Sapphire Rapids over 512,000 random elements: a 1 x 1 tile and a
 * 16 x 16 one give the same bits), and every softmax step below is lane-wise. So a query's output depends on its
 * q, its position and the cached K/V only: the same bits whether its lane sits in a prefill tile of 16
 * consecutive queries of one head, or in a decode row's tile of that row's query heads, and whichever other
 * lanes or threads run. What each lane computes, over the blocks of 32 keys from position 0 up to its own:
 * - the scores on the tiles (scaled into log2 units afterwards), keys past the lane's position masked;
 * - a running maximum m kept stale until a block's maximum exceeds it by 2^RESCALE_AT; only then are that
 *   lane's sum and accumulators multiplied by 2^(m - m') (other lanes by exactly 1.0);
 * - p = 2^(s - m) by vexp2, its sum l over the block's even and odd keys, and p as two bfloat16 terms, hi and
 *   lo (p - hi), each multiplied into the accumulators on the tiles, so the value sum sees p to about 16 bits
 *   rather than bfloat16's 8 (bfloat16 probabilities alone flipped a near-tied token of SmolLM2);
 * - out = acc / l, rounded to bfloat16.
 * A block past a lane's position (in a tile whose later lanes reach it) leaves it exactly as it was: its
 * maximum is -inf, its probabilities 0, and adding zero products changes no accumulator.
 *
 * Per call: each sequence's keys are gathered by slot into [kv head][key][dim] (A tiles of 16 keys) and its
 * values transposed into [kv head][block of 32 keys][dim tile][16 dims][32 keys] (A tiles of V^T), once for
 * the sequence's lane sets (a decode row's one set per KV head packs its own, in its thread's buffer, and
 * only its values: its K tiles are loaded from the cache itself, 16 slots of a block at a time). Then
 * one work item per lane set, the heaviest first; where the decode rows are enough to go round the threads,
 * one per decode row instead, packing every KV head block by block in one pass over its slots (a 16-row decode
 * step of SmolLM2 at about 300 tokens: 30.6-31.3 -> 27.2-28.9 ms, its reads of the cache the bound).
 */
#include "../common.h"
#include "../simd.h"
#include "../ss_kernels.h"

#include <stdlib.h>

#if defined(SS_AMX)
#define KEYS 32        /* keys per block: one B tile of P^T (16 pairs) */
#define LANES_PER_SET 16
#define HEAD_DIM SS_AMX_HEAD_DIM /* the one head size this kernel takes */
#define RESCALE_AT 8.f /* log2 units: rescale the accumulators only when a max grows by more than 2^8 */
#define BLOCK_ELEMS (2 * KEYS * HEAD_DIM) /* a packed block: K rows, then V^T */

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

/* Thread-local scratch that grows as needed; slot 0 is the call's shared packing, 1 a thread's own. */
static void *scratch(int which, size_t bytes) {
    static __thread void *buffer[2];
    static __thread size_t capacity[2];
    if (bytes > capacity[which]) {
        free(buffer[which]);
        capacity[which] = (bytes + 4095) & ~(size_t)4095;
        buffer[which] = aligned_alloc(64, capacity[which]);
        if (buffer[which] == NULL) capacity[which] = 0;
    }
    return buffer[which];
}

/* One sequence's keys: the slot of key j is slots[j], or table[j / block_size] * block_size + j % block_size
 * when slots is NULL. */
typedef struct {
    const int64_t *slots, *table;
    int64_t block_size, num_ctx;
} key_slots;

static inline int64_t slot_of(const key_slots *ks, int64_t j) {
    return ks->slots != NULL ? ks->slots[j] : ks->table[j / ks->block_size] * ks->block_size + j % ks->block_size;
}

/* One kv head's block of 32 keys into kp: K rows gathered in key order (unless k_cache is NULL: the tiles then
 * read K from the cache), then V transposed into four 16 x 32 A tiles, i.e. [dim][key]. Keys 2j and 2j+1
 * interleaved are 32-bit pairs (V[2j][d], V[2j+1][d]); a 16 x 16 transpose of those over the 16 pairs gives, per
 * dim, its 32 keys in order. Keys past the context are zero. */
static void pack_block(const uint16_t *k_cache, const uint16_t *v_cache, const key_slots *ks, int num_kv_heads,
                       int kvh, int64_t key0, uint16_t *kp) {
    uint16_t *vt = kp + KEYS * HEAD_DIM;
    const uint16_t *vrows[KEYS];
    for (int r = 0; r < KEYS; r++) {
        const int64_t key = key0 + r;
        if (key < ks->num_ctx) {
            const int64_t at = (slot_of(ks, key) * num_kv_heads + kvh) * HEAD_DIM;
            if (k_cache != NULL) memcpy(kp + r * HEAD_DIM, k_cache + at, HEAD_DIM * sizeof(uint16_t));
            vrows[r] = v_cache + at;
        } else {
            if (k_cache != NULL) memset(kp + r * HEAD_DIM, 0, HEAD_DIM * sizeof(uint16_t));
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

/* Blocks 0 .. num_blocks - 1 of KV heads kv0 .. kv1 - 1: head kvh's one after another (BLOCK_ELEMS each) from
 * kp + (kvh - kv0) * num_blocks * BLOCK_ELEMS. Block by block, so that a block's keys, read for its first head,
 * are in cache for the others (a slot holds every head's row). */
static void pack_blocks(const uint16_t *k_cache, const uint16_t *v_cache, const key_slots *ks, int num_kv_heads,
                        int kv0, int kv1, int64_t num_blocks, uint16_t *kp) {
    for (int64_t b = 0; b < num_blocks; b++)
        for (int kvh = kv0; kvh < kv1; kvh++)
            pack_block(k_cache, v_cache, ks, num_kv_heads, kvh, b * KEYS,
                       kp + ((kvh - kv0) * num_blocks + b) * BLOCK_ELEMS);
}

/* Where a lane set's K rows come from: its packed blocks, or straight from the cache where each run of 16 keys
 * is 16 consecutive slots (block tables with blocks of a multiple of 16): a decode row, which packs for itself,
 * then copies only V. Keys past the context read whatever the slot holds (their scores are masked) or, past the
 * sequence's last block, zeros. */
typedef struct {
    const uint16_t *packed; /* NULL: from the cache */
    const uint16_t *k_cache;
    const key_slots *ks;
    int num_kv_heads, kvh;
} key_source;

static const uint16_t zero_keys[16 * HEAD_DIM] __attribute__((aligned(64)));

/* The 16 K rows of keys 32 b + 16 h .. + 15, and the bytes between rows. */
static inline const uint16_t *key_rows(const key_source *src, int64_t b, int h, int64_t *stride) {
    if (src->packed != NULL) {
        *stride = HEAD_DIM * 2;
        return src->packed + b * BLOCK_ELEMS + h * 16 * HEAD_DIM;
    }
    const int64_t key = b * KEYS + h * 16;
    if (key >= src->ks->num_ctx) {
        *stride = HEAD_DIM * 2;
        return zero_keys;
    }
    *stride = (int64_t)src->num_kv_heads * HEAD_DIM * 2;
    return src->k_cache + (slot_of(src->ks, key) * src->num_kv_heads + src->kvh) * HEAD_DIM;
}

static inline int keys_direct(const key_slots *ks) { return ks->slots == NULL && ks->block_size % 16 == 0; }

/* Up to 16 lanes of one sequence and KV head: lane i is the query q[i] (64 bfloat16) at position pos[i], whose
 * output goes to out[i]. Unused lanes repeat lane 0 and are not stored. */
typedef struct {
    const uint16_t *q[LANES_PER_SET];
    uint16_t *out[LANES_PER_SET];
    int32_t pos[LANES_PER_SET];
    int count;
} lane_set;

/* The lanes' queries as two B tiles of Q^T: [half][dim pair][lane][2]. */
static void pack_queries(const lane_set *ls, uint16_t qt[2][16][32]) {
    for (int h = 0; h < 2; h++) {
        __m512i r[16];
        for (int i = 0; i < LANES_PER_SET; i++)
            r[i] = i < ls->count ? _mm512_loadu_si512(ls->q[i] + h * 32) : _mm512_setzero_si512();
        transpose16(r);
        for (int j = 0; j < 16; j++) _mm512_store_si512(qt[h][j], r[j]);
    }
}

/* S^T of block b's 32 keys into tiles 0 and 1 (keys 0-15, 16-31), from their K rows and Q^T. */
static inline void scores(const key_source *src, int64_t b, uint16_t qt[2][16][32]) {
    int64_t s0, s1;
    const uint16_t *k0 = key_rows(src, b, 0, &s0), *k1 = key_rows(src, b, 1, &s1);
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, qt[0], 64);
    _tile_loadd(3, k0, s0);
    _tile_dpbf16ps(0, 3, 2);
    _tile_loadd(3, k1, s1);
    _tile_dpbf16ps(1, 3, 2);
    _tile_loadd(2, qt[1], 64);
    _tile_loadd(3, k0 + 32, s0);
    _tile_dpbf16ps(0, 3, 2);
    _tile_loadd(3, k1 + 32, s1);
    _tile_dpbf16ps(1, 3, 2);
}

typedef struct {
    __m512 m, l; /* per lane: the running max (log2 units, possibly stale by < 2^8) and sum */
} softmax_state;

/* One block's probabilities as two B tiles of P^T, hi in pt[0] and lo in pt[1]; rescales the accumulators
 * (tiles 4-7) of the lanes whose max grows. `masked`: the block holds keys past some lane's position (those get
 * probability 0). */
static inline void probabilities(float s[KEYS][16], int masked, int64_t key0, __m512i pos, __m512 c, int first,
                                 softmax_state *st, uint16_t pt[2][16][32], float acc[4][16][16]) {
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
            const __m512 alpha = _mm512_mask_mov_ps(_mm512_set1_ps(1.f), grow, vexp2(_mm512_sub_ps(st->m, new_m)));
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
        sum0 = _mm512_add_ps(sum0, p0);
        sum1 = _mm512_add_ps(sum1, p1);
        /* keys r and r+1 as row r/2 of the VNNI tiles, [lane][key pair]: p = hi + lo, each a bfloat16 */
        const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(p1, p0); /* p0 in words 0-15, p1 in 16-31 */
        const __m512 lo0 = _mm512_sub_ps(p0, bf16x16_to_ps(_mm512_castsi512_si256(hi)));
        const __m512 lo1 = _mm512_sub_ps(p1, bf16x16_to_ps(_mm512_extracti64x4_epi64(hi, 1)));
        const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(lo1, lo0);
        _mm512_store_si512(pt[0][r / 2], _mm512_permutexvar_epi16(interleave, hi));
        _mm512_store_si512(pt[1][r / 2], _mm512_permutexvar_epi16(interleave, lo));
    }
    st->l = _mm512_add_ps(st->l, _mm512_add_ps(sum0, sum1));
}

/* The lanes of ls over their sequence's packed blocks kp (BLOCK_ELEMS each, from key 0), K from src. */
static void attend(const lane_set *ls, const key_source *src, const uint16_t *kp, float scale) {
    _Alignas(64) uint16_t qt[2][16][32];
    _Alignas(64) float s[2][KEYS][16];
    _Alignas(64) uint16_t pt[2][16][32];
    _Alignas(64) float acc[4][16][16];
    pack_queries(ls, qt);
    int32_t lane_pos[LANES_PER_SET];
    int32_t first_pos = ls->pos[0], last_pos = ls->pos[0];
    for (int i = 0; i < LANES_PER_SET; i++) {
        lane_pos[i] = ls->pos[i < ls->count ? i : 0];
        first_pos = lane_pos[i] < first_pos ? lane_pos[i] : first_pos;
        last_pos = lane_pos[i] > last_pos ? lane_pos[i] : last_pos;
    }
    const __m512i pos = _mm512_loadu_si512(lane_pos);
    const __m512 c = _mm512_set1_ps(scale * 1.44269504f); /* scores to log2 units */
    softmax_state st = {_mm512_set1_ps(-INFINITY), _mm512_setzero_ps()};
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    const int64_t num_blocks = last_pos / KEYS + 1;
    scores(src, 0, qt);
    _tile_stored(0, s[0][0], 64);
    _tile_stored(1, s[0][16], 64);
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t key0 = b * KEYS;
        if (b + 1 < num_blocks) scores(src, b + 1, qt); /* the tiles work while we softmax */
        if (key0 + KEYS - 1 > first_pos)
            probabilities(s[b & 1], 1, key0, pos, c, b == 0, &st, pt, acc);
        else
            probabilities(s[b & 1], 0, key0, pos, c, b == 0, &st, pt, acc);
        if (b + 1 < num_blocks) { /* frees tiles 0 and 1 for the value pass */
            _tile_stored(0, s[(b + 1) & 1][0], 64);
            _tile_stored(1, s[(b + 1) & 1][16], 64);
        }
        const uint16_t *vb = kp + b * BLOCK_ELEMS + KEYS * HEAD_DIM; /* four V^T tiles, 16 dims x 32 keys each */
        _tile_loadd(2, pt[0], 64);
        _tile_loadd(0, pt[1], 64);
        _tile_loadd(3, vb, KEYS * 2);
        _tile_dpbf16ps(4, 3, 2);
        _tile_dpbf16ps(4, 3, 0);
        _tile_loadd(1, vb + 16 * KEYS, KEYS * 2);
        _tile_dpbf16ps(5, 1, 2);
        _tile_dpbf16ps(5, 1, 0);
        _tile_loadd(3, vb + 32 * KEYS, KEYS * 2);
        _tile_dpbf16ps(6, 3, 2);
        _tile_dpbf16ps(6, 3, 0);
        _tile_loadd(1, vb + 48 * KEYS, KEYS * 2);
        _tile_dpbf16ps(7, 1, 2);
        _tile_dpbf16ps(7, 1, 0);
    }
    _tile_stored(4, acc[0], 64);
    _tile_stored(5, acc[1], 64);
    _tile_stored(6, acc[2], 64);
    _tile_stored(7, acc[3], 64);
    _Alignas(64) float inv[16];
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), st.l));
    for (int t = 0; t < 4; t++) { /* O^T [dims x lanes] to each lane's row, divided by its sum */
        __m512i r[16];
        for (int d = 0; d < 16; d++) r[d] = _mm512_load_si512(acc[t][d]);
        transpose16(r);
        for (int i = 0; i < ls->count; i++) {
            const __m512 o = _mm512_mul_ps(_mm512_castsi512_ps(r[i]), _mm512_set1_ps(inv[i]));
            _mm256_storeu_si256((__m256i *)(ls->out[i] + t * 16), (__m256i)_mm512_cvtneps_pbh(o));
        }
    }
}

/* A sequence of a call: rows first .. first + count - 1 (consecutive), their keys, and where its packed
 * blocks start in the shared buffer (-1: each lane set packs its own). */
typedef struct {
    int64_t first, count, num_blocks, packed_at;
    key_slots keys;
} sequence;

/* A work item: lane set `set` of sequence seq and KV head kvh, or of every KV head where kvh is -1 (sets: the
 * rows x the group's heads when they
 * fit in 16 lanes, otherwise 16 consecutive rows of one head). */
typedef struct {
    int64_t seq, set;
    int kvh;
} work_item;

typedef struct {
    const uint16_t *q, *k_cache, *v_cache;
    uint16_t *out;
    int64_t q_row_stride;
    int num_heads, num_kv_heads;
    float scale;
} attention_args;

static int64_t sets_per_head(const sequence *s, int group) {
    return s->count * group <= LANES_PER_SET ? 1 : group * ((s->count + LANES_PER_SET - 1) / LANES_PER_SET);
}

/* The lanes of item w; a lane's position is its row's context length - 1. */
static void fill_lanes(const attention_args *a, const sequence *s, const work_item *w, const int64_t *lens,
                       lane_set *ls) {
    const int group = a->num_heads / a->num_kv_heads;
    const int64_t out_row = (int64_t)a->num_heads * HEAD_DIM;
    ls->count = 0;
    if (s->count * group <= LANES_PER_SET) { /* every row, each of the group's heads */
        for (int64_t r = s->first; r < s->first + s->count; r++)
            for (int g = 0; g < group; g++) {
                const int h = w->kvh * group + g, i = ls->count++;
                ls->q[i] = a->q + r * a->q_row_stride + h * HEAD_DIM;
                ls->out[i] = a->out + r * out_row + h * HEAD_DIM;
                ls->pos[i] = (int32_t)(lens[r] - 1);
            }
    } else { /* 16 consecutive rows of one head */
        const int h = w->kvh * group + (int)(w->set % group);
        const int64_t r0 = s->first + (w->set / group) * LANES_PER_SET;
        const int64_t r1 = r0 + LANES_PER_SET < s->first + s->count ? r0 + LANES_PER_SET : s->first + s->count;
        for (int64_t r = r0; r < r1; r++) {
            const int i = ls->count++;
            ls->q[i] = a->q + r * a->q_row_stride + h * HEAD_DIM;
            ls->out[i] = a->out + r * out_row + h * HEAD_DIM;
            ls->pos[i] = (int32_t)(lens[r] - 1);
        }
    }
}

/* Runs every item over its sequence; lens[r] is row r's context length. */
static int run_items(const attention_args *a, sequence *seqs, int64_t num_seqs, const int64_t *lens,
                     int num_threads) {
    const int group = a->num_heads / a->num_kv_heads;
    int64_t num_items = 0, shared_blocks = 0, own_blocks = 0, own_seqs = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t sets = sets_per_head(seqs + s, group);
        num_items += sets * a->num_kv_heads;
        if (sets > 1) {
            seqs[s].packed_at = shared_blocks;
            shared_blocks += seqs[s].num_blocks * a->num_kv_heads;
        } else {
            seqs[s].packed_at = -1;
            own_blocks = seqs[s].num_blocks > own_blocks ? seqs[s].num_blocks : own_blocks;
            own_seqs++;
        }
    }
    /* sequences that pack their own keys (decode rows) take one item for all their KV heads, packed in one pass
     * over their slots, where there are enough of them to go round the threads */
    const int whole = own_seqs >= 2 * (int64_t)num_threads;
    if (whole) own_blocks *= a->num_kv_heads;
    work_item *items = malloc(sizeof(work_item) * (size_t)num_items);
    uint16_t *shared = shared_blocks > 0 ? scratch(0, sizeof(uint16_t) * BLOCK_ELEMS * (size_t)shared_blocks) : NULL;
    if (items == NULL || (shared_blocks > 0 && shared == NULL)) {
        free(items);
        return -1;
    }
    int64_t n = 0; /* the sequences with the most keys first, their last rows (most keys) first */
    for (int64_t s = num_seqs - 1; s >= 0; s--) {
        const int64_t sets = sets_per_head(seqs + s, group);
        if (whole && sets == 1) {
            items[n++] = (work_item){s, 0, -1};
            continue;
        }
        for (int64_t set = sets - 1; set >= 0; set--)
            for (int kvh = 0; kvh < a->num_kv_heads; kvh++) items[n++] = (work_item){s, set, kvh};
    }
    num_items = n;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        uint16_t *own = own_blocks > 0 ? scratch(1, sizeof(uint16_t) * BLOCK_ELEMS * (size_t)own_blocks) : NULL;
        if (own_blocks > 0 && own == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        configure_tiles();
        int64_t s = 0; /* the sequence of a thread's packing item, a cursor: a thread's items come in order */
#pragma omp for schedule(dynamic, 4)
        for (int64_t it = 0; it < shared_blocks; it++) { /* shared packing: (sequence, kv head, block) */
            if (seqs[s].packed_at > it) s = 0;
            while (seqs[s].packed_at < 0 || seqs[s].packed_at + seqs[s].num_blocks * a->num_kv_heads <= it) s++;
            const int64_t local = it - seqs[s].packed_at;
            const int kvh = (int)(local / seqs[s].num_blocks);
            const int64_t b = local % seqs[s].num_blocks;
            pack_block(a->k_cache, a->v_cache, &seqs[s].keys, a->num_kv_heads, kvh, b * KEYS,
                       shared + (size_t)it * BLOCK_ELEMS);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < num_items; it++) {
            const work_item *w = items + it;
            const sequence *s = seqs + w->seq;
            if (failed) continue;
            const int kv0 = w->kvh < 0 ? 0 : w->kvh, kv1 = w->kvh < 0 ? a->num_kv_heads : w->kvh + 1;
            const uint16_t *kp;
            const int direct = s->packed_at < 0 && keys_direct(&s->keys);
            if (s->packed_at >= 0) {
                kp = shared + (size_t)(s->packed_at + (int64_t)kv0 * s->num_blocks) * BLOCK_ELEMS;
            } else {
                pack_blocks(direct ? NULL : a->k_cache, a->v_cache, &s->keys, a->num_kv_heads, kv0, kv1,
                            s->num_blocks, own);
                kp = own;
            }
            for (int kvh = kv0; kvh < kv1; kvh++) {
                const work_item one = {w->seq, w->set, kvh};
                const uint16_t *blocks = kp + (size_t)((kvh - kv0) * s->num_blocks) * BLOCK_ELEMS;
                const key_source src = {direct ? NULL : blocks, a->k_cache, &s->keys, a->num_kv_heads, kvh};
                lane_set ls;
                fill_lanes(a, s, &one, lens, &ls);
                attend(&ls, &src, blocks, a->scale);
            }
        }
        _tile_release();
    }
    free(items);
    return failed ? -1 : 0;
}

int amx_paged_attention_bf16(const uint16_t *q, int64_t q_row_stride, const uint16_t *k_cache,
                             const uint16_t *v_cache, const int64_t *tables, int64_t max_blocks, const int64_t *row_seq,
                             const int64_t *lens, uint16_t *out, int num_rows, int num_heads, int num_kv_heads,
                             int head_dim, int block_size, float scale, int num_threads) {
    if (head_dim != HEAD_DIM || num_rows < 1 || num_heads % num_kv_heads || !ss_amx_permitted()) return -1;
    sequence *seqs = malloc(sizeof(sequence) * (size_t)num_rows);
    if (seqs == NULL) return -1;
    int64_t num_seqs = 0;
    for (int r = 0; r < num_rows; r++) {
        if (lens[r] < 1 || lens[r] > max_blocks * block_size || lens[r] > INT32_MAX) {
            free(seqs);
            return -1;
        }
        const int same = r > 0 && row_seq != NULL && row_seq[r] == row_seq[r - 1];
        if (!same) {
            const int64_t table = row_seq != NULL ? row_seq[r] : r;
            seqs[num_seqs++] = (sequence){r, 0, 0, 0, {NULL, tables + table * max_blocks, block_size, 0}};
        }
        sequence *s = seqs + num_seqs - 1;
        s->count++;
        s->keys.num_ctx = lens[r] > s->keys.num_ctx ? lens[r] : s->keys.num_ctx;
        s->num_blocks = (s->keys.num_ctx + KEYS - 1) / KEYS;
    }
    const attention_args a = {q, k_cache, v_cache, out, q_row_stride, num_heads, num_kv_heads, scale};
    const int status = run_items(&a, seqs, num_seqs, lens, num_threads);
    free(seqs);
    return status;
}
#endif

/*
 * The float path's prefill: q: [num_q, num_heads, 64] bfloat16, token rows q_row_stride elements apart (heads
 * packed); k_cache/v_cache: [slots, num_kv_heads, 64]; slots: [num_ctx] the cache slot of each context position;
 * out: [num_q, num_heads, 64] contiguous. Query i sits at position num_ctx - num_q + i. Returns 0, or -1 where
 * this build or CPU cannot (the caller then uses PyTorch).
 */
int ss_prefill_attention_bf16(const uint16_t *q, int64_t q_row_stride, const uint16_t *k_cache,
                              const uint16_t *v_cache, const int64_t *slots, int64_t num_ctx, int64_t num_q,
                              uint16_t *out, int num_heads, int num_kv_heads, int head_dim, float scale,
                              int num_threads) {
#if defined(SS_AMX)
    if (head_dim != HEAD_DIM || num_q < 1 || num_ctx < num_q || num_ctx > INT32_MAX || num_heads % num_kv_heads ||
        !ss_amx_permitted())
        return -1;
    int64_t *lens = malloc(sizeof(int64_t) * (size_t)num_q);
    if (lens == NULL) return -1;
    for (int64_t i = 0; i < num_q; i++) lens[i] = num_ctx - num_q + i + 1;
    sequence seq = {0, num_q, (num_ctx + KEYS - 1) / KEYS, 0, {slots, NULL, 1, num_ctx}};
    const attention_args a = {q, k_cache, v_cache, out, q_row_stride, num_heads, num_kv_heads, scale};
    const int status = run_items(&a, &seq, 1, lens, num_threads);
    free(lens);
    return status;
#else
    (void)q, (void)q_row_stride, (void)k_cache, (void)v_cache, (void)slots, (void)num_ctx, (void)num_q, (void)out;
    (void)num_heads, (void)num_kv_heads, (void)head_dim, (void)scale, (void)num_threads;
    return -1;
#endif
}

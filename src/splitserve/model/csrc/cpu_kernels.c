/*
 * CPU kernels for the model's per-step work that PyTorch runs as many small ops (OpenMP, and simd.h's vectors
 * where the build has them):
 * - paged attention that reads K/V in place through each sequence's block table, for decode steps and
 *   prefill chunks alike, with one arithmetic per query whatever runs beside it;
 * - the residual add + RMSNorm + cast (vLLM's fused_add_rms_norm).
 *
 * Built by splitserve/model/kernel_build.py (cc -O3 -fopenmp, once per instruction-set level) and loaded by
 * splitserve/model/kernels.py.
 *
 * Attention: the torch fallback in attention.py first gathers every sequence's context into a padded
 * [B, L_max] tensor and then runs SDPA over it, so a 2,500-token sequence in a batch of short ones makes every
 * sequence pay for 2,500 tokens, twice (the copy and the attention). Here each query walks its own blocks,
 * once for the scores and once for the values; nothing is copied or padded. How the work is split, and why
 * the split never changes a result, is at ss_paged_attention below.
 *
 * Layout (attention.py's contract): the cache of one layer is [num_slots, num_kv_heads, head_dim],
 * slot = block_table[p / block_size] * block_size + p % block_size. q and out are [B, num_heads, head_dim]
 * with heads contiguous; q's rows may be strided (q_row_stride elements apart), out's are packed. Query
 * heads kvh*group .. kvh*group+group-1 share KV head kvh. Scores, softmax and accumulation are float32
 * whatever the storage dtype (bfloat16 or float32).
 *
 * Each function takes its storage dtype (SS_BF16 or SS_F32) as an argument. The exported entry points, and the
 * partition and merge functions compiled once per dtype, pass a constant into bodies inlined into them, so
 * every dtype gets its own code with no per-element branch (the objdump of a build shows no v_pass or
 * to_float of its own).
 */
#include <stdlib.h>

#include "common.h"
#include "simd.h"
#include "ss_kernels.h"

#define MAX_HEAD_DIM 256

/* Row helpers: a stored row to float32, and acc += p * row, LANES at a time where n is a multiple of LANES
 * (simd.h), otherwise plain loops. */
static inline void to_float(const void *x, int dtype, float *out, int n) {
#if defined(LANES)
    if (n % LANES == 0) {
        for (int d = 0; d < n; d += LANES) vstoref(out + d, vload_at(x, dtype, d));
        return;
    }
#endif
    for (int d = 0; d < n; d++) out[d] = load_elem(x, dtype, d);
}

static inline void axpy_row(float p, const float *x, float *acc, int n) {
#if defined(LANES)
    if (n % LANES == 0) {
        const vf pv = vset1(p);
        for (int d = 0; d < n; d += LANES) vstoref(acc + d, vfmadd(pv, vloadf(x + d), vloadf(acc + d)));
        return;
    }
#endif
    for (int d = 0; d < n; d++) acc[d] += p * x[d];
}

/* Blocked helpers for the vector builds (VW floats per vector): dot_many gives VW dot products of q with VW
 * consecutive rows at once, so the horizontal sums are one transposing reduction for all of them instead of
 * one per row. */
#if defined(LANES)
#define VW LANES
static inline void dot_many(const float *q, const float *rows, int n, float *out) {
    vf acc[LANES];
    for (int j = 0; j < LANES; j++) acc[j] = vset1(0.f);
    for (int d = 0; d < n; d += LANES) {
        const vf qv = vloadf(q + d);
        for (int j = 0; j < LANES; j++) acc[j] = vfmadd(qv, vloadf(rows + j * n + d), acc[j]);
    }
    vsum_each(acc, out);
}
#else
#define VW 0
static inline void dot_many(const float *q, const float *rows, int n, float *out) { (void)q, (void)rows, (void)n, (void)out; }
#endif

static inline float max_row(const float *s, int64_t n) {
    float top = -INFINITY;
#pragma omp simd reduction(max : top)
    for (int64_t t = 0; t < n; t++) top = s[t] > top ? s[t] : top;
    return top;
}

/* s[t] = exp(s[t] - top) for t < n (simd.h's exponential, the same in every lane and in the tail); returns
 * their sum. */
static inline float exp_row(float *s, int64_t n, float top) {
    float sum = 0.0f;
    int64_t t = 0;
#if defined(LANES)
    const vf shift = vset1(top);
    vf total = vset1(0.f);
    for (; t + LANES <= n; t += LANES) {
        const vf e = vexp(vsub(vloadf(s + t), shift));
        vstoref(s + t, e);
        total = vadd(total, e);
    }
    sum = vsum(total);
#endif
    for (; t < n; t++) {
        s[t] = ss_expf(s[t] - top);
        sum += s[t];
    }
    return sum;
}

/* ------------------------------------------------------------ paged attention, one arithmetic per query */
/* A query row's output depends on its q, its context length and the cached K/V alone, never on the rows
 * beside it, the work split or the thread count:
 * - its keys are cut into partitions of PARTITION tokens from position 0;
 * - a partition's scores, their maximum, the sum of their exponentials and the value sum are each computed in
 *   one fixed order (partition_*: below);
 * - the partitions are merged in order (merge_*).
 * Decode steps spread their rows' partitions over the threads (split mode, as flash-decoding does, so that
 * one long sequence uses every thread; with too few partitions, their KV heads too). Prefill chunks
 * give each thread a tile of up to TILE_ROWS consecutive queries of one sequence, which share each key's
 * conversion to float (tile mode); a chunk too short to give every thread four tiles takes tiles of down to
 * MIN_TILE_ROWS (on Zen 4, a 150-row chunk at 2,500 tokens: 80 -> 40 us per row, where split mode ran it),
 * and split mode runs what gives fewer than two tiles a thread. The two modes only schedule the same calls:
 * the partition and merge functions are compiled once (SS_ONE_BODY), so both run the same machine code. On
 * AVX-512, tile mode runs partition_lanes instead, which holds one value of 16 rows per vector and reproduces
 * partition_float's arithmetic operation for operation (below); the tests compare the two bit for bit.
 *
 * The arithmetic: each key converted to float32 once (for every row of a tile), KG keys' scores at once by
 * dot_many (vector builds) or plain loops, exponentials in float32, the value sum by v_pass. Where the build
 * has AVX-512 BF16 (SS_BF16_DOT) and the cache is bfloat16, the scores are instead bfloat16 pair dot products
 * of the stored query and key, the scale applied to the sum (pair_scores for a row, pairs_leaf in lanes_tree for
 * a tile: the same chains and tree in both layouts). Each product of two bfloat16 values is exact in float32;
 * the instruction adds them as two fused multiply-adds would, except that it flushes subnormal inputs and
 * results to zero, the same in both layouts. On a Zen 4, 2,500-token prefill attention 42.5 -> 35.2 ms a
 * layer. (bfloat16 *probabilities* in the value
 * sum were measured too and refused: they flip SmolLM2's near-tied first token of "What is the capital of
 * France?"; the value sum stays float32.) */
#define PARTITION 256 /* a multiple of KEY_RUN and of every block size taken */
#define KG 16
#define KEY_RUN (4 * KG) /* keys read per pass over a partition */
#if defined(SS_AVX512)
#define TILE_ROWS 32 /* two vectors of rows in partition_lanes, which share each key's conversion */
#else
#define TILE_ROWS 16
#endif
#define MIN_TILE_ROWS 16 /* a chunk too short for TILE_ROWS to give every thread a few tiles takes smaller ones */
#define TILE_BUFFER_BYTES (8 << 20) /* a thread's partials in tile mode, at most (fewer rows per tile beyond) */

/* out[j] = q . kf[j] for the KG rows of kf (head_dim floats each). */
static inline void score_group(const float *q, const float *kf, int head_dim, float *out) {
#if VW > 0
    if (head_dim % VW == 0) {
        for (int j = 0; j < KG; j += VW) dot_many(q, kf + j * head_dim, head_dim, out + j);
        return;
    }
#endif
    for (int j = 0; j < KG; j++) {
        float dot = 0.0f;
        for (int d = 0; d < head_dim; d++) dot += q[d] * kf[j * head_dim + d];
        out[j] = dot;
    }
}

/* The float32 scores of a run of up to KEY_RUN keys (keys[0 .. valid - 1]) for the query heads h0 .. h1 - 1 of
 * every row i < count, into scores[i][h][g + j] for the groups of KG keys that start below n[i] (a group is
 * zero-padded past the run). kf: KG * head_dim floats. */
static inline void group_scores(const float *const *qf, int count, const int64_t *n, int64_t g, const void *const *keys,
                                int dtype, int64_t valid, int head_dim, int h0, int h1, int num_heads, float *kf,
                                float *scores) {
    for (int64_t c = 0; c < (valid + KG - 1) / KG; c++) {
        for (int64_t j = 0; j < KG; j++) {
            if (c * KG + j < valid)
                to_float(keys[c * KG + j], dtype, kf + j * head_dim, head_dim);
            else
                memset(kf + j * head_dim, 0, sizeof(float) * (size_t)head_dim);
        }
        for (int i = 0; i < count; i++) {
            if (n[i] <= g + c * KG) continue;
            for (int h = h0; h < h1; h++)
                score_group(qf[i] + h * head_dim, kf, head_dim,
                            scores + ((int64_t)i * num_heads + h) * PARTITION + g + c * KG);
        }
    }
}

/* What a partition computes: rows i < count of one sequence, row i seeing keys begin .. begin + n[i] - 1
 * (1 <= n[i] <= PARTITION) through the slots of its table, the query heads of KV heads kv0 .. kv1 - 1; qf[i] its
 * query scaled to float32 ([heads][head_dim]); part[i]
 * receives, per head h, the maximum score m[h], l[h] = sum of exp(score - m[h]) and acc[h][d] = sum of
 * exp(score - m[h]) v[d] (m, l and acc one after another, for every head). A key before the row's sliding window
 * (t < lo[i]) takes the score -infinity, so its weight is the exponential's floor (about 1e-38: nothing beside the
 * window's largest term, which is 1) in either layout. */
typedef struct {
    int count;
    const int64_t *n;
    const int64_t *table;
    int64_t begin;
    int num_heads, num_kv_heads, kv0, kv1, head_dim, block_size;
    float *kf;     /* KG * head_dim floats */
    float *scores; /* count * num_heads * PARTITION floats */
    float *const *part;
    const uint16_t *const *qb; /* the rows' stored bfloat16 queries, where the scores are pair dot products */
    float scale;               /* their scale, applied to each score (the float path scales qf instead) */
    const int64_t *lo;         /* row i's keys begin .. begin + lo[i] - 1 lie before its sliding window (NULL: none) */
    float softcap;             /* scores capped to softcap * tanh(score / softcap) (Gemma 2; 0: none) */
} ss_partition;

/* Logit soft-capping of n scores in place: the same scalar function in either layout, so both give the same bits. */
static inline void softcap_scores(float *s, int64_t n, int64_t stride, float cap) {
    for (int64_t t = 0; t < n; t++) s[t * stride] = cap * tanhf(s[t * stride] / cap);
}

/* The value pass with the group's accumulators in registers: for each KV head and slice of SV vectors of
 * head_dim, every token's V slice is loaded once and added into up to MAX_GROUP query heads' accumulators
 * (acc += p * v), which stay in registers across the tokens. Returns 0 where it does not apply (no vector
 * build, a larger group, head_dim not a multiple of the slice), and the caller runs the plain pass. */
#define MAX_GROUP 4
#if defined(SS_AVX512)
#define SV 4 /* 64 floats per slice */
#elif defined(SS_AVX2)
#define SV 2 /* 16 floats per slice */
#endif

/* The value pass of partition p's row with n keys and scores s[h * PARTITION + t], into acc. */
static inline int v_pass(const ss_partition *p, const void *v_cache, int dtype, int64_t n, const float *scores,
                         float *acc) {
#if VW > 0
    const int group = p->num_heads / p->num_kv_heads, head_dim = p->head_dim, block_size = p->block_size;
    if (group > MAX_GROUP || head_dim % (SV * VW) != 0) return 0;
    const int64_t row = (int64_t)p->num_kv_heads * head_dim, first_block = p->begin / block_size;
    const int64_t *table = p->table;
    for (int kvh = p->kv0; kvh < p->kv1; kvh++) {
        for (int d0 = 0; d0 < head_dim; d0 += SV * VW) {
            vf a[MAX_GROUP][SV];
            for (int g = 0; g < MAX_GROUP; g++)
                for (int i = 0; i < SV; i++) a[g][i] = vset1(0.f);
            for (int64_t t0 = 0; t0 < n; t0 += block_size) {
                const int64_t first = table[first_block + t0 / block_size] * block_size * row;
                const void *vp = elem(v_cache, dtype, first + kvh * head_dim + d0);
                const int64_t stop = t0 + block_size < n ? t0 + block_size : n;
                for (int64_t t = t0; t < stop; t++, vp = elem(vp, dtype, row)) {
                    vf v[SV];
                    for (int i = 0; i < SV; i++) v[i] = vload_at(vp, dtype, i * VW);
                    for (int g = 0; g < MAX_GROUP; g++) {
                        if (g >= group) break;
                        const vf pg = vset1(scores[(int64_t)(kvh * group + g) * PARTITION + t]);
                        for (int i = 0; i < SV; i++) a[g][i] = vfmadd(pg, v[i], a[g][i]);
                    }
                }
            }
            for (int g = 0; g < group; g++)
                for (int i = 0; i < SV; i++) vstoref(acc + (kvh * group + g) * head_dim + d0 + i * VW, a[g][i]);
        }
    }
    return 1;
#else
    (void)p, (void)v_cache, (void)dtype, (void)n, (void)scores, (void)acc;
    return 0;
#endif
}

/* slots[t] for t < n: the slot of key begin + t (begin is a multiple of the block size) */
static inline void partition_slots(const ss_partition *p, int64_t n, int64_t *slots) {
    const int64_t bs = p->block_size, *table = p->table + p->begin / bs;
    for (int64_t t0 = 0; t0 < n; t0 += bs) {
        const int64_t base = table[t0 / bs] * bs, stop = t0 + bs < n ? bs : n - t0;
        for (int64_t j = 0; j < stop; j++) slots[t0 + j] = base + j;
    }
}

#if defined(SS_BF16_DOT)
static const uint16_t ZERO_KEY[MAX_HEAD_DIM]; /* a key past a run's end: a score of zero */

/* out[j] = scale * (q . keys[j]) for KG keys, head_dim a multiple of 32, on dpbf16: lane l of the vector for
 * elements d .. d + 31 holds the pair d / 2 + l, so lane l's chain is the pairs l, l + 16, ... in order (each
 * step adds the odd element's product, then the even's: the instruction's order, checked against two fused
 * multiply-adds on a Zen 4 over 32 million lanes), and vsum_each's tree sums the lanes. */
static inline void pair_scores(const uint16_t *q, const uint16_t *const *keys, int head_dim, float scale, float *out) {
    vf acc[KG];
    for (int j = 0; j < KG; j++) acc[j] = vset1(0.f);
    for (int d = 0; d < head_dim; d += 32) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + d);
        for (int j = 0; j < KG; j++) acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_loadu_si512(keys[j] + d));
    }
    vsum_each(acc, out);
    for (int j = 0; j < KG; j++) out[j] *= scale;
}
#endif

/* Every row's scores of one partition (most: the longest row's key count), KEY_RUN keys at a time. */
static inline void partition_scores(const ss_partition *p, const float *const *qf, const void *k_cache, int dtype,
                                    const int64_t *slots, int64_t most) {
    const int group = p->num_heads / p->num_kv_heads, head_dim = p->head_dim;
    const int64_t row = (int64_t)p->num_kv_heads * head_dim; /* elements per slot */
#if defined(SS_BF16_DOT)
    if (p->qb != NULL) {
        for (int64_t g = 0; g < most; g += KG) {
            for (int kvh = p->kv0; kvh < p->kv1; kvh++) {
                const uint16_t *keys[KG];
                for (int64_t j = 0; j < KG; j++)
                    keys[j] = g + j < most ? (const uint16_t *)k_cache + slots[g + j] * row + kvh * head_dim : ZERO_KEY;
                for (int i = 0; i < p->count; i++) {
                    if (p->n[i] <= g) continue;
                    for (int h = kvh * group; h < (kvh + 1) * group; h++)
                        pair_scores(p->qb[i] + h * head_dim, keys, head_dim, p->scale,
                                    p->scores + ((int64_t)i * p->num_heads + h) * PARTITION + g);
                }
            }
        }
        return;
    }
#endif
    for (int64_t g = 0; g < most; g += KEY_RUN) {
        const int64_t valid = most - g < KEY_RUN ? most - g : KEY_RUN;
        for (int kvh = p->kv0; kvh < p->kv1; kvh++) {
            const void *keys[KEY_RUN];
            for (int64_t j = 0; j < valid; j++) keys[j] = elem(k_cache, dtype, slots[g + j] * row + kvh * head_dim);
            group_scores(qf, p->count, p->n, g, keys, dtype, valid, head_dim, kvh * group, (kvh + 1) * group,
                         p->num_heads, p->kf, p->scores);
        }
    }
}

/* The float32 arithmetic (see above) for one partition. */
SS_INLINE void partition_float(const ss_partition *p, const float *const *qf, const void *k_cache,
                               const void *v_cache, int dtype) {
    const int group = p->num_heads / p->num_kv_heads, head_dim = p->head_dim;
    const int64_t row = (int64_t)p->num_kv_heads * head_dim; /* elements per slot */
    int64_t most = 0;
    for (int i = 0; i < p->count; i++) most = p->n[i] > most ? p->n[i] : most;
    int64_t slots[PARTITION];
    partition_slots(p, most, slots);
    partition_scores(p, qf, k_cache, dtype, slots, most);
    for (int i = 0; i < p->count; i++) {
        const int64_t n = p->n[i];
        float *m = p->part[i], *l = m + p->num_heads, *acc = l + p->num_heads;
        float *s = p->scores + (int64_t)i * p->num_heads * PARTITION;
        const int h0 = p->kv0 * group, h1 = p->kv1 * group;
        for (int h = h0; h < h1 && p->softcap > 0.f; h++) softcap_scores(s + h * PARTITION, n, 1, p->softcap);
        for (int h = h0; h < h1 && p->lo != NULL; h++)
            for (int64_t t = 0; t < p->lo[i]; t++) s[h * PARTITION + t] = -INFINITY;
        for (int h = h0; h < h1; h++) m[h] = max_row(s + h * PARTITION, n);
        for (int h = h0; h < h1; h++) l[h] = exp_row(s + h * PARTITION, n, m[h]);
        if (v_pass(p, v_cache, dtype, n, s, acc)) continue;
        memset(acc + (size_t)h0 * head_dim, 0, sizeof(float) * (size_t)(h1 - h0) * (size_t)head_dim);
        for (int64_t t = 0; t < n; t++) {
            for (int kvh = p->kv0; kvh < p->kv1; kvh++) {
                float vf[MAX_HEAD_DIM];
                to_float(elem(v_cache, dtype, slots[t] * row + kvh * head_dim), dtype, vf, head_dim);
                for (int h = kvh * group; h < (kvh + 1) * group; h++)
                    axpy_row(s[h * PARTITION + t], vf, acc + h * head_dim, head_dim);
            }
        }
    }
}

/* One partition of the rows in p: each dtype's compiled once, so every caller runs the same code. */
static SS_ONE_BODY void partition_bf16(const ss_partition *p, const float *const *qf, const void *k_cache,
                                       const void *v_cache) {
    partition_float(p, qf, k_cache, v_cache, SS_BF16);
}
static SS_ONE_BODY void partition_f32(const ss_partition *p, const float *const *qf, const void *k_cache,
                                      const void *v_cache) {
    partition_float(p, qf, k_cache, v_cache, SS_F32);
}
static inline void partition(const ss_partition *p, const float *const *qf, const void *k_cache,
                             const void *v_cache, int dtype) {
    if (dtype == SS_BF16)
        partition_bf16(p, qf, k_cache, v_cache);
    else
        partition_f32(p, qf, k_cache, v_cache);
}

/* ------------------------------------------------- a tile's partition with its rows as the vector lanes */
/* What partition_float computes for up to LANES rows of a tile, bit for bit, with each vector holding one value
 * for LANES rows rather than LANES values of one row. Each key's float row then serves every row of the tile
 * by a broadcast, the scores need no transposing reduction, and each V element is converted once for the tile.
 * The arithmetic is partition_float's, lane for lane:
 * - a score is dot_many's: LANES partial chains over head_dim (lane l: elements l, l + LANES, ..., fused
 *   multiply-adds from zero), summed in vsum_each's tree (lanes_tree below);
 * - the maximum over the row's own keys (masked), exp by vexp (ss_expf's arithmetic), their sum in exp_row's
 *   order: LANES running sums by key position mod LANES over the row's whole vectors, vsum's tree over those,
 *   then the tail one key at a time;
 * - the value sums: per element, a fused multiply-add chain over the keys in order, from zero.
 * Rows past a row's key count leave its lanes alone (masks), so each lane is exactly its row's partition_float.
 * The scores of KB keys are computed together, so each transposed query vector serves KB keys. */
#if defined(SS_AVX512) /* on AVX2's sixteen registers it measured slower than partition_float */
#define SS_LANES_ATTENTION 1
#define KB 4

typedef __mmask16 lane_mask;
static inline lane_mask lanes_below(__m512i n, int64_t t) { /* lanes whose count exceeds t */
    return _mm512_cmpgt_epi32_mask(n, _mm512_set1_epi32((int)t));
}

/* h[kk] for the KB keys k + kk * head_dim: leaf l of vsum_each's tree (chain l + chain l + 8, its halves step),
 * each chain dot_many's for that lane. qt: head_dim vectors, one per element. */
SS_INLINE void lanes_leaf(const float *qt, const float *k, int head_dim, int l, vf *h) {
    vf e[KB];
    for (int kk = 0; kk < KB; kk++) h[kk] = e[kk] = vset1(0.f);
    for (int d = l; d < head_dim; d += LANES)
        for (int kk = 0; kk < KB; kk++) h[kk] = vfmadd(vloadf(qt + (int64_t)d * LANES), vset1(k[kk * head_dim + d]), h[kk]);
    for (int d = l + 8; d < head_dim; d += LANES)
        for (int kk = 0; kk < KB; kk++) e[kk] = vfmadd(vloadf(qt + (int64_t)d * LANES), vset1(k[kk * head_dim + d]), e[kk]);
    for (int kk = 0; kk < KB; kk++) h[kk] = vadd(h[kk], e[kk]);
}

#if defined(SS_BF16_DOT)
static inline int load_pair(const uint16_t *x) { /* two bfloat16 values as one 32-bit word */
    uint32_t w;
    memcpy(&w, x, sizeof w);
    return (int)w;
}

/* pair_scores' leaf l for the KB keys kp[kk] (bfloat16 rows): lane l's chain (the pairs l, l + 16, ...) plus
 * lane l + 8's. qp: head_dim / 2 vectors, pair j of every row. */
SS_INLINE void pairs_leaf(const uint32_t *qp, const uint16_t *const *kp, int head_dim, int l, vf *h) {
    vf e[KB];
    for (int kk = 0; kk < KB; kk++) h[kk] = e[kk] = vset1(0.f);
    for (int j = l; j < head_dim / 2; j += LANES) {
        const __m512bh q = (__m512bh)_mm512_loadu_si512(qp + (int64_t)j * LANES);
        for (int kk = 0; kk < KB; kk++) h[kk] = _mm512_dpbf16_ps(h[kk], q, (__m512bh)_mm512_set1_epi32(load_pair(kp[kk] + 2 * j)));
    }
    for (int j = l + 8; j < head_dim / 2; j += LANES) {
        const __m512bh q = (__m512bh)_mm512_loadu_si512(qp + (int64_t)j * LANES);
        for (int kk = 0; kk < KB; kk++) e[kk] = _mm512_dpbf16_ps(e[kk], q, (__m512bh)_mm512_set1_epi32(load_pair(kp[kk] + 2 * j)));
    }
    for (int kk = 0; kk < KB; kk++) h[kk] = vadd(h[kk], e[kk]);
}
#endif

/* The scores of KB keys: ((h0 + h1) + (h2 + h3)) + ((h4 + h5) + (h6 + h7)), reduce8's tree, into out[kk]:
 * float32 queries qt and keys k (pairs 0), or bfloat16 pairs qp and kp (pairs 1, then scaled). */
SS_INLINE void lanes_tree(const float *qt, const float *k, const uint32_t *qp, const uint16_t *const *kp, int pairs,
                          float scale, int head_dim, vf *out) {
#if defined(SS_BF16_DOT)
#define LEAF(l, h) (pairs ? pairs_leaf(qp, kp, head_dim, (l), (h)) : lanes_leaf(qt, k, head_dim, (l), (h)))
#else
#define LEAF(l, h) ((void)qp, (void)kp, (void)pairs, (void)scale, lanes_leaf(qt, k, head_dim, (l), (h)))
#endif
    vf a[KB], b[KB], c[KB];
    LEAF(0, a), LEAF(1, b);
    for (int kk = 0; kk < KB; kk++) a[kk] = vadd(a[kk], b[kk]);
    LEAF(2, b), LEAF(3, c);
    for (int kk = 0; kk < KB; kk++) a[kk] = vadd(a[kk], vadd(b[kk], c[kk]));
    LEAF(4, b), LEAF(5, c);
    for (int kk = 0; kk < KB; kk++) b[kk] = vadd(b[kk], c[kk]);
    vf d[KB];
    LEAF(6, c), LEAF(7, d);
    for (int kk = 0; kk < KB; kk++) out[kk] = vadd(a[kk], vadd(b[kk], vadd(c[kk], d[kk])));
#undef LEAF
#if defined(SS_BF16_DOT)
    if (pairs)
        for (int kk = 0; kk < KB; kk++) out[kk] = vmul(out[kk], vset1(scale));
#endif
}

/* vsum's tree over the 16 running sums a[0 .. 15]. */
SS_INLINE vf lanes_sum_tree(vf *a) {
    for (int l = 0; l < 8; l++) a[l] = vadd(a[l + 8], a[l]);
    for (int l = 0; l < 4; l++) a[l] = vadd(a[l + 4], a[l]);
    return vadd(vadd(a[0], a[2]), vadd(a[1], a[3]));
}

/* A thread's buffers for the lanes partition (floats): the transposed queries of one KV head's query heads,
 * their scores, and the partition's keys and values as float32. */
static size_t lanes_floats(int group, int head_dim) {
    return (size_t)group * (size_t)head_dim * LANES + (size_t)group * PARTITION * LANES +
           2 * (size_t)PARTITION * (size_t)head_dim;
}

/* Rows i < p->count (at most TILE_ROWS) of partition p, as partition_float computes them, LANES rows at a time;
 * each KV head's keys and values are converted to float32 once for all of them. buf: lanes_floats. */
SS_INLINE void partition_lanes_body(const ss_partition *p, const float *const *qf, const void *k_cache,
                                    const void *v_cache, int dtype, float *buf) {
    const int group = p->num_heads / p->num_kv_heads, head_dim = p->head_dim;
    const int64_t row = (int64_t)p->num_kv_heads * head_dim;
    float *qt = buf, *st = qt + (size_t)group * head_dim * LANES, *kf = st + (size_t)group * PARTITION * LANES;
    float *vf_rows = kf + (size_t)PARTITION * head_dim;
    int64_t most_all = 0;
    for (int i = 0; i < p->count; i++) most_all = p->n[i] > most_all ? p->n[i] : most_all;
    const int64_t padded = (most_all + KB - 1) / KB * KB;
    int64_t slots[PARTITION];
    partition_slots(p, most_all, slots);
    const int pairs = p->qb != NULL; /* the scores from bfloat16 pairs (pair_scores' arithmetic) */
    for (int kvh = p->kv0; kvh < p->kv1; kvh++) {
        for (int64_t t = 0; t < padded; t++) {
            if (t < most_all) {
                if (!pairs)
                    to_float(elem(k_cache, dtype, slots[t] * row + kvh * head_dim), dtype, kf + t * head_dim, head_dim);
                to_float(elem(v_cache, dtype, slots[t] * row + kvh * head_dim), dtype, vf_rows + t * head_dim, head_dim);
            } else if (!pairs) {
                memset(kf + t * head_dim, 0, sizeof(float) * (size_t)head_dim);
            }
        }
        for (int c0 = 0; c0 < p->count; c0 += LANES) {
            const int rows = p->count - c0 < LANES ? p->count - c0 : LANES;
            int32_t n32[LANES], full32[LANES];
            int64_t most = 0, least = PARTITION, least_full = PARTITION;
            for (int i = 0; i < LANES; i++) {
                n32[i] = i < rows ? (int32_t)p->n[c0 + i] : 0;
                full32[i] = n32[i] - n32[i] % LANES; /* exp_row's whole vectors */
                if (i < rows) {
                    most = n32[i] > most ? n32[i] : most;
                    least = n32[i] < least ? n32[i] : least;
                    least_full = full32[i] < least_full ? full32[i] : least_full;
                }
            }
            const __m512i n = _mm512_loadu_si512(n32), full = _mm512_loadu_si512(full32);
            const int64_t chunk_padded = (most + KB - 1) / KB * KB;
            for (int g = 0; g < group; g++) {
                const int h = kvh * group + g;
                float *q = qt + (size_t)g * head_dim * LANES, *s = st + (size_t)g * PARTITION * LANES;
                uint32_t *qp = (uint32_t *)q; /* the pairs' form: pair j of lane i at qp[j * LANES + i] */
                if (pairs) {
                    for (int j = 0; j < head_dim / 2; j++)
                        for (int i = 0; i < LANES; i++) {
                            uint32_t w = 0;
                            if (i < rows) memcpy(&w, p->qb[c0 + i] + h * head_dim + 2 * j, sizeof w);
                            qp[j * LANES + i] = w;
                        }
                } else {
                    for (int d = 0; d < head_dim; d++)
                        for (int i = 0; i < LANES; i++) q[d * LANES + i] = i < rows ? qf[c0 + i][h * head_dim + d] : 0.f;
                }
                for (int64_t t = 0; t < chunk_padded; t += KB) {
                    const uint16_t *kp[KB];
#if defined(SS_BF16_DOT)
                    for (int kk = 0; kk < KB; kk++)
                        kp[kk] = pairs && t + kk < most_all ? (const uint16_t *)k_cache + slots[t + kk] * row + kvh * head_dim
                                                            : ZERO_KEY;
#else
                    for (int kk = 0; kk < KB; kk++) kp[kk] = NULL;
#endif
                    vf out[KB];
                    lanes_tree(q, kf + t * head_dim, qp, kp, pairs, p->scale, head_dim, out);
                    for (int kk = 0; kk < KB; kk++) vstoref(s + (t + kk) * LANES, out[kk]);
                }
                for (int i = 0; i < rows && p->softcap > 0.f; i++) softcap_scores(s + i, p->n[c0 + i], LANES, p->softcap);
                for (int i = 0; i < rows && p->lo != NULL; i++)
                    for (int64_t t = 0; t < p->lo[c0 + i]; t++) s[t * LANES + i] = -INFINITY;
                /* the maximum, the exponentials and their sum (exp_row's order) */
                vf top = vset1(-INFINITY);
                for (int64_t t = 0; t < most; t++) top = _mm512_mask_max_ps(top, lanes_below(n, t), top, vloadf(s + t * LANES));
                vf run[LANES];
                for (int l = 0; l < LANES; l++) run[l] = vset1(0.f);
                for (int64_t t = 0; t < most; t++) {
                    const vf e = vexp(vsub(vloadf(s + t * LANES), top));
                    vstoref(s + t * LANES, e);
                    run[t % LANES] = _mm512_mask_add_ps(run[t % LANES], lanes_below(full, t), run[t % LANES], e);
                }
                vf sum = lanes_sum_tree(run);
                for (int64_t t = least_full; t < most; t++) {
                    /* the tail: keys full_i .. n_i - 1 */
                    const lane_mask tail = (lane_mask)(lanes_below(n, t) & ~lanes_below(full, t));
                    sum = _mm512_mask_add_ps(sum, tail, sum, vloadf(s + t * LANES));
                }
                float tops[LANES], sums[LANES];
                vstoref(tops, top), vstoref(sums, sum);
                for (int i = 0; i < rows; i++) {
                    float *m = p->part[c0 + i], *l = m + p->num_heads;
                    m[h] = tops[i], l[h] = sums[i];
                }
                /* the value sums, LANES elements at a time */
                for (int d0 = 0; d0 < head_dim; d0 += LANES) {
                    vf acc[LANES];
                    for (int j = 0; j < LANES; j++) acc[j] = vset1(0.f);
                    int64_t t = 0;
                    for (; t < least; t++) {
                        const vf e = vloadf(s + t * LANES);
                        const float *v = vf_rows + t * head_dim + d0;
                        for (int j = 0; j < LANES; j++) acc[j] = vfmadd(e, vset1(v[j]), acc[j]);
                    }
                    for (; t < most; t++) {
                        const vf e = vloadf(s + t * LANES);
                        const lane_mask live = lanes_below(n, t);
                        const float *v = vf_rows + t * head_dim + d0;
                        for (int j = 0; j < LANES; j++) acc[j] = _mm512_mask3_fmadd_ps(e, vset1(v[j]), acc[j], live);
                    }
                    float tmp[LANES][LANES];
                    for (int j = 0; j < LANES; j++) vstoref(tmp[j], acc[j]);
                    for (int i = 0; i < rows; i++) {
                        float *out = p->part[c0 + i] + 2 * p->num_heads + (size_t)h * head_dim + d0;
                        for (int j = 0; j < LANES; j++) out[j] = tmp[j][i];
                    }
                }
            }
        }
    }
}

static SS_ONE_BODY void partition_lanes_bf16(const ss_partition *p, const float *const *qf, const void *k_cache,
                                             const void *v_cache, float *buf) {
    partition_lanes_body(p, qf, k_cache, v_cache, SS_BF16, buf);
}
static SS_ONE_BODY void partition_lanes_f32(const ss_partition *p, const float *const *qf, const void *k_cache,
                                            const void *v_cache, float *buf) {
    partition_lanes_body(p, qf, k_cache, v_cache, SS_F32, buf);
}
static inline void partition_lanes(const ss_partition *p, const float *const *qf, const void *k_cache,
                                   const void *v_cache, int dtype, float *buf) {
    if (dtype == SS_BF16)
        partition_lanes_bf16(p, qf, k_cache, v_cache, buf);
    else
        partition_lanes_f32(p, qf, k_cache, v_cache, buf);
}
#endif

/* A row's output from its num_parts partials (partition order): per head, the partitions' sums rescaled to
 * the largest maximum, then divided by the total. */
SS_INLINE void merge_rows(const float *const *part, int64_t num_parts, int num_heads, int head_dim, void *out,
                          int dtype) {
    for (int h = 0; h < num_heads; h++) {
        float top = -INFINITY, total = 0.0f, o[MAX_HEAD_DIM];
        for (int64_t it = 0; it < num_parts; it++) top = part[it][h] > top ? part[it][h] : top;
        for (int d = 0; d < head_dim; d++) o[d] = 0.0f;
        for (int64_t it = 0; it < num_parts; it++) {
            const float *m = part[it], *l = m + num_heads, *acc = l + num_heads + (size_t)h * head_dim;
            const float w = ss_expf(m[h] - top);
            total += w * l[h];
            for (int d = 0; d < head_dim; d++) o[d] += w * acc[d];
        }
        for (int d = 0; d < head_dim; d++) store_elem(out, dtype, h * head_dim + d, o[d] / total);
    }
}
static SS_ONE_BODY void merge_bf16(const float *const *part, int64_t num_parts, int num_heads, int head_dim,
                                   void *out) {
    merge_rows(part, num_parts, num_heads, head_dim, out, SS_BF16);
}
static SS_ONE_BODY void merge_f32(const float *const *part, int64_t num_parts, int num_heads, int head_dim,
                                  void *out) {
    merge_rows(part, num_parts, num_heads, head_dim, out, SS_F32);
}
static inline void merge(const float *const *part, int64_t num_parts, int num_heads, int head_dim, void *out,
                         int dtype) {
    if (dtype == SS_BF16)
        merge_bf16(part, num_parts, num_heads, head_dim, out);
    else
        merge_f32(part, num_parts, num_heads, head_dim, out);
}

/* Runs of up to tile_rows consecutive rows of one sequence: tile t is rows start[t] .. start[t + 1] - 1.
 * Returns the number of tiles. */
static int64_t make_tiles(const int64_t *row_seq, int num_rows, int64_t tile_rows, int64_t *start) {
    int64_t num_tiles = 0;
    for (int r = 0; r < num_rows; r++) {
        const int same = r > 0 && row_seq != NULL && row_seq[r] == row_seq[r - 1];
        if (!same || r - start[num_tiles - 1] >= tile_rows) start[num_tiles++] = r;
    }
    start[num_tiles] = num_rows;
    return num_tiles;
}

/* One call's arguments and the sizes derived from them, read by every work item. */
typedef struct {
    const void *q, *k_cache, *v_cache;
    void *out;
    const int64_t *tables, *row_seq, *lens;
    int64_t q_row_stride, max_blocks;
    int dtype, num_rows, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int64_t max_parts, tile_rows; /* partitions of the longest row; rows per tile */
    int pairs;                    /* the scores from bfloat16 pairs (SS_BF16_DOT, a bfloat16 cache) */
    size_t hd, per_part;          /* floats per query row; per partial (m, l, acc) */
    int kv_packed;                /* SS_INT8 or SS_FP8: the cache in that format of common.h (q and out bfloat16) */
    int64_t window;               /* a row attends to its last window positions at most (0: all of them) */
    float softcap;                /* scores capped to softcap * tanh(score / softcap) (0: none) */
} attention_call;

/* Row r's first key: window positions before its last one, or 0. */
static inline int64_t first_key(const attention_call *a, int64_t r) {
    return a->window > 0 && a->lens[r] > a->window ? a->lens[r] - a->window : 0;
}

/* A thread's buffers: queries in float32, scores, converted keys, and in tile mode its own partials. */
typedef struct {
    float *work, *qbuf, *scores, *kf, *mine, *lanes;
    uint16_t *stage; /* an int8 or fp8 cache: one partition's keys and values widened to bfloat16 */
    int64_t *identity; /* the staged partition's block table: slot t is key t */
    const float **qf;
    const uint16_t **qb; /* the rows' stored queries, where the scores are pair dot products */
    float **part;
    int64_t *n, *lo;
    int ok;
} thread_work;

/* Checks the shapes and fills in the derived sizes; -1 for shapes beyond the fixed buffers or an empty
 * context. */
static int attention_sizes(attention_call *a) {
    if (a->head_dim > MAX_HEAD_DIM || a->num_heads % a->num_kv_heads != 0 || a->block_size < 1 ||
        PARTITION % a->block_size != 0 || (a->kv_packed && a->head_dim % SS_KV_INT8_GROUP != 0))
        return -1;
    int64_t max_len = 0;
    for (int r = 0; r < a->num_rows; r++) {
        if (a->lens[r] < 1 || a->lens[r] > a->max_blocks * a->block_size) return -1;
        max_len = a->lens[r] > max_len ? a->lens[r] : max_len;
    }
    a->max_parts = (max_len + PARTITION - 1) / PARTITION;
    a->hd = (size_t)a->num_heads * (size_t)a->head_dim;
    a->per_part = (size_t)a->num_heads * ((size_t)a->head_dim + 2); /* m, l, acc */
    int64_t tile_rows = TILE_BUFFER_BYTES / (int64_t)(sizeof(float) * a->per_part * (size_t)a->max_parts);
    a->tile_rows = tile_rows < 1 ? 1 : tile_rows > TILE_ROWS ? TILE_ROWS : tile_rows;
#if defined(SS_BF16_DOT)
    a->pairs = a->dtype == SS_BF16 && a->head_dim % 32 == 0;
#else
    a->pairs = 0;
#endif
    return 0;
}

/* The calling thread's stage for an int8 or fp8 cache's partitions (run_partition), kept from call to call: allocated
 * afresh each call, its ~200 KB came from mmap and faulted its pages in every time (one stream decoded 15% slower
 * than with a bfloat16 cache on a Zen 4 VM). NULL for no memory. */
static __thread uint16_t *thread_stage;
static __thread size_t thread_stage_len;
static uint16_t *stage_buffer(size_t len) {
    if (len > thread_stage_len) {
        free(thread_stage);
        thread_stage = malloc(sizeof(uint16_t) * len);
        thread_stage_len = thread_stage != NULL ? len : 0;
    }
    return thread_stage;
}

/* E4M3 code c as bfloat16 bits (common.h), for kv_fp8_row_to_bf16. */
static __thread uint16_t thread_e4m3[256];
static __thread int thread_e4m3_set;
static const uint16_t *e4m3_table(void) {
    if (!thread_e4m3_set) {
        for (int c = 0; c < 256; c++) thread_e4m3[c] = e4m3_to_bf16_bits((uint8_t)c);
        thread_e4m3_set = 1;
    }
    return thread_e4m3;
}

/* identity[i] = i: the staged partition's block table (slot t is key t). */
static __thread int64_t thread_identity[PARTITION];
static __thread int thread_identity_set;
static int64_t *identity_table(void) {
    if (!thread_identity_set) {
        for (int64_t i = 0; i < PARTITION; i++) thread_identity[i] = i;
        thread_identity_set = 1;
    }
    return thread_identity;
}

static thread_work thread_buffers(const attention_call *a, int64_t rows_per_item, int split) {
    thread_work t;
    const size_t own = split ? 0 : (size_t)rows_per_item * (size_t)a->max_parts * a->per_part;
    t.work = malloc(sizeof(float) * ((size_t)rows_per_item * (a->hd + (size_t)a->num_heads * PARTITION) +
                                     (size_t)KG * (size_t)a->head_dim + own));
    t.qf = malloc(sizeof(float *) * (size_t)rows_per_item);
    t.qb = malloc(sizeof(uint16_t *) * (size_t)rows_per_item);
    t.part = malloc(sizeof(float *) * (size_t)(rows_per_item > a->max_parts ? rows_per_item : a->max_parts));
    t.n = malloc(sizeof(int64_t) * (size_t)rows_per_item);
    t.lo = malloc(sizeof(int64_t) * (size_t)rows_per_item);
    t.ok = t.work != NULL && t.qf != NULL && t.qb != NULL && t.part != NULL && t.n != NULL && t.lo != NULL;
    t.qbuf = t.work;
    t.scores = t.ok ? t.work + (size_t)rows_per_item * a->hd : NULL;
    t.kf = t.ok ? t.scores + (size_t)rows_per_item * a->num_heads * PARTITION : NULL;
    t.mine = t.ok ? t.kf + (size_t)KG * a->head_dim : NULL;
    t.lanes = NULL;
    t.stage = NULL, t.identity = NULL;
    if (a->kv_packed) {
        t.stage = stage_buffer(2 * PARTITION * (size_t)a->num_kv_heads * (size_t)a->head_dim);
        t.identity = identity_table();
        t.ok = t.ok && t.stage != NULL;
    }
#if defined(SS_LANES_ATTENTION)
    if (!split && a->head_dim % LANES == 0) {
        t.lanes = aligned_alloc(64, (sizeof(float) * lanes_floats(a->num_heads / a->num_kv_heads, a->head_dim) + 63) / 64 * 64);
        t.ok = t.ok && t.lanes != NULL;
    }
#endif
    return t;
}

/* One partition of job's rows: in tile mode with the rows as the vector lanes where the thread has their buffer
 * (the same bits). An int8 or fp8 cache's partition is first widened to bfloat16 (exactly: common.h), its keys and values
 * one after another in the thread's stage, and the bfloat16 code runs on that, through a table that maps key t of
 * the partition to staged slot t: the same arithmetic as a bfloat16 cache holding those values, in either mode. */
static void run_partition(const attention_call *a, thread_work *t, ss_partition *job, int lanes) {
    const void *k_cache = a->k_cache, *v_cache = a->v_cache;
    ss_partition staged;
    if (a->kv_packed) {
        int64_t most = 0, slots[PARTITION];
        for (int i = 0; i < job->count; i++) most = job->n[i] > most ? job->n[i] : most;
        partition_slots(job, most, slots);
        const int hd = a->head_dim;
        const int64_t row = (int64_t)a->num_kv_heads * hd, slot_bytes = a->num_kv_heads * kv_int8_row_bytes(hd);
        uint16_t *sk = t->stage, *sv = sk + PARTITION * row;
        const uint16_t *e4m3 = a->kv_packed == SS_FP8 ? e4m3_table() : NULL;
        for (int64_t k = 0; k < most; k++)
            for (int kvh = job->kv0; kvh < job->kv1; kvh++) {
                const int64_t at = slots[k] * slot_bytes + kvh * kv_int8_row_bytes(hd);
                if (e4m3 != NULL) {
                    kv_fp8_row_to_bf16((const uint8_t *)a->k_cache + at, hd, e4m3, sk + k * row + kvh * hd);
                    kv_fp8_row_to_bf16((const uint8_t *)a->v_cache + at, hd, e4m3, sv + k * row + kvh * hd);
                } else {
                    kv_int8_row_to_bf16((const int8_t *)a->k_cache + at, hd, sk + k * row + kvh * hd);
                    kv_int8_row_to_bf16((const int8_t *)a->v_cache + at, hd, sv + k * row + kvh * hd);
                }
            }
        staged = *job;
        staged.table = t->identity, staged.begin = 0; /* slot identity[t / bs] * bs + t % bs = t */
        job = &staged, k_cache = sk, v_cache = sv;
    }
#if defined(SS_LANES_ATTENTION)
    if (lanes) {
        partition_lanes(job, t->qf, k_cache, v_cache, a->dtype, t->lanes);
        return;
    }
#else
    (void)lanes;
#endif
    partition(job, t->qf, k_cache, v_cache, a->dtype);
}

/* Split mode's item at: one KV-head slice (kv0 .. kv1 - 1) of one partition of row *r (found from first). */
static void split_item(const attention_call *a, thread_work *t, ss_partition *job, const int64_t *first,
                       float *partials, int64_t at, int kv0, int kv1, int *r) {
    while (first[*r + 1] <= at) (*r)++;
    while (first[*r] > at) (*r)--;
    const int64_t row = *r, start = first_key(a, row), begin = (start / PARTITION + at - first[row]) * PARTITION;
    t->n[0] = a->lens[row] - begin < PARTITION ? a->lens[row] - begin : PARTITION;
    t->lo[0] = start > begin ? start - begin : 0;
    const size_t e0 = (size_t)kv0 * (size_t)(a->num_heads / a->num_kv_heads) * (size_t)a->head_dim;
    const size_t e1 = (size_t)kv1 * (size_t)(a->num_heads / a->num_kv_heads) * (size_t)a->head_dim;
    for (size_t e = e0; e < e1 && !a->pairs; e++) /* pair scores read the stored query itself (qb) */
        t->qbuf[e] = load_elem(a->q, a->dtype, row * a->q_row_stride + (int64_t)e) * a->scale;
    t->qf[0] = t->qbuf, t->part[0] = partials + a->per_part * (size_t)at;
    t->qb[0] = a->pairs ? (const uint16_t *)a->q + row * a->q_row_stride : NULL;
    job->count = 1, job->table = a->tables + (a->row_seq ? a->row_seq[row] : row) * a->max_blocks;
    job->begin = begin, job->kv0 = kv0, job->kv1 = kv1, job->lo = a->window > 0 ? t->lo : NULL;
    run_partition(a, t, job, 0);
}

/* Tile mode's item: rows r0 .. r0 + rows - 1 of one sequence, every partition of each, then each row merged. */
static void tile_item(const attention_call *a, thread_work *t, ss_partition *job, int64_t r0, int64_t rows) {
    const int64_t *table = a->tables + (a->row_seq ? a->row_seq[r0] : r0) * a->max_blocks;
    const size_t parts_of_row = (size_t)a->max_parts * a->per_part;
    int64_t longest = 0, earliest = a->lens[r0];
    for (int64_t i = 0; i < rows; i++) {
        float *qi = t->qbuf + (size_t)i * a->hd;
        for (size_t e = 0; e < a->hd && !a->pairs; e++) /* pair scores read the stored query itself (qb) */
            qi[e] = load_elem(a->q, a->dtype, (r0 + i) * a->q_row_stride + (int64_t)e) * a->scale;
        longest = a->lens[r0 + i] > longest ? a->lens[r0 + i] : longest;
        earliest = first_key(a, r0 + i) < earliest ? first_key(a, r0 + i) : earliest;
    }
    for (int64_t begin = earliest / PARTITION * PARTITION; begin < longest; begin += PARTITION) {
        int count = 0;
        for (int64_t i = 0; i < rows; i++) {
            const int64_t start = first_key(a, r0 + i);
            if (a->lens[r0 + i] <= begin || start >= begin + PARTITION) continue; /* past its end, before its window */
            t->lo[count] = start > begin ? start - begin : 0;
            t->n[count] = a->lens[r0 + i] - begin < PARTITION ? a->lens[r0 + i] - begin : PARTITION;
            t->qf[count] = t->qbuf + (size_t)i * a->hd;
            t->qb[count] = a->pairs ? (const uint16_t *)a->q + (r0 + i) * a->q_row_stride : NULL;
            t->part[count] = t->mine + (size_t)i * parts_of_row + (size_t)(begin / PARTITION) * a->per_part;
            count++;
        }
        job->count = count, job->table = table, job->begin = begin, job->kv0 = 0;
        job->kv1 = a->num_kv_heads, job->lo = a->window > 0 ? t->lo : NULL;
        run_partition(a, t, job, t->lanes != NULL);
    }
    for (int64_t i = 0; i < rows; i++) {
        const int64_t skipped = first_key(a, r0 + i) / PARTITION, parts = (a->lens[r0 + i] + PARTITION - 1) / PARTITION;
        for (int64_t it = skipped; it < parts; it++)
            t->part[it - skipped] = t->mine + (size_t)i * parts_of_row + (size_t)it * a->per_part;
        merge((const float *const *)t->part, parts - skipped, a->num_heads, a->head_dim,
              (void *)elem(a->out, a->dtype, (r0 + i) * (int64_t)a->hd), a->dtype);
    }
}

/* Split mode's partitions per row: first[r] is row r's first item (partials in that order), first[num_rows]
 * the total. NULL for no memory. */
static int64_t *first_items(const attention_call *a) {
    int64_t *first = malloc(sizeof(int64_t) * ((size_t)a->num_rows + 1));
    if (first == NULL) return NULL;
    first[0] = 0;
    for (int r = 0; r < a->num_rows; r++)
        first[r + 1] = first[r] + (a->lens[r] + PARTITION - 1) / PARTITION - first_key(a, r) / PARTITION;
    return first;
}

/* The work of one call: tiles of rows (tile mode), or every row's partitions one by one (split mode: decode
 * rows, or too few tiles to share out), their KV heads too where the partitions are too few to go round. */
static int paged_attention(const attention_call *a, int num_threads) {
    int64_t *tile = malloc(sizeof(int64_t) * ((size_t)a->num_rows + 1));
    if (tile == NULL) return -1;
    int64_t tile_rows = a->tile_rows, num_tiles = make_tiles(a->row_seq, a->num_rows, tile_rows, tile);
    while (num_tiles < 4 * (int64_t)num_threads && tile_rows > MIN_TILE_ROWS) /* a short chunk: smaller tiles */
        num_tiles = make_tiles(a->row_seq, a->num_rows, tile_rows /= 2, tile);
    const int split = 2 * num_tiles > a->num_rows || num_tiles < 2 * (int64_t)num_threads;
    const int64_t rows_per_item = split ? 1 : tile_rows;
    int64_t *first = split ? first_items(a) : NULL; /* split mode: each row's first item */
    float *partials = first != NULL ? malloc(sizeof(float) * a->per_part * (size_t)first[a->num_rows]) : NULL;
    int failed = split && partials == NULL;
    const int kv_split = split && first != NULL && first[a->num_rows] < 4 * (int64_t)num_threads ? a->num_kv_heads : 1;
    const int kv_per_item = a->num_kv_heads / kv_split;
    if (!failed) {
#pragma omp parallel num_threads(num_threads)
        {
            thread_work t = thread_buffers(a, rows_per_item, split);
            if (!t.ok) {
#pragma omp atomic write
                failed = 1;
            }
            ss_partition job = {0, t.n, NULL, 0, a->num_heads, a->num_kv_heads, 0, a->num_kv_heads, a->head_dim,
                                a->block_size, t.kf, t.scores, t.part, a->pairs ? t.qb : NULL, a->scale, NULL,
                                a->softcap};
            const int64_t num_items = split ? first[a->num_rows] * kv_split : num_tiles;
            int r = 0;
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < num_items; item++) {
                if (!t.ok) continue;
                if (split) {
                    const int kv0 = (int)(item % kv_split) * kv_per_item;
                    split_item(a, &t, &job, first, partials, item / kv_split, kv0, kv0 + kv_per_item, &r);
                } else {
                    /* the last tiles first: a sequence's later rows see more keys, so within a sequence
                     * the heaviest go first and the threads finish together (a prefill chunk is mostly one
                     * sequence; across sequences the order is only reversed) */
                    const int64_t it = num_items - 1 - item;
                    tile_item(a, &t, &job, tile[it], tile[it + 1] - tile[it]);
                }
            }
            if (split) {
#pragma omp for schedule(static)
                for (int rr = 0; rr < a->num_rows; rr++) {
                    if (!t.ok) continue;
                    for (int64_t it = first[rr]; it < first[rr + 1]; it++) t.part[it - first[rr]] = partials + a->per_part * (size_t)it;
                    merge((const float *const *)t.part, first[rr + 1] - first[rr], a->num_heads, a->head_dim,
                          (void *)elem(a->out, a->dtype, (int64_t)rr * (int64_t)a->hd), a->dtype);
                }
            }
            free(t.work), free(t.qf), free(t.qb), free(t.part), free(t.n), free(t.lo), free(t.lanes); /* the stage stays */
        }
    }
    free(partials), free(first), free(tile);
    return failed ? -1 : 0;
}

/* One call of an entry point below: q and out stored as dtype, the cache as dtype or (kv_packed) in that format. */
static int attention_entry(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                           const int64_t *tables, int64_t max_blocks, const int64_t *row_seq, const int64_t *lens,
                           void *out, int num_rows, int num_heads, int num_kv_heads, int head_dim, int block_size,
                           float scale, int64_t window, float softcap, int num_threads, int dtype, int kv_packed) {
    attention_call a = {q, k_cache, v_cache, out, tables, row_seq, lens, q_row_stride, max_blocks, dtype,
                        num_rows, num_heads, num_kv_heads, head_dim, block_size, scale, 0, 0, 0, 0, 0, kv_packed,
                        window > 0 ? window : 0, softcap > 0.f ? softcap : 0.f};
    return attention_sizes(&a) != 0 ? -1 : paged_attention(&a, num_threads);
}

/* Attention of num_rows query rows, each over its own context: row r attends to positions 0 .. lens[r] - 1
 * of the sequence whose block table is tables[row_seq[r]] (tables[r] when row_seq is NULL), or with a sliding
 * window (window > 0) to the last window of them; softcap > 0 caps each scale * q.k to softcap * tanh(x / softcap). Returns 0, or -1 for shapes beyond the fixed buffers, an empty
 * context or no memory (the caller falls back to PyTorch). */
int ss_paged_attention_bf16(const uint16_t *q, int64_t q_row_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                            const int64_t *tables, int64_t max_blocks, const int64_t *row_seq, const int64_t *lens,
                            uint16_t *out, int num_rows, int num_heads, int num_kv_heads, int head_dim, int block_size,
                            float scale, int64_t window, float softcap, int num_threads) {
#if defined(SS_AMX)
    /* the tiles' head size on a CPU that grants them: every call of the process without a window or soft-capping
     * takes the tiles' arithmetic (a layer with either always takes the vector code) */
    if (head_dim == SS_AMX_HEAD_DIM && window <= 0 && softcap <= 0.f && ss_amx_permitted())
        return amx_paged_attention_bf16(q, q_row_stride, k_cache, v_cache, tables, max_blocks, row_seq, lens, out,
                                        num_rows, num_heads, num_kv_heads, head_dim, block_size, scale, num_threads);
#endif
    return attention_entry(q, q_row_stride, k_cache, v_cache, tables, max_blocks, row_seq, lens, out, num_rows,
                           num_heads, num_kv_heads, head_dim, block_size, scale, window, softcap, num_threads, SS_BF16, 0);
}

/* The same over a cache in one of common.h's packed formats (format: SS_INT8 or SS_FP8; [num_slots, num_kv_heads,
 * head_dim + head_dim / 16] bytes), with bfloat16 q and out: the bfloat16 arithmetic over the widened values
 * (run_partition), never the AMX tiles. -1 for another format. */
int ss_paged_attention_packed(const uint16_t *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                              const int64_t *tables, int64_t max_blocks, const int64_t *row_seq, const int64_t *lens,
                              uint16_t *out, int num_rows, int num_heads, int num_kv_heads, int head_dim,
                              int block_size, float scale, int64_t window, float softcap, int num_threads,
                              int format) {
    if (format != SS_INT8 && format != SS_FP8) return -1;
    return attention_entry(q, q_row_stride, k_cache, v_cache, tables, max_blocks, row_seq, lens, out, num_rows,
                           num_heads, num_kv_heads, head_dim, block_size, scale, window, softcap, num_threads, SS_BF16, format);
}

/* rows x [num_rows, head_dim] float32 to common.h's packed format (SS_INT8 or SS_FP8), row r at
 * out + r * (head_dim + head_dim / 16). */
void ss_quantize_kv(const float *x, int64_t num_rows, int head_dim, int format, void *out) {
    for (int64_t r = 0; r < num_rows; r++) {
        uint8_t *row = (uint8_t *)out + r * kv_int8_row_bytes(head_dim);
        if (format == SS_FP8)
            kv_store_row(x + r * head_dim, head_dim, row, SS_FP8);
        else
            kv_store_row(x + r * head_dim, head_dim, row, SS_INT8);
    }
}

int ss_paged_attention_f32(const float *q, int64_t q_row_stride, const float *k_cache, const float *v_cache,
                           const int64_t *tables, int64_t max_blocks, const int64_t *row_seq, const int64_t *lens,
                           float *out, int num_rows, int num_heads, int num_kv_heads, int head_dim, int block_size,
                           float scale, int64_t window, float softcap, int num_threads) {
    return attention_entry(q, q_row_stride, k_cache, v_cache, tables, max_blocks, row_seq, lens, out, num_rows,
                           num_heads, num_kv_heads, head_dim, block_size, scale, window, softcap, num_threads, SS_F32, 0);
}

/* RMSNorm with the residual add in front (vLLM's fused_add_rms_norm): for each of the num_rows rows of x
 * (float32, [num_rows, n], updated in place), x += delta (when delta is not NULL), then
 * out = x / sqrt(mean(x^2) + eps) * weight, delta and out stored as dtype. Small inputs (decode steps) stay on
 * the calling thread: forking threads would cost more than the work. */
SS_INLINE void add_rms_norm_row(float *xr, const void *delta, const float *weight, void *out, int dtype, int64_t n,
                                float eps) {
    if (delta != NULL)
        for (int64_t i = 0; i < n; i++) xr[i] += load_elem(delta, dtype, i);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += xr[i] * xr[i];
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    for (int64_t i = 0; i < n; i++) store_elem(out, dtype, i, xr[i] * inv * weight[i]);
}

void ss_add_rms_norm_bf16(float *x, const uint16_t *delta, const float *weight, uint16_t *out, int64_t num_rows,
                          int64_t n, float eps, int num_threads) {
    const int threads = num_rows * n >= (1 << 16) ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < num_rows; r++)
        add_rms_norm_row(x + r * n, delta != NULL ? delta + r * n : NULL, weight, out + r * n, SS_BF16, n, eps);
}

void ss_add_rms_norm_f32(float *x, const float *delta, const float *weight, float *out, int64_t num_rows, int64_t n,
                         float eps, int num_threads) {
    const int threads = num_rows * n >= (1 << 16) ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < num_rows; r++)
        add_rms_norm_row(x + r * n, delta != NULL ? delta + r * n : NULL, weight, out + r * n, SS_F32, n, eps);
}

/* out[i][j] = x[i] . w[rows[i][j]] for i < m, j < per_row: x [m, k] and w [*, k] float32. Each dot product runs
 * in one fixed order (sixteen, or eight, interleaved partial sums over k, then a fixed tree), so a row's values
 * never depend on the other rows or the thread count: the logits' float32 refinement of the leading candidates
 * (llama.py's compute_logits). */
void ss_dot_rows_f32(const float *x, int64_t m, int64_t k, const float *w, const int64_t *rows, int64_t per_row,
                     float *out, int num_threads) {
    const int threads = m * per_row * k >= (1 << 16) ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < m; i++) {
        const float *xi = x + i * k;
        for (int64_t j = 0; j < per_row; j++) {
            const float *wr = w + rows[i * per_row + j] * k;
            int64_t d = 0;
            float dot = 0.0f;
#if defined(SS_AVX512)
            __m512 acc = _mm512_setzero_ps();
            for (; d + 16 <= k; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(xi + d), _mm512_loadu_ps(wr + d), acc);
            dot = _mm512_reduce_add_ps(acc);
#elif defined(SS_AVX2)
            __m256 acc = _mm256_setzero_ps();
            for (; d + 8 <= k; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(xi + d), _mm256_loadu_ps(wr + d), acc);
            __m128 h = _mm_add_ps(_mm256_extractf128_ps(acc, 1), _mm256_castps256_ps128(acc));
            h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            dot = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
#endif
            for (; d < k; d++) dot += xi[d] * wr[d];
            out[i * per_row + j] = dot;
        }
    }
}

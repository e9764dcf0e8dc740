/*
 * CPU kernels for the model's per-step work that PyTorch runs as many small ops (OpenMP, AVX-512 where the
 * compiler targets it):
 * - paged attention that reads K/V in place through each sequence's block table, for decode steps and
 *   prefill chunks alike, with one arithmetic per query whatever runs beside it;
 * - the residual add + RMSNorm + cast (vLLM's fused_add_rms_norm).
 *
 * Built and loaded by splitserve/model/kernels.py (cc -O3 -fopenmp, once per instruction-set level, at first use).
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
 */
#include <stdlib.h>

#include "common.h"
#include "simd.h"
#include "ss_kernels.h"

#define MAX_HEAD_DIM 256

/* Row helpers: a stored row to float32, and acc += p * row. With AVX-512 they run 16 lanes at a time (head_dim
 * a multiple of 16), with AVX2 8 lanes (a multiple of 8); otherwise plain loops. */
#if defined(SS_AVX512)
static inline __m512 load16_bf16(const uint16_t *p) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
#define VECTOR_ROWS(T, LOAD16)                                                                              \
    static inline void to_float_##T(const T *x, float *out, int n) {                                        \
        if (n % 16 == 0) {                                                                                  \
            for (int d = 0; d < n; d += 16) _mm512_storeu_ps(out + d, LOAD16(x + d));                      \
            return;                                                                                         \
        }                                                                                                   \
        for (int d = 0; d < n; d++) out[d] = scalar_##T(x[d]);                                              \
    }
#elif defined(SS_AVX2)
static inline __m256 load8_bf16(const uint16_t *p) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
#define VECTOR_ROWS(T, LOAD8)                                                                               \
    static inline void to_float_##T(const T *x, float *out, int n) {                                        \
        if (n % 8 == 0) {                                                                                   \
            for (int d = 0; d < n; d += 8) _mm256_storeu_ps(out + d, LOAD8(x + d));                        \
            return;                                                                                         \
        }                                                                                                   \
        for (int d = 0; d < n; d++) out[d] = scalar_##T(x[d]);                                              \
    }
#define load16_bf16 load8_bf16
#define load16_f32 load8_f32
#else
#define VECTOR_ROWS(T, LOAD16)                                                                              \
    static inline void to_float_##T(const T *x, float *out, int n) {                                        \
        for (int d = 0; d < n; d++) out[d] = scalar_##T(x[d]);                                              \
    }
#endif

static inline float scalar_uint16_t(uint16_t x) { return bf16_to_f32(x); }
static inline float scalar_float(float x) { return x; }
VECTOR_ROWS(uint16_t, load16_bf16)
VECTOR_ROWS(float, load16_f32)

static inline void axpy_row(float p, const float *x, float *acc, int n) {
#if defined(SS_AVX512)
    if (n % 16 == 0) {
        const __m512 pv = _mm512_set1_ps(p);
        for (int d = 0; d < n; d += 16)
            _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(pv, _mm512_loadu_ps(x + d), _mm512_loadu_ps(acc + d)));
        return;
    }
#elif defined(SS_AVX2)
    if (n % 8 == 0) {
        const __m256 pv = _mm256_set1_ps(p);
        for (int d = 0; d < n; d += 8)
            _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + d), _mm256_loadu_ps(acc + d)));
        return;
    }
#endif
    for (int d = 0; d < n; d++) acc[d] += p * x[d];
}

/* Blocked helpers for the vector builds (VW floats per vector): dot_many gives VW dot products of q with VW
 * consecutive rows at once, so the horizontal sums are one transposing reduction for all of them instead of
 * one per row; vload_row reads a stored row into vectors. */
#if defined(SS_AVX2)
static inline __m256 reduce8(const __m256 *a) { /* lane j = the sum of a[j]'s 8 lanes */
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif
#if defined(SS_AVX512)
#define VW 16
static inline void dot_many(const float *q, const float *rows, int n, float *out) {
    __m512 acc[16];
    for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
    for (int d = 0; d < n; d += 16) {
        const __m512 qv = _mm512_loadu_ps(q + d);
        for (int j = 0; j < 16; j++) acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(rows + j * n + d), acc[j]);
    }
    __m256 half[16];
    for (int j = 0; j < 16; j++)
        half[j] = _mm256_add_ps(_mm512_castps512_ps256(acc[j]), _mm512_extractf32x8_ps(acc[j], 1));
    _mm256_storeu_ps(out, reduce8(half));
    _mm256_storeu_ps(out + 8, reduce8(half + 8));
}
#elif defined(SS_AVX2)
#define VW 8
static inline void dot_many(const float *q, const float *rows, int n, float *out) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int d = 0; d < n; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows + j * n + d), acc[j]);
    }
    _mm256_storeu_ps(out, reduce8(acc));
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

/* The value pass with the group's accumulators in registers: for each KV head and slice of SV vectors of
 * head_dim, every token's V slice is loaded once and added into up to MAX_GROUP query heads' accumulators
 * (acc += p * v), which stay in registers across the tokens. Returns 0 where it does not apply (no vector
 * build, a larger group, head_dim not a multiple of the slice), and the caller runs the plain pass. */
#define MAX_GROUP 4
#if defined(SS_AVX512)
#define SV 4 /* 64 floats per slice */
typedef __m512 vec;
#define VZERO _mm512_setzero_ps()
#define VSET1 _mm512_set1_ps
#define VFMA _mm512_fmadd_ps
#define VSTORE _mm512_storeu_ps
#elif defined(SS_AVX2)
#define SV 2 /* 16 floats per slice */
typedef __m256 vec;
#define VZERO _mm256_setzero_ps()
#define VSET1 _mm256_set1_ps
#define VFMA _mm256_fmadd_ps
#define VSTORE _mm256_storeu_ps
#endif
#if VW > 0
#define DEFINE_VPASS(NAME, T, VLOAD)                                                                         \
    static int NAME(const T *v_cache, const int64_t *table, int64_t first_block, int64_t n, int64_t stride,  \
                    int num_kv_heads, int kv0, int kv1, int group, int head_dim, int block_size,            \
                    const float *scores, float *acc) {                                                      \
        if (group > MAX_GROUP || head_dim % (SV * VW) != 0) return 0;                                       \
        const int64_t row = (int64_t)num_kv_heads * head_dim;                                               \
        for (int kvh = kv0; kvh < kv1; kvh++) {                                                             \
            for (int d0 = 0; d0 < head_dim; d0 += SV * VW) {                                                \
                vec a[MAX_GROUP][SV];                                                                       \
                for (int g = 0; g < MAX_GROUP; g++)                                                         \
                    for (int i = 0; i < SV; i++) a[g][i] = VZERO;                                           \
                for (int64_t t0 = 0; t0 < n; t0 += block_size) {                                            \
                    const T *vp = v_cache + table[first_block + t0 / block_size] * block_size * row + kvh * head_dim + d0; \
                    const int64_t stop = t0 + block_size < n ? t0 + block_size : n;                         \
                    for (int64_t t = t0; t < stop; t++, vp += row) {                                        \
                        vec v[SV];                                                                          \
                        for (int i = 0; i < SV; i++) v[i] = VLOAD(vp + i * VW);                             \
                        for (int g = 0; g < MAX_GROUP; g++) {                                               \
                            if (g >= group) break;                                                          \
                            const vec p = VSET1(scores[(int64_t)(kvh * group + g) * stride + t]);           \
                            for (int i = 0; i < SV; i++) a[g][i] = VFMA(p, v[i], a[g][i]);                  \
                        }                                                                                   \
                    }                                                                                       \
                }                                                                                           \
                for (int g = 0; g < group; g++)                                                             \
                    for (int i = 0; i < SV; i++) VSTORE(acc + (kvh * group + g) * head_dim + d0 + i * VW, a[g][i]); \
            }                                                                                               \
        }                                                                                                   \
        return 1;                                                                                           \
    }
DEFINE_VPASS(v_pass_uint16_t, uint16_t, load16_bf16)
DEFINE_VPASS(v_pass_float, float, load16_f32)
#else
#define DEFINE_VPASS(NAME, T)                                                                                \
    static int NAME(const T *v_cache, const int64_t *table, int64_t first_block, int64_t n, int64_t stride,  \
                    int num_kv_heads, int kv0, int kv1, int group, int head_dim, int block_size,            \
                    const float *scores, float *acc) {                                                      \
        (void)v_cache, (void)table, (void)first_block, (void)n, (void)stride, (void)num_kv_heads, (void)group; \
        (void)kv0, (void)kv1;                                                                               \
        (void)head_dim, (void)block_size, (void)scores, (void)acc;                                          \
        return 0;                                                                                           \
    }
DEFINE_VPASS(v_pass_uint16_t, uint16_t)
DEFINE_VPASS(v_pass_float, float)
#endif

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
 * conversion to float (tile mode). The two modes only schedule the same calls: the partition and merge
 * functions are compiled once (SS_ONE_BODY), so both run the same machine code.
 *
 * The arithmetic: each key converted to float32 once (for every row of a tile), KG keys' scores at once by
 * dot_many (vector builds) or plain loops, exponentials in float32, the value sum by v_pass. (A bfloat16
 * arithmetic with AVX-512 BF16's pair dot products was measured too: a fifth faster in prefill, but its
 * bfloat16 probabilities flip SmolLM2's near-tied first token of "What is the capital of France?".) */
#define PARTITION 256 /* a multiple of KEY_RUN and of every block size taken */
#define KG 16
#define KEY_RUN (4 * KG) /* keys read per pass over a partition */
#define TILE_ROWS 16
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
#define DEFINE_GROUP_SCORES(T)                                                                               \
    static inline void group_scores_##T(const float *const *qf, int count, const int64_t *n, int64_t g,     \
                                        const T *const *keys, int64_t valid, int head_dim, int h0, int h1, \
                                        int num_heads, float *kf, float *scores) {                          \
        for (int64_t c = 0; c < (valid + KG - 1) / KG; c++) {                                               \
            for (int64_t j = 0; j < KG; j++) {                                                              \
                if (c * KG + j < valid)                                                                     \
                    to_float_##T(keys[c * KG + j], kf + j * head_dim, head_dim);                            \
                else                                                                                        \
                    memset(kf + j * head_dim, 0, sizeof(float) * (size_t)head_dim);                         \
            }                                                                                               \
            for (int i = 0; i < count; i++) {                                                               \
                if (n[i] <= g + c * KG) continue;                                                           \
                for (int h = h0; h < h1; h++)                                                               \
                    score_group(qf[i] + h * head_dim, kf, head_dim,                                         \
                                scores + ((int64_t)i * num_heads + h) * PARTITION + g + c * KG);            \
            }                                                                                               \
        }                                                                                                   \
    }
DEFINE_GROUP_SCORES(uint16_t)
DEFINE_GROUP_SCORES(float)

/* What a partition computes: rows i < count of one sequence, row i seeing keys begin .. begin + n[i] - 1
 * (1 <= n[i] <= PARTITION) through the slots of its table, the query heads of KV heads kv0 .. kv1 - 1; qf[i] its
 * query scaled to float32 ([heads][head_dim]); part[i]
 * receives, per head h, the maximum score m[h], l[h] = sum of exp(score - m[h]) and acc[h][d] = sum of
 * exp(score - m[h]) v[d] (m, l and acc one after another, for every head). */
typedef struct {
    int count;
    const int64_t *n;
    const int64_t *table;
    int64_t begin;
    int num_heads, num_kv_heads, kv0, kv1, head_dim, block_size;
    float *kf;     /* KG * head_dim floats */
    float *scores; /* count * num_heads * PARTITION floats */
    float *const *part;
} ss_partition;

/* slots[t] for t < n: the slot of key begin + t (begin is a multiple of the block size) */
static inline void partition_slots(const ss_partition *p, int64_t n, int64_t *slots) {
    const int64_t bs = p->block_size, *table = p->table + p->begin / bs;
    for (int64_t t0 = 0; t0 < n; t0 += bs) {
        const int64_t base = table[t0 / bs] * bs, stop = t0 + bs < n ? bs : n - t0;
        for (int64_t j = 0; j < stop; j++) slots[t0 + j] = base + j;
    }
}

/* The float32 arithmetic (see above) for one partition. */
#define DEFINE_FLOAT_PARTITION(T)                                                                            \
    static inline void partition_float_##T(const ss_partition *p, const float *const *qf, const T *k_cache, \
                                           const T *v_cache) {                                              \
        const int group = p->num_heads / p->num_kv_heads, head_dim = p->head_dim;                           \
        const int64_t row = (int64_t)p->num_kv_heads * head_dim; /* elements per slot */                    \
        int64_t most = 0;                                                                                   \
        for (int i = 0; i < p->count; i++) most = p->n[i] > most ? p->n[i] : most;                          \
        int64_t slots[PARTITION];                                                                           \
        partition_slots(p, most, slots);                                                                    \
        for (int64_t g = 0; g < most; g += KEY_RUN) {                                                       \
            const int64_t valid = most - g < KEY_RUN ? most - g : KEY_RUN;                                  \
            for (int kvh = p->kv0; kvh < p->kv1; kvh++) {                                                   \
                const T *keys[KEY_RUN];                                                                     \
                for (int64_t j = 0; j < valid; j++) keys[j] = k_cache + slots[g + j] * row + kvh * head_dim; \
                group_scores_##T(qf, p->count, p->n, g, keys, valid, head_dim, kvh * group, (kvh + 1) * group, \
                                 p->num_heads, p->kf, p->scores);                                           \
            }                                                                                               \
        }                                                                                                   \
        for (int i = 0; i < p->count; i++) {                                                                \
            const int64_t n = p->n[i];                                                                      \
            float *m = p->part[i], *l = m + p->num_heads, *acc = l + p->num_heads;                          \
            float *s = p->scores + (int64_t)i * p->num_heads * PARTITION;                                   \
            const int h0 = p->kv0 * group, h1 = p->kv1 * group;                                             \
            for (int h = h0; h < h1; h++) m[h] = max_row(s + h * PARTITION, n);                             \
            for (int h = h0; h < h1; h++) l[h] = exp_row(s + h * PARTITION, n, m[h]);                       \
            if (v_pass_##T(v_cache, p->table, p->begin / p->block_size, n, PARTITION, p->num_kv_heads, p->kv0, \
                           p->kv1, group, head_dim, p->block_size, s, acc))                                 \
                continue;                                                                                   \
            memset(acc + (size_t)h0 * head_dim, 0, sizeof(float) * (size_t)(h1 - h0) * (size_t)head_dim);  \
            for (int64_t t = 0; t < n; t++) {                                                               \
                const T *vp = v_cache + slots[t] * row;                                                     \
                for (int kvh = p->kv0; kvh < p->kv1; kvh++) {                                               \
                    float vf[MAX_HEAD_DIM];                                                                 \
                    to_float_##T(vp + kvh * head_dim, vf, head_dim);                                        \
                    for (int h = kvh * group; h < (kvh + 1) * group; h++)                                   \
                        axpy_row(s[h * PARTITION + t], vf, acc + h * head_dim, head_dim);                   \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
    }
DEFINE_FLOAT_PARTITION(uint16_t)
DEFINE_FLOAT_PARTITION(float)

/* One partition of the rows in p: each instance compiled once, so every caller runs the same code. */
static SS_ONE_BODY void partition_uint16_t(const ss_partition *p, const float *const *qf, const uint16_t *k_cache,
                                           const uint16_t *v_cache) {
    partition_float_uint16_t(p, qf, k_cache, v_cache);
}
static SS_ONE_BODY void partition_float(const ss_partition *p, const float *const *qf, const float *k_cache,
                                        const float *v_cache) {
    partition_float_float(p, qf, k_cache, v_cache);
}

/* A row's output from its num_parts partials (partition order): per head, the partitions' sums rescaled to
 * the largest maximum, then divided by the total. */
#define DEFINE_MERGE(NAME, T, STORE)                                                                         \
    static SS_ONE_BODY void NAME(const float *const *part, int64_t num_parts, int num_heads, int head_dim,  \
                                 T *out) {                                                                  \
        for (int h = 0; h < num_heads; h++) {                                                               \
            float top = -INFINITY, total = 0.0f, o[MAX_HEAD_DIM];                                           \
            for (int64_t it = 0; it < num_parts; it++) top = part[it][h] > top ? part[it][h] : top;         \
            for (int d = 0; d < head_dim; d++) o[d] = 0.0f;                                                 \
            for (int64_t it = 0; it < num_parts; it++) {                                                    \
                const float *m = part[it], *l = m + num_heads, *acc = l + num_heads + (size_t)h * head_dim; \
                const float w = ss_expf(m[h] - top);                                                           \
                total += w * l[h];                                                                          \
                for (int d = 0; d < head_dim; d++) o[d] += w * acc[d];                                      \
            }                                                                                               \
            for (int d = 0; d < head_dim; d++) out[h * head_dim + d] = STORE(o[d] / total);                \
        }                                                                                                   \
    }
#define STORE_F32(x) (x)
DEFINE_MERGE(merge_uint16_t, uint16_t, f32_to_bf16)
DEFINE_MERGE(merge_float, float, STORE_F32)

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

/* Attention of num_rows query rows, each over its own context: row r attends to positions 0 .. lens[r] - 1
 * of the sequence whose block table is tables[row_seq[r]] (tables[r] when row_seq is NULL). Returns 0, or -1
 * for shapes beyond the fixed buffers, an empty context or no memory (the caller falls back to PyTorch). */
#define DEFINE_ENTRY(NAME, T, LOAD)                                                                          \
    int NAME(const T *q, int64_t q_row_stride, const T *k_cache, const T *v_cache, const int64_t *tables,  \
             int64_t max_blocks, const int64_t *row_seq, const int64_t *lens, T *out, int num_rows,        \
             int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int num_threads) { \
        if (head_dim > MAX_HEAD_DIM || num_heads % num_kv_heads != 0 || block_size < 1 ||                  \
            PARTITION % block_size != 0)                                                                    \
            return -1;                                                                                      \
        int64_t max_len = 0;                                                                                \
        for (int r = 0; r < num_rows; r++) {                                                                \
            if (lens[r] < 1 || lens[r] > max_blocks * block_size) return -1;                                \
            max_len = lens[r] > max_len ? lens[r] : max_len;                                                \
        }                                                                                                   \
        const int64_t max_parts = (max_len + PARTITION - 1) / PARTITION;                                    \
        const size_t hd = (size_t)num_heads * (size_t)head_dim;                                             \
        const size_t per_part = (size_t)num_heads * ((size_t)head_dim + 2); /* m, l, acc */                \
        int64_t tile_rows = TILE_BUFFER_BYTES / (int64_t)(sizeof(float) * per_part * (size_t)max_parts);   \
        tile_rows = tile_rows < 1 ? 1 : tile_rows > TILE_ROWS ? TILE_ROWS : tile_rows;                      \
        int64_t *tile = malloc(sizeof(int64_t) * ((size_t)num_rows + 1));                                   \
        if (tile == NULL) return -1;                                                                        \
        const int64_t num_tiles = make_tiles(row_seq, num_rows, tile_rows, tile);                           \
        /* decode rows (tiles of one row), or too few tiles to share out: split the rows' partitions */   \
        const int split = 2 * num_tiles > num_rows || num_tiles < 4 * (int64_t)num_threads;               \
        const int64_t rows_per_item = split ? 1 : tile_rows;                                                \
        int64_t *first = NULL; /* split mode: each row's first item; its partials sit in `partials` */      \
        float *partials = NULL;                                                                             \
        if (split) {                                                                                        \
            first = malloc(sizeof(int64_t) * ((size_t)num_rows + 1));                                       \
            if (first != NULL) {                                                                            \
                first[0] = 0;                                                                               \
                for (int r = 0; r < num_rows; r++) first[r + 1] = first[r] + (lens[r] + PARTITION - 1) / PARTITION; \
                partials = malloc(sizeof(float) * per_part * (size_t)first[num_rows]);                      \
            }                                                                                               \
        }                                                                                                   \
        int failed = split && partials == NULL;                                                             \
        /* too few partitions to go round: split each one's KV heads too */                                \
        const int kv_split = split && first != NULL && first[num_rows] < 4 * (int64_t)num_threads ? num_kv_heads : 1; \
        const int kv_per_item = num_kv_heads / kv_split;                                                    \
        if (!failed) {                                                                                      \
            _Pragma("omp parallel num_threads(num_threads)") {                                              \
                const size_t own = split ? 0 : (size_t)rows_per_item * (size_t)max_parts * per_part;        \
                float *work = malloc(sizeof(float) * ((size_t)rows_per_item * (hd + (size_t)num_heads * PARTITION) + \
                                                      (size_t)KG * (size_t)head_dim + own));                 \
                const float **qf = malloc(sizeof(float *) * (size_t)rows_per_item);                         \
                float **part = malloc(sizeof(float *) * (size_t)(rows_per_item > max_parts ? rows_per_item : max_parts)); \
                int64_t *n = malloc(sizeof(int64_t) * (size_t)rows_per_item);                               \
                const int ok = work != NULL && qf != NULL && part != NULL && n != NULL;                     \
                if (!ok) {                                                                                  \
                    _Pragma("omp atomic write") failed = 1;                                                 \
                }                                                                                           \
                float *qbuf = work, *scores = ok ? work + (size_t)rows_per_item * hd : NULL;                \
                float *kf = ok ? scores + (size_t)rows_per_item * num_heads * PARTITION : NULL;             \
                float *mine = ok ? kf + (size_t)KG * head_dim : NULL;                                       \
                ss_partition job = {0, n, NULL, 0, num_heads, num_kv_heads, 0, num_kv_heads, head_dim,      \
                                    block_size, kf, scores, part};                                          \
                const int64_t num_items = split ? first[num_rows] * kv_split : num_tiles;                   \
                int r = 0;                                                                                  \
                _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < num_items; item++) {  \
                    if (!ok) continue;                                                                      \
                    if (split) { /* one KV head's query heads over one partition of one row */             \
                        const int64_t at = item / kv_split;                                                 \
                        const int kv0 = (int)(item % kv_split) * kv_per_item, kv1 = kv0 + kv_per_item;      \
                        while (first[r + 1] <= at) r++;                                                     \
                        while (first[r] > at) r--;                                                          \
                        const int64_t begin = (at - first[r]) * PARTITION;                                  \
                        n[0] = lens[r] - begin < PARTITION ? lens[r] - begin : PARTITION;                   \
                        const size_t e0 = (size_t)kv0 * (size_t)(num_heads / num_kv_heads) * (size_t)head_dim; \
                        const size_t e1 = (size_t)kv1 * (size_t)(num_heads / num_kv_heads) * (size_t)head_dim; \
                        for (size_t e = e0; e < e1; e++) qbuf[e] = LOAD(q[r * q_row_stride + (int64_t)e]) * scale; \
                        qf[0] = qbuf, part[0] = partials + per_part * (size_t)at;                           \
                        job.count = 1, job.table = tables + (row_seq ? row_seq[r] : r) * max_blocks;        \
                        job.begin = begin, job.kv0 = kv0, job.kv1 = kv1;                                    \
                        partition_##T(&job, qf, k_cache, v_cache);                                          \
                        continue;                                                                           \
                    }                                                                                       \
                    const int64_t r0 = tile[item], rows = tile[item + 1] - r0; /* tile mode: every partition */ \
                    const int64_t *table = tables + (row_seq ? row_seq[r0] : r0) * max_blocks;              \
                    int64_t longest = 0;                                                                    \
                    for (int64_t i = 0; i < rows; i++) {                                                    \
                        float *qi = qbuf + (size_t)i * hd;                                                  \
                        for (size_t e = 0; e < hd; e++) qi[e] = LOAD(q[(r0 + i) * q_row_stride + (int64_t)e]) * scale; \
                        longest = lens[r0 + i] > longest ? lens[r0 + i] : longest;                          \
                    }                                                                                       \
                    for (int64_t begin = 0; begin < longest; begin += PARTITION) {                          \
                        int count = 0;                                                                      \
                        for (int64_t i = 0; i < rows; i++) {                                                \
                            if (lens[r0 + i] <= begin) continue;                                            \
                            n[count] = lens[r0 + i] - begin < PARTITION ? lens[r0 + i] - begin : PARTITION; \
                            qf[count] = qbuf + (size_t)i * hd;                                              \
                            part[count] = mine + ((size_t)i * (size_t)max_parts + (size_t)(begin / PARTITION)) * per_part; \
                            count++;                                                                        \
                        }                                                                                   \
                        job.count = count, job.table = table, job.begin = begin, job.kv0 = 0;               \
                        job.kv1 = num_kv_heads;                                                             \
                        partition_##T(&job, qf, k_cache, v_cache);                                          \
                    }                                                                                       \
                    for (int64_t i = 0; i < rows; i++) {                                                    \
                        const int64_t parts = (lens[r0 + i] + PARTITION - 1) / PARTITION;                   \
                        for (int64_t it = 0; it < parts; it++) part[it] = mine + ((size_t)i * (size_t)max_parts + (size_t)it) * per_part; \
                        merge_##T((const float *const *)part, parts, num_heads, head_dim, out + (r0 + i) * (int64_t)hd); \
                    }                                                                                       \
                }                                                                                           \
                if (split) {                                                                                \
                    _Pragma("omp for schedule(static)") for (int rr = 0; rr < num_rows; rr++) {             \
                        if (!ok) continue;                                                                  \
                        for (int64_t it = first[rr]; it < first[rr + 1]; it++)                              \
                            part[it - first[rr]] = partials + per_part * (size_t)it;                        \
                        merge_##T((const float *const *)part, first[rr + 1] - first[rr], num_heads, head_dim, \
                                  out + (int64_t)rr * (int64_t)hd);                                         \
                    }                                                                                       \
                }                                                                                           \
                free(work), free(qf), free(part), free(n);                                                  \
            }                                                                                               \
        }                                                                                                   \
        free(partials), free(first), free(tile);                                                            \
        return failed ? -1 : 0;                                                                             \
    }

#define LOAD_F32(x) (x)
DEFINE_ENTRY(ss_paged_attention_bf16, uint16_t, bf16_to_f32)
DEFINE_ENTRY(ss_paged_attention_f32, float, LOAD_F32)

/* RMSNorm with the residual add in front (vLLM's fused_add_rms_norm): for each of the num_rows rows of x
 * (float32, [num_rows, n], updated in place), x += delta (when delta is not NULL), then
 * out = x / sqrt(mean(x^2) + eps) * weight, stored as bfloat16 or float32. Small inputs (decode steps)
 * stay on the calling thread: forking threads would cost more than the work. */
#define DEFINE_ADD_RMS_NORM(NAME, D, LOAD_D, O, STORE_O)                                                    \
    void NAME(float *x, const D *delta, const float *weight, O *out, int64_t num_rows, int64_t n, float eps, \
              int num_threads) {                                                                            \
        const int threads = num_rows * n >= (1 << 16) ? num_threads : 1;                                    \
        _Pragma("omp parallel for num_threads(threads) schedule(static)") for (int64_t r = 0; r < num_rows; \
                                                                              r++) {                       \
            float *xr = x + r * n;                                                                          \
            if (delta != NULL)                                                                              \
                for (int64_t i = 0; i < n; i++) xr[i] += LOAD_D(delta[r * n + i]);                          \
            float sum = 0.0f;                                                                               \
            _Pragma("omp simd reduction(+ : sum)") for (int64_t i = 0; i < n; i++) sum += xr[i] * xr[i];   \
            const float inv = 1.0f / sqrtf(sum / (float)n + eps);                                           \
            O *orow = out + r * n;                                                                          \
            for (int64_t i = 0; i < n; i++) orow[i] = STORE_O(xr[i] * inv * weight[i]);                     \
        }                                                                                                   \
    }

DEFINE_ADD_RMS_NORM(ss_add_rms_norm_bf16, uint16_t, bf16_to_f32, uint16_t, f32_to_bf16)
DEFINE_ADD_RMS_NORM(ss_add_rms_norm_f32, float, LOAD_F32, float, STORE_F32)

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

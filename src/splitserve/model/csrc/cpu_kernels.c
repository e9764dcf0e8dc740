/*
 * CPU kernels for the model's per-step work that PyTorch runs as many small ops (OpenMP, AVX-512 where the
 * compiler targets it):
 * - decode attention that reads K/V in place through each sequence's block table;
 * - the residual add + RMSNorm + cast (vLLM's fused_add_rms_norm).
 *
 * Built and loaded by splitserve/model/kernels.py (cc -O3 -fopenmp, once per instruction-set level, at first use).
 *
 * Decode attention: the torch fallback in attention.py first gathers every sequence's context into a
 * padded [B, L_max] tensor and then runs SDPA over it, so a 2,500-token sequence in a batch of short ones
 * makes every sequence pay for 2,500 tokens, twice (the copy and the attention). Here each sequence walks
 * its own blocks, once for the scores and once for the values; nothing is copied or padded.
 *
 * Work is split into (sequence, partition) items of PARTITION tokens, as flash-decoding does, so one long
 * sequence still uses every thread: an item reads its slots front to back (every KV head of a slot at once,
 * so reads are sequential) and leaves, per query head, its maximum score, its sum of exponentials and its
 * unnormalised output; a second pass merges a sequence's partitions. A step with fewer than
 * MIN_ITEMS_PER_THREAD items per thread (one stream with a short context) halves the partition, down to a
 * block, until it has that many: one item of 164 tokens kept one of two threads idle for the whole pass.
 *
 * Layout (attention.py's contract): the cache of one layer is [num_slots, num_kv_heads, head_dim],
 * slot = block_table[p / block_size] * block_size + p % block_size. q and out are [B, num_heads, head_dim]
 * with heads contiguous; q's rows may be strided (q_row_stride elements apart), out's are packed. Query
 * heads kvh*group .. kvh*group+group-1 share KV head kvh. Scores, softmax and accumulation are float32
 * whatever the storage dtype (bfloat16 or float32).
 */
#include <stdlib.h>

#include "common.h"

#define MAX_HEAD_DIM 256
#define PARTITION 256 /* tokens per work item, at most; a multiple of every block size */
#define MIN_ITEMS_PER_THREAD 2

/* Row helpers: the dot product of a float row with a stored row, and acc += p * stored row. With AVX-512
 * they run 16 lanes at a time (head_dim a multiple of 16), with AVX2 8 lanes (a multiple of 8); otherwise
 * loops the compiler vectorizes (omp simd lets it reorder the dot product's sum). */
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

static inline float dot_row(const float *a, const float *b, int n) {
#if defined(SS_AVX512)
    if (n % 32 == 0) {
        __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
        for (int d = 0; d < n; d += 32) {
            s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), s0);
            s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + d + 16), _mm512_loadu_ps(b + d + 16), s1);
        }
        return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
    }
#elif defined(SS_AVX2)
    if (n % 16 == 0) {
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        for (int d = 0; d < n; d += 16) {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), s1);
        }
        const __m256 s = _mm256_add_ps(s0, s1);
        __m128 h = _mm_add_ps(_mm256_extractf128_ps(s, 1), _mm256_castps256_ps128(s));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    }
#endif
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int d = 0; d < n; d++) dot += a[d] * b[d];
    return dot;
}

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

/* s[t] = exp(s[t] - top) for t < n; returns their sum. The AVX-512 exp: n = round(x / ln 2), r = x - n ln 2
 * (in two parts, Cody-Waite), exp(r) by its degree-7 Taylor polynomial (|r| <= ln 2 / 2: relative error
 * under 1e-8), scaled by 2^n. */
static inline float exp_row(float *s, int64_t n, float top) {
    float sum = 0.0f;
    int64_t t = 0;
#if defined(SS_AVX512)
    const __m512 shift = _mm512_set1_ps(top), lowest = _mm512_set1_ps(-88.0f);
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
    __m512 total = _mm512_setzero_ps();
    for (; t + 16 <= n; t += 16) {
        const __m512 x = _mm512_max_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), shift), lowest);
        const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512 r = _mm512_fnmadd_ps(k, ln2_lo, _mm512_fnmadd_ps(k, ln2_hi, x));
        __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
        const __m512 e = _mm512_scalef_ps(p, k);
        _mm512_storeu_ps(s + t, e);
        total = _mm512_add_ps(total, e);
    }
    sum = _mm512_reduce_add_ps(total);
#elif defined(SS_AVX2) /* the same, 8 lanes; 2^k built in the exponent bits (k >= -127 as x >= -88) */
    const __m256 shift = _mm256_set1_ps(top), lowest = _mm256_set1_ps(-88.0f);
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
    const __m256 ln2_hi = _mm256_set1_ps(0.693359375f), ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
    __m256 total = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
        const __m256 x = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(s + t), shift), lowest);
        const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256 r = _mm256_fnmadd_ps(k, ln2_lo, _mm256_fnmadd_ps(k, ln2_hi, x));
        __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
        const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
        const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
        _mm256_storeu_ps(s + t, e);
        total = _mm256_add_ps(total, e);
    }
    __m128 h = _mm_add_ps(_mm256_extractf128_ps(total, 1), _mm256_castps256_ps128(total));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    sum = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
#endif
    for (; t < n; t++) {
        s[t] = expf(s[t] - top);
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
    static int NAME(const T *v_cache, const int64_t *table, int64_t first_block, int64_t n, int num_kv_heads, \
                    int group, int head_dim, int block_size, const float *scores, float *acc) {             \
        if (group > MAX_GROUP || head_dim % (SV * VW) != 0) return 0;                                       \
        const int64_t row = (int64_t)num_kv_heads * head_dim;                                               \
        for (int kvh = 0; kvh < num_kv_heads; kvh++) {                                                      \
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
                            const vec p = VSET1(scores[(int64_t)(kvh * group + g) * n + t]);                \
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
    static int NAME(const T *v_cache, const int64_t *table, int64_t first_block, int64_t n, int num_kv_heads, \
                    int group, int head_dim, int block_size, const float *scores, float *acc) {             \
        (void)v_cache, (void)table, (void)first_block, (void)n, (void)num_kv_heads, (void)group;            \
        (void)head_dim, (void)block_size, (void)scores, (void)acc;                                          \
        return 0;                                                                                           \
    }
DEFINE_VPASS(v_pass_uint16_t, uint16_t)
DEFINE_VPASS(v_pass_float, float)
#endif

/* Per work item: for every query head h, max score m[h], sum of exp(score - m[h]) l[h], and
 * acc[h][d] = sum_t exp(score_t - m[h]) * v_t[d], over tokens [begin, end) of one sequence. */
#define DEFINE_PARTITION(NAME, T, LOAD)                                                                      \
    static void NAME(const T *q, const T *k_cache, const T *v_cache, const int64_t *table, int64_t begin,  \
                     int64_t end, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, \
                     float *qf, float *scores, float *m, float *l, float *acc) {                            \
        const int group = num_heads / num_kv_heads;                                                         \
        const int64_t n = end - begin;                                                                      \
        const int64_t row = (int64_t)num_kv_heads * head_dim; /* elements per slot */                       \
        for (int h = 0; h < num_heads; h++) {                                                               \
            for (int d = 0; d < head_dim; d++) qf[h * head_dim + d] = LOAD(q[h * head_dim + d]) * scale;   \
        }                                                                                                   \
        const int64_t first_block = begin / block_size; /* begin is a multiple of the block size */       \
        const int blocked = VW > 0 && head_dim % (VW > 0 ? VW : 1) == 0;                                    \
        for (int64_t t0 = 0; t0 < n; t0 += block_size) {                                                    \
            const T *kp = k_cache + table[first_block + t0 / block_size] * block_size * row;                 \
            const int64_t stop = t0 + block_size < n ? t0 + block_size : n;                                 \
            int64_t t = t0;                                                                                 \
            for (; blocked && t + VW <= stop; t += VW, kp += VW * row) { /* VW tokens at a time */           \
                for (int kvh = 0; kvh < num_kv_heads; kvh++) {                                              \
                    float kf[(VW > 0 ? VW : 1) * MAX_HEAD_DIM];                                             \
                    for (int j = 0; j < VW; j++) to_float_##T(kp + j * row + kvh * head_dim, kf + j * head_dim, head_dim); \
                    for (int h = kvh * group; h < (kvh + 1) * group; h++)                                   \
                        dot_many(qf + h * head_dim, kf, head_dim, scores + h * n + t);                      \
                }                                                                                           \
            }                                                                                               \
            for (; t < stop; t++, kp += row) {                                                              \
                for (int kvh = 0; kvh < num_kv_heads; kvh++) {                                              \
                    float kf[MAX_HEAD_DIM];                                                                 \
                    to_float_##T(kp + kvh * head_dim, kf, head_dim);                                        \
                    for (int h = kvh * group; h < (kvh + 1) * group; h++)                                   \
                        scores[h * n + t] = dot_row(qf + h * head_dim, kf, head_dim);                       \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        for (int h = 0; h < num_heads; h++) m[h] = max_row(scores + h * n, n);                              \
        for (int h = 0; h < num_heads; h++) l[h] = exp_row(scores + h * n, n, m[h]);                        \
        if (v_pass_##T(v_cache, table, first_block, n, num_kv_heads, group, head_dim, block_size, scores, acc)) \
            return;                                                                                         \
        memset(acc, 0, sizeof(float) * (size_t)num_heads * (size_t)head_dim);                               \
        for (int64_t t0 = 0; t0 < n; t0 += block_size) {                                                    \
            const T *vp = v_cache + table[first_block + t0 / block_size] * block_size * row;                 \
            const int64_t stop = t0 + block_size < n ? t0 + block_size : n;                                 \
            for (int64_t t = t0; t < stop; t++, vp += row) {                                                \
                for (int kvh = 0; kvh < num_kv_heads; kvh++) {                                              \
                    float vf[MAX_HEAD_DIM];                                                                 \
                    to_float_##T(vp + kvh * head_dim, vf, head_dim);                                        \
                    for (int h = kvh * group; h < (kvh + 1) * group; h++)                                   \
                        axpy_row(scores[h * n + t], vf, acc + h * head_dim, head_dim);                      \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
    }

#define LOAD_F32(x) (x)
DEFINE_PARTITION(partition_bf16, uint16_t, bf16_to_f32)
DEFINE_PARTITION(partition_f32, float, LOAD_F32)

/* Tokens per work item: PARTITION, halved while the step would have fewer than MIN_ITEMS_PER_THREAD items per
 * thread and the half is still a whole number of blocks. One thread keeps whole partitions (nothing to share). */
static int64_t partition_size(const int64_t *lens, int num_seqs, int block_size, int num_threads) {
    int64_t part = PARTITION;
    if (num_threads < 2) return part;
    for (;;) {
        int64_t items = 0;
        for (int b = 0; b < num_seqs; b++) items += (lens[b] + part - 1) / part;
        if (items >= (int64_t)MIN_ITEMS_PER_THREAD * num_threads || part / 2 < block_size || (part / 2) % block_size)
            return part;
        part /= 2;
    }
}

/* Returns 0, or -1 when the head size is beyond the fixed buffers or memory runs out (the caller falls
 * back to PyTorch). */
#define DEFINE_ENTRY(NAME, T, PARTITION_FN, STORE)                                                          \
    int NAME(const T *q, int64_t q_row_stride, const T *k_cache, const T *v_cache, const int64_t *tables,  \
             int64_t max_blocks, const int64_t *lens, T *out, int num_seqs, int num_heads, int num_kv_heads, \
             int head_dim, int block_size, float scale, int num_threads) {                                  \
        if (head_dim > MAX_HEAD_DIM || num_heads % num_kv_heads != 0 || PARTITION % block_size != 0) return -1; \
        int64_t *first = malloc(sizeof(int64_t) * ((size_t)num_seqs + 1)); /* first item of each sequence */ \
        if (first == NULL) return -1;                                                                       \
        const int64_t part = partition_size(lens, num_seqs, block_size, num_threads);                       \
        first[0] = 0;                                                                                       \
        for (int b = 0; b < num_seqs; b++) first[b + 1] = first[b] + (lens[b] + part - 1) / part;           \
        const int64_t num_items = first[num_seqs];                                                          \
        const size_t per_item = (size_t)num_heads * ((size_t)head_dim + 2); /* m, l, acc */                 \
        float *partials = malloc(sizeof(float) * per_item * (size_t)num_items);                             \
        int failed = partials == NULL;                                                                      \
        if (!failed) {                                                                                      \
            _Pragma("omp parallel num_threads(num_threads)") {                                              \
                const size_t hd = (size_t)num_heads * (size_t)head_dim;                                     \
                float *work = malloc(sizeof(float) * (hd + (size_t)num_heads * PARTITION));                 \
                if (work == NULL) {                                                                         \
                    _Pragma("omp atomic write") failed = 1;                                                 \
                }                                                                                           \
                int b = 0;                                                                                  \
                _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < num_items; item++) {  \
                    if (work == NULL) continue;                                                             \
                    while (first[b + 1] <= item) b++;                                                       \
                    while (first[b] > item) b--;                                                            \
                    const int64_t begin = (item - first[b]) * part;                                         \
                    const int64_t end = begin + part < lens[b] ? begin + part : lens[b];                    \
                    float *m = partials + per_item * (size_t)item, *l = m + num_heads, *acc = l + num_heads; \
                    PARTITION_FN(q + b * q_row_stride, k_cache, v_cache, tables + (int64_t)b * max_blocks, begin, \
                                 end, num_heads, num_kv_heads, head_dim, block_size, scale, work, work + hd, m, l, \
                                 acc);                                                                      \
                }                                                                                           \
                _Pragma("omp for") for (int bb = 0; bb < num_seqs; bb++) { /* merge the partitions */       \
                    for (int h = 0; h < num_heads; h++) {                                                   \
                        float top = -INFINITY, total = 0.0f, o[MAX_HEAD_DIM];                               \
                        for (int64_t it = first[bb]; it < first[bb + 1]; it++) {                            \
                            const float mi = partials[per_item * (size_t)it + h];                           \
                            if (mi > top) top = mi;                                                         \
                        }                                                                                   \
                        for (int d = 0; d < head_dim; d++) o[d] = 0.0f;                                     \
                        for (int64_t it = first[bb]; it < first[bb + 1]; it++) {                            \
                            const float *m = partials + per_item * (size_t)it, *l = m + num_heads;          \
                            const float *acc = l + num_heads + (size_t)h * head_dim;                        \
                            const float w = expf(m[h] - top);                                               \
                            total += w * l[h];                                                              \
                            for (int d = 0; d < head_dim; d++) o[d] += w * acc[d];                          \
                        }                                                                                   \
                        T *op = out + ((int64_t)bb * num_heads + h) * head_dim;                             \
                        for (int d = 0; d < head_dim; d++) op[d] = STORE(o[d] / total);                     \
                    }                                                                                       \
                }                                                                                           \
                free(work);                                                                                 \
            }                                                                                               \
        }                                                                                                   \
        free(partials);                                                                                     \
        free(first);                                                                                        \
        return failed ? -1 : 0;                                                                             \
    }

#define STORE_F32(x) (x)
DEFINE_ENTRY(paged_decode_attention_bf16, uint16_t, partition_bf16, f32_to_bf16)
DEFINE_ENTRY(paged_decode_attention_f32, float, partition_f32, STORE_F32)

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

DEFINE_ADD_RMS_NORM(add_rms_norm_bf16_to_bf16, uint16_t, bf16_to_f32, uint16_t, f32_to_bf16)
DEFINE_ADD_RMS_NORM(add_rms_norm_f32_to_f32, float, LOAD_F32, float, STORE_F32)

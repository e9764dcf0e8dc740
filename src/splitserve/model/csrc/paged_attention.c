/*
 * Decode attention that reads K/V in place through each sequence's block table (CPU, OpenMP).
 *
 * Built and loaded by splitserve/model/kernels.py (gcc -O3 -march=native -fopenmp, at first use). The
 * torch fallback in attention.py first gathers every sequence's context into a padded [B, L_max] tensor
 * and then runs SDPA over it: a 2,500-token sequence in a batch of short ones makes every sequence pay
 * for 2,500 tokens, twice (the copy and the attention). Here each (sequence, KV head) pair walks its own
 * blocks once for the scores and once for the values; nothing is copied or padded.
 *
 * Layout (attention.py's contract): the cache of one layer is [num_slots, num_kv_heads, head_dim],
 * slot = block_table[p / block_size] * block_size + p % block_size. q and out are [B, num_heads, head_dim]
 * with heads contiguous; q's rows may be strided (q_row_stride elements apart), out's are packed. Query
 * heads kvh*group .. kvh*group+group-1 share KV head kvh. Scores, softmax and accumulation are float32
 * whatever the storage dtype (bfloat16 or float32).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);  /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* One (sequence, KV head) pair. `scores` has room for group * len floats. */
#define DEFINE_PAIR(NAME, T, LOAD)                                                                           \
    static void NAME(const T *q, const T *k_cache, const T *v_cache, const int64_t *table, int64_t len,    \
                     int num_kv_heads, int kvh, int group, int head_dim, int block_size, float scale,       \
                     float *scores, float *acc) {                                                           \
        float qf[MAX_GROUP][MAX_HEAD_DIM];                                                                  \
        float row_max[MAX_GROUP], row_sum[MAX_GROUP];                                                       \
        for (int g = 0; g < group; g++) {                                                                   \
            for (int d = 0; d < head_dim; d++) qf[g][d] = LOAD(q[g * head_dim + d]) * scale;               \
            row_max[g] = -INFINITY;                                                                         \
            row_sum[g] = 0.0f;                                                                              \
        }                                                                                                   \
        const int64_t row = (int64_t)num_kv_heads * head_dim; /* elements per slot */                       \
        for (int64_t start = 0; start < len; start += block_size) {                                         \
            const int64_t base = table[start / block_size] * block_size;                                    \
            const int64_t n = len - start < block_size ? len - start : block_size;                          \
            for (int64_t i = 0; i < n; i++) {                                                               \
                const T *kp = k_cache + (base + i) * row + (int64_t)kvh * head_dim;                         \
                float kf[MAX_HEAD_DIM];                                                                     \
                for (int d = 0; d < head_dim; d++) kf[d] = LOAD(kp[d]);                                     \
                for (int g = 0; g < group; g++) {                                                           \
                    float dot = 0.0f;                                                                       \
                    _Pragma("omp simd reduction(+ : dot)") for (int d = 0; d < head_dim; d++) dot +=       \
                        qf[g][d] * kf[d];                                                                   \
                    scores[g * len + start + i] = dot;                                                      \
                    if (dot > row_max[g]) row_max[g] = dot;                                                 \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        for (int g = 0; g < group; g++) {                                                                   \
            float *s = scores + g * len, sum = 0.0f;                                                        \
            for (int64_t t = 0; t < len; t++) {                                                             \
                s[t] = expf(s[t] - row_max[g]);                                                             \
                sum += s[t];                                                                                \
            }                                                                                               \
            row_sum[g] = sum;                                                                               \
            for (int d = 0; d < head_dim; d++) acc[g * head_dim + d] = 0.0f;                                \
        }                                                                                                   \
        for (int64_t start = 0; start < len; start += block_size) {                                         \
            const int64_t base = table[start / block_size] * block_size;                                    \
            const int64_t n = len - start < block_size ? len - start : block_size;                          \
            for (int64_t i = 0; i < n; i++) {                                                               \
                const T *vp = v_cache + (base + i) * row + (int64_t)kvh * head_dim;                         \
                float vf[MAX_HEAD_DIM];                                                                     \
                for (int d = 0; d < head_dim; d++) vf[d] = LOAD(vp[d]);                                     \
                for (int g = 0; g < group; g++) {                                                           \
                    const float p = scores[g * len + start + i];                                            \
                    float *a = acc + g * head_dim;                                                          \
                    _Pragma("omp simd") for (int d = 0; d < head_dim; d++) a[d] += p * vf[d];              \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        for (int g = 0; g < group; g++) {                                                                   \
            const float inv = 1.0f / row_sum[g];                                                            \
            for (int d = 0; d < head_dim; d++) acc[g * head_dim + d] *= inv;                                \
        }                                                                                                   \
    }

#define LOAD_F32(x) (x)
DEFINE_PAIR(pair_bf16, uint16_t, bf16_to_f32)
DEFINE_PAIR(pair_f32, float, LOAD_F32)

/* Returns 0, or -1 when the shapes are beyond the fixed per-pair buffers (the caller falls back). */
#define DEFINE_ENTRY(NAME, T, PAIR, STORE)                                                                  \
    int NAME(const T *q, int64_t q_row_stride, const T *k_cache, const T *v_cache, const int64_t *tables,  \
             int64_t max_blocks, const int64_t *lens, T *out, int num_seqs, int num_heads, int num_kv_heads, \
             int head_dim, int block_size, float scale, int num_threads) {                                  \
        const int group = num_heads / num_kv_heads;                                                         \
        if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM) return -1;                                        \
        int64_t max_len = 1;                                                                                \
        for (int b = 0; b < num_seqs; b++)                                                                  \
            if (lens[b] > max_len) max_len = lens[b];                                                       \
        int failed = 0;                                                                                     \
        _Pragma("omp parallel num_threads(num_threads)") {                                                  \
            float *scores = malloc(sizeof(float) * (size_t)group * (size_t)max_len);                        \
            float acc[MAX_GROUP * MAX_HEAD_DIM];                                                            \
            if (scores == NULL) {                                                                           \
                _Pragma("omp atomic write") failed = 1;                                                     \
            }                                                                                               \
            _Pragma("omp for collapse(2) schedule(dynamic, 1)") for (int b = 0; b < num_seqs; b++) {        \
                for (int kvh = 0; kvh < num_kv_heads; kvh++) {                                              \
                    if (scores == NULL) continue;                                                           \
                    const T *qp = q + b * q_row_stride + (int64_t)kvh * group * head_dim;                  \
                    PAIR(qp, k_cache, v_cache, tables + (int64_t)b * max_blocks, lens[b], num_kv_heads, kvh, \
                         group, head_dim, block_size, scale, scores, acc);                                  \
                    T *op = out + ((int64_t)b * num_heads + (int64_t)kvh * group) * head_dim;               \
                    for (int i = 0; i < group * head_dim; i++) op[i] = STORE(acc[i]);                       \
                }                                                                                           \
            }                                                                                               \
            free(scores);                                                                                   \
        }                                                                                                   \
        return failed ? -1 : 0;                                                                             \
    }

#define STORE_F32(x) (x)
DEFINE_ENTRY(paged_decode_attention_bf16, uint16_t, pair_bf16, f32_to_bf16)
DEFINE_ENTRY(paged_decode_attention_f32, float, pair_f32, STORE_F32)

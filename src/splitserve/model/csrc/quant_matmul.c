/*
 * Matmuls straight from a GGUF's quantized weights: Y[M, N] = X[M, K] . W[N, K]^T, with W in llama.cpp's
 * Q4_0, Q4_1 or Q8_0 blocks (32 weights each, as stored in the file) and X quantized on the fly to 8 bits
 * per block of 32 (scale d, sum s = d * sum(q)), so every block product is an integer dot product:
 *
 *     sum_k w_k x_k = d_w d_x sum_k u_k q_k + m_w s_x      (w_k = d_w u_k + m_w, x_k ~ d_x q_k)
 *
 * where u is the weight code the instruction set multiplies and m_w the offset that makes it exact:
 * - AVX2 (maddubs: unsigned x signed bytes): Q4 codes 0..15 with m_w = -8 d (Q4_0) or the block min (Q4_1);
 *   Q8_0 through the sign trick (|w| x sign(x, w)), m_w = 0.
 * - AVX-VNNI / AVX-512 VNNI (dpbusd): as AVX2, but Q8_0 as w + 128 (unsigned) with m_w = -128 d.
 * - NEON and the portable scalar path: signed codes (Q4_0 q - 8), m_w = 0 except Q4_1's min.
 *
 * The layout is the reading of llama.cpp's ggml-cpu vec_dot_q4_1_q8_1 and friends; the tiling is ours: a
 * tile is MR activation rows x NR weight rows, so each decoded weight block serves MR rows and each
 * activation block NR weight rows. Threads split the weight rows (OpenMP), so decode (M = 1..32) and
 * prefill (M in the hundreds) both use every core, and each thread's weight rows stay in its cache while
 * it walks all activation rows.
 */
#include <stdlib.h>

#include "common.h"
#include "ss_kernels.h"

enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8 };
#define QK 32

typedef struct {
    uint16_t d;
    uint8_t qs[QK / 2]; /* byte j: weight j in the low nibble, weight j + 16 in the high one */
} block_q4_0;
typedef struct {
    uint16_t d, m;
    uint8_t qs[QK / 2];
} block_q4_1;
typedef struct {
    uint16_t d;
    int8_t qs[QK];
} block_q8_0;
/* An activation block: x_k ~ d * qs[k], s = d * sum(qs). */
typedef struct {
    float d, s;
    int8_t qs[QK];
} block_q8a;

_Static_assert(sizeof(block_q4_0) == 18 && sizeof(block_q4_1) == 20 && sizeof(block_q8_0) == 34, "GGML blocks");

int64_t ss_quant_row_bytes(int wtype, int64_t k) {
    const int64_t nb = k / QK;
    switch (wtype) {
        case GGML_Q4_0: return nb * (int64_t)sizeof(block_q4_0);
        case GGML_Q4_1: return nb * (int64_t)sizeof(block_q4_1);
        case GGML_Q8_0: return nb * (int64_t)sizeof(block_q8_0);
        default: return -1;
    }
}

int64_t ss_act_block_bytes(void) { return (int64_t)sizeof(block_q8a); }

/* ------------------------------------------------------------------ activations to 8 bits per block */

static void quantize_block(const float *x, block_q8a *y) {
#if defined(SS_AVX2)
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
#else
    float top = 0.0f;
    for (int k = 0; k < QK; k++) top = fmaxf(top, fabsf(x[k]));
    const float d = top / 127.0f, id = top > 0.0f ? 127.0f / top : 0.0f;
    int sum = 0;
    for (int k = 0; k < QK; k++) {
        const int q = (int)nearbyintf(x[k] * id);
        y->qs[k] = (int8_t)q;
        sum += q;
    }
    y->d = d;
    y->s = d * (float)sum;
#endif
}

/* rows [M, K] of float32 or bfloat16 (row_stride elements apart) -> M * K/32 blocks. */
static void quantize_rows(const void *x, int dtype, int64_t row_stride, int64_t m, int64_t k, block_q8a *out,
                          int num_threads) {
    const int64_t nb = k / QK;
    const int threads = m * k >= (1 << 15) ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < m; r++) {
        float buf[QK];
        for (int64_t b = 0; b < nb; b++) {
            const float *src;
            if (dtype == SS_F32) {
                src = (const float *)x + r * row_stride + b * QK;
            } else {
                const uint16_t *h = (const uint16_t *)x + r * row_stride + b * QK;
                for (int j = 0; j < QK; j++) buf[j] = bf16_to_f32(h[j]);
                src = buf;
            }
            quantize_block(src, out + r * nb + b);
        }
    }
}

/* ------------------------------------------------------------------------- the repacked layout */
/* At load, weights are repacked into groups of RG rows interleaved 4 weights at a time, so one vector holds 4
 * consecutive weights of each of the RG rows. An integer dot product against 4 activation bytes broadcast to
 * every lane then gives RG rows' partial sums in RG lanes: no horizontal sums, and the per-block scales are
 * one vector operation for RG rows (llama.cpp's repacked q4_0_8x8 kernels work the same way). */
#if defined(SS_AVX2)
#define RG 8
#elif defined(SS_NEON)
#define RG 4
#else
#define RG 8
#endif
#if defined(SS_VNNI)
#define Q8_OFFSET 128 /* dpbusd multiplies unsigned weights: Q8_0 is stored as w + 128, corrected by m = -128 d */
#else
#define Q8_OFFSET 0
#endif

typedef struct {
    uint16_t d[RG], m[RG];  /* fp16 scale and offset of each row's block: w = d u + m, u in 0..15 */
    uint8_t qs[4][RG * 4]; /* qs[v][4 r + j]: low nibble u of weight 4 v + j of row r, high nibble weight 16 + 4 v + j */
} group_q4;
typedef struct {
    uint16_t d[RG];
    uint8_t qs[8][RG * 4]; /* qs[c][4 r + j]: weight 4 c + j of row r, as a byte (+ Q8_OFFSET) */
} group_q8;

int64_t ss_packed_bytes(int wtype, int64_t n, int64_t k) {
    const int64_t groups = (n + RG - 1) / RG, nb = k / QK;
    if (k % QK != 0) return -1;
    switch (wtype) {
        case GGML_Q4_0:
        case GGML_Q4_1: return groups * nb * (int64_t)sizeof(group_q4);
        case GGML_Q8_0: return groups * nb * (int64_t)sizeof(group_q8);
        default: return -1;
    }
}

static void repack_q4(const uint8_t *src, int wtype, int64_t n, int64_t nb, group_q4 *dst) {
    const int64_t row_bytes = ss_quant_row_bytes(wtype, nb * QK);
    for (int64_t g = 0; g < (n + RG - 1) / RG; g++)
        for (int64_t kb = 0; kb < nb; kb++) {
            group_q4 *out = dst + g * nb + kb;
            memset(out, 0, sizeof *out);
            for (int r = 0; r < RG && g * RG + r < n; r++) {
                const uint8_t *blk = src + (g * RG + r) * row_bytes;
                const uint8_t *qs;
                if (wtype == GGML_Q4_0) {
                    const block_q4_0 *b = (const block_q4_0 *)blk + kb;
                    out->d[r] = b->d;
                    out->m[r] = f32_to_f16(-8.0f * f16_to_f32(b->d)); /* exact: a power of two */
                    qs = b->qs;
                } else {
                    const block_q4_1 *b = (const block_q4_1 *)blk + kb;
                    out->d[r] = b->d;
                    out->m[r] = b->m;
                    qs = b->qs;
                }
                /* GGUF byte t holds weight t (low nibble) and t + 16 (high): byte 4 v + j is qs[v][4 r + j] */
                for (int v = 0; v < 4; v++) memcpy(&out->qs[v][4 * r], qs + 4 * v, 4);
            }
        }
}

static void repack_q8(const uint8_t *src, int64_t n, int64_t nb, group_q8 *dst) {
    const int64_t row_bytes = ss_quant_row_bytes(GGML_Q8_0, nb * QK);
    for (int64_t g = 0; g < (n + RG - 1) / RG; g++)
        for (int64_t kb = 0; kb < nb; kb++) {
            group_q8 *out = dst + g * nb + kb;
            memset(out, 0, sizeof *out);
            for (int r = 0; r < RG && g * RG + r < n; r++) {
                const block_q8_0 *b = (const block_q8_0 *)(src + (g * RG + r) * row_bytes) + kb;
                out->d[r] = b->d;
                for (int c = 0; c < 8; c++)
                    for (int j = 0; j < 4; j++) out->qs[c][4 * r + j] = (uint8_t)(b->qs[4 * c + j] + Q8_OFFSET);
            }
        }
}

/* GGUF rows [N, K] of wtype -> the grouped layout (ss_packed_bytes(wtype, N, K) bytes). Returns 0 or -1. */
int ss_repack(const void *src, int wtype, int64_t n, int64_t k, void *dst) {
    if (ss_packed_bytes(wtype, n, k) < 0) return -1;
    if (wtype == GGML_Q8_0)
        repack_q8((const uint8_t *)src, n, k / QK, (group_q8 *)dst);
    else
        repack_q4((const uint8_t *)src, wtype, n, k / QK, (group_q4 *)dst);
    return 0;
}

/* ---------------------------------------------------------------------------------- group kernels */
/* out[i * RG + r] = sum over the K/32 blocks of activation row x[i] . weight row r of the group, i < MR. */

#if defined(SS_AVX2)
/* Each group kernel asks for the weight block PREFETCH_AHEAD blocks past the one it reads (2.5 KB ahead for
 * Q4_1, 4.3 KB for Q8_0). The hardware prefetcher alone left a single-stream step's 96 MB of weights streaming
 * at 16-17 GB/s on an AMX VM whose L3 share held none of them; with 16 blocks ahead, 20-31 GB/s (4 rows:
 * 12.5-13.3 -> 7.3-8.0 ms for every matrix of the model once; 8 and 32 ahead were slower). */
#define PREFETCH_AHEAD 16
static inline void prefetch_ahead(const void *block, size_t bytes) {
    const char *p = (const char *)block + PREFETCH_AHEAD * bytes;
    for (size_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
}
static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}
#if defined(SS_AVXVNNI)
#define DPBUSD(acc, u, x) _mm256_dpbusd_avx_epi32(acc, u, x)
#elif defined(SS_VNNI)
#define DPBUSD(acc, u, x) _mm256_dpbusd_epi32(acc, u, x)
#endif
/* RG lanes of int32: for each row, the dot product of its 32 codes u (8 chunks of 4) with the block's bytes */
static inline __m256i dot_q4(const __m256i *u, const int8_t *xq) {
#if defined(DPBUSD)
    __m256i dot = _mm256_setzero_si256();
    for (int c = 0; c < 8; c++) dot = DPBUSD(dot, u[c], bcast4(xq + 4 * c));
    return dot;
#else /* codes are at most 15, so eight 16-bit pair sums stay below 2^15 */
    __m256i pairs = _mm256_maddubs_epi16(u[0], bcast4(xq));
    for (int c = 1; c < 8; c++) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(u[c], bcast4(xq + 4 * c)));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}
static inline __m256i dot_q8(const __m256i *w, const int8_t *xq) {
    __m256i dot = _mm256_setzero_si256();
#if defined(DPBUSD)
    for (int c = 0; c < 8; c++) dot = DPBUSD(dot, w[c], bcast4(xq + 4 * c));
#else /* |w| x sign(x, w); each pair sum may reach 2 * 127 * 127, so widen every chunk */
    for (int c = 0; c < 8; c++) {
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w[c], w[c]), _mm256_sign_epi8(bcast4(xq + 4 * c), w[c]));
        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    }
#endif
    return dot;
}
#define DEFINE_GROUP(NAME, GROUP, MR, UNPACK, DOT, M_OF)                                                   \
    static void NAME(const void *wp, const block_q8a *const *x, int64_t nb, float *out) {                \
        const GROUP *w = (const GROUP *)wp;                                                              \
        __m256 acc[MR];                                                                                  \
        for (int i = 0; i < MR; i++) acc[i] = _mm256_setzero_ps();                                       \
        for (int64_t kb = 0; kb < nb; kb++) {                                                            \
            const GROUP *b = w + kb;                                                                     \
            prefetch_ahead(b, sizeof(GROUP));                                                            \
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b->d));                   \
            const __m256 mw = M_OF(b, dw);                                                               \
            __m256i u[8];                                                                                \
            UNPACK(b, u);                                                                                \
            for (int i = 0; i < MR; i++) {                                                               \
                const block_q8a *xb = x[i] + kb;                                                         \
                const __m256 dot = _mm256_cvtepi32_ps(DOT(u, xb->qs));                                   \
                acc[i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dw, _mm256_set1_ps(xb->d)), acc[i]);         \
                acc[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xb->s), acc[i]);                             \
            }                                                                                            \
        }                                                                                                \
        for (int i = 0; i < MR; i++) _mm256_storeu_ps(out + i * RG, acc[i]);                             \
    }
static inline void unpack_q4(const group_q4 *b, __m256i *u) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int v = 0; v < 4; v++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)b->qs[v]);
        u[v] = _mm256_and_si256(raw, low);
        u[v + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    }
}
static inline void unpack_q8(const group_q8 *b, __m256i *u) {
    for (int c = 0; c < 8; c++) u[c] = _mm256_loadu_si256((const __m256i *)b->qs[c]);
}
#define M_Q4(b, dw) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b)->m))
#define M_Q8(b, dw) _mm256_mul_ps(dw, _mm256_set1_ps(-(float)Q8_OFFSET))

#elif defined(SS_NEON)
static inline int32x4_t dot_lane(int32x4_t acc, int8x16_t w, int8x16_t x, const int lane) {
#if defined(__ARM_FEATURE_DOTPROD)
    switch (lane) {
        case 0: return vdotq_laneq_s32(acc, w, x, 0);
        case 1: return vdotq_laneq_s32(acc, w, x, 1);
        case 2: return vdotq_laneq_s32(acc, w, x, 2);
        default: return vdotq_laneq_s32(acc, w, x, 3);
    }
#else
    int32x4_t lanes = vreinterpretq_s32_s8(x);
    int8x16_t xb;
    switch (lane) {
        case 0: xb = vreinterpretq_s8_s32(vdupq_laneq_s32(lanes, 0)); break;
        case 1: xb = vreinterpretq_s8_s32(vdupq_laneq_s32(lanes, 1)); break;
        case 2: xb = vreinterpretq_s8_s32(vdupq_laneq_s32(lanes, 2)); break;
        default: xb = vreinterpretq_s8_s32(vdupq_laneq_s32(lanes, 3)); break;
    }
    const int16x8_t lo = vmull_s8(vget_low_s8(w), vget_low_s8(xb)), hi = vmull_high_s8(w, xb);
    return vaddq_s32(acc, vpaddlq_s16(vpaddq_s16(lo, hi)));
#endif
}
static inline int32x4_t dot_codes(const int8x16_t *u, const int8_t *xq) {
    const int8x16_t x0 = vld1q_s8(xq), x1 = vld1q_s8(xq + 16);
    int32x4_t dot = vdupq_n_s32(0);
    dot = dot_lane(dot, u[0], x0, 0);
    dot = dot_lane(dot, u[1], x0, 1);
    dot = dot_lane(dot, u[2], x0, 2);
    dot = dot_lane(dot, u[3], x0, 3);
    dot = dot_lane(dot, u[4], x1, 0);
    dot = dot_lane(dot, u[5], x1, 1);
    dot = dot_lane(dot, u[6], x1, 2);
    return dot_lane(dot, u[7], x1, 3);
}
static inline float32x4_t load_f16x4(const uint16_t *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
static inline void unpack_q4(const group_q4 *b, int8x16_t *u) {
    for (int v = 0; v < 4; v++) {
        const uint8x16_t raw = vld1q_u8(b->qs[v]);
        u[v] = vreinterpretq_s8_u8(vandq_u8(raw, vdupq_n_u8(0x0F)));
        u[v + 4] = vreinterpretq_s8_u8(vshrq_n_u8(raw, 4));
    }
}
static inline void unpack_q8(const group_q8 *b, int8x16_t *u) {
    for (int c = 0; c < 8; c++) u[c] = vld1q_s8((const int8_t *)b->qs[c]);
}
#define M_Q4(b, dw) load_f16x4((b)->m)
#define M_Q8(b, dw) vdupq_n_f32(0.0f)
#define DEFINE_GROUP(NAME, GROUP, MR, UNPACK, DOT, M_OF)                                                   \
    static void NAME(const void *wp, const block_q8a *const *x, int64_t nb, float *out) {                \
        const GROUP *w = (const GROUP *)wp;                                                              \
        float32x4_t acc[MR];                                                                             \
        for (int i = 0; i < MR; i++) acc[i] = vdupq_n_f32(0.0f);                                         \
        for (int64_t kb = 0; kb < nb; kb++) {                                                            \
            const GROUP *b = w + kb;                                                                     \
            const float32x4_t dw = load_f16x4(b->d), mw = M_OF(b, dw);                                   \
            int8x16_t u[8];                                                                              \
            UNPACK(b, u);                                                                                \
            for (int i = 0; i < MR; i++) {                                                               \
                const block_q8a *xb = x[i] + kb;                                                         \
                const float32x4_t dot = vcvtq_f32_s32(DOT(u, xb->qs));                                   \
                acc[i] = vfmaq_f32(acc[i], dot, vmulq_n_f32(dw, xb->d));                                 \
                acc[i] = vfmaq_n_f32(acc[i], mw, xb->s);                                                 \
            }                                                                                            \
        }                                                                                                \
        for (int i = 0; i < MR; i++) vst1q_f32(out + i * RG, acc[i]);                                    \
    }
#define dot_q4 dot_codes
#define dot_q8 dot_codes

#else /* portable scalar: the same layout, plain loops */
static inline void unpack_q4(const group_q4 *b, int16_t (*u)[QK]) {
    for (int r = 0; r < RG; r++)
        for (int v = 0; v < 4; v++)
            for (int j = 0; j < 4; j++) {
                u[r][4 * v + j] = b->qs[v][4 * r + j] & 0x0F;
                u[r][16 + 4 * v + j] = b->qs[v][4 * r + j] >> 4;
            }
}
static inline void unpack_q8(const group_q8 *b, int16_t (*u)[QK]) {
    for (int r = 0; r < RG; r++)
        for (int c = 0; c < 8; c++)
            for (int j = 0; j < 4; j++) u[r][4 * c + j] = (int8_t)b->qs[c][4 * r + j];
}
#define M_Q4(b, r) f16_to_f32((b)->m[r])
#define M_Q8(b, r) 0.0f
#define DEFINE_GROUP(NAME, GROUP, MR, UNPACK, DOT, M_OF)                                                   \
    static void NAME(const void *wp, const block_q8a *const *x, int64_t nb, float *out) {                \
        const GROUP *w = (const GROUP *)wp;                                                              \
        float acc[MR][RG] = {{0.0f}};                                                                    \
        for (int64_t kb = 0; kb < nb; kb++) {                                                            \
            const GROUP *b = w + kb;                                                                     \
            int16_t u[RG][QK];                                                                           \
            UNPACK(b, u);                                                                                \
            for (int r = 0; r < RG; r++) {                                                               \
                const float dw = f16_to_f32(b->d[r]), mw = M_OF(b, r);                                   \
                for (int i = 0; i < MR; i++) {                                                           \
                    const block_q8a *xb = x[i] + kb;                                                     \
                    int32_t dot = 0;                                                                     \
                    for (int t = 0; t < QK; t++) dot += (int32_t)u[r][t] * xb->qs[t];                    \
                    acc[i][r] += dw * xb->d * (float)dot + mw * xb->s;                                   \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        for (int i = 0; i < MR; i++)                                                                     \
            for (int r = 0; r < RG; r++) out[i * RG + r] = acc[i][r];                                    \
    }
#define dot_q4 0
#define dot_q8 0
#endif

typedef void (*group_fn)(const void *, const block_q8a *const *, int64_t, float *);
#define DEFINE_GROUPS(FMT, GROUP)                                                                          \
    DEFINE_GROUP(group_##FMT##_1, GROUP, 1, unpack_##FMT, dot_##FMT, M_##FMT)                            \
    DEFINE_GROUP(group_##FMT##_2, GROUP, 2, unpack_##FMT, dot_##FMT, M_##FMT)                            \
    DEFINE_GROUP(group_##FMT##_3, GROUP, 3, unpack_##FMT, dot_##FMT, M_##FMT)                            \
    DEFINE_GROUP(group_##FMT##_4, GROUP, 4, unpack_##FMT, dot_##FMT, M_##FMT)                            \
    static const group_fn groups_##FMT[4] = {group_##FMT##_1, group_##FMT##_2, group_##FMT##_3, group_##FMT##_4};
#define M_q4 M_Q4
#define M_q8 M_Q8
DEFINE_GROUPS(q4, group_q4)
DEFINE_GROUPS(q8, group_q8)

/* Weight groups per OpenMP task: a task's groups stay in cache while it walks every activation row. */
#define GROUPS_PER_TASK 4

/* Y = Xq . W^T for already-quantized activations and repacked weights; the body of an OpenMP region (call
 * it inside one, or alone for one thread). Y is [M, N] of out_dtype, rows ldy elements apart. */
static void qgemm_body(const void *w, int wtype, int64_t n, int64_t k, const block_q8a *xq, int64_t m, void *y,
                       int out_dtype, int64_t ldy) {
    const int is_q8 = wtype == GGML_Q8_0;
    const group_fn *kernels = is_q8 ? groups_q8 : groups_q4;
    const int64_t nb = k / QK, groups = (n + RG - 1) / RG;
    const int64_t group_bytes = nb * (int64_t)(is_q8 ? sizeof(group_q8) : sizeof(group_q4));
    const int64_t num_tasks = (groups + GROUPS_PER_TASK - 1) / GROUPS_PER_TASK;
#pragma omp for schedule(static)
    for (int64_t task = 0; task < num_tasks; task++) {
        const int64_t g0 = task * GROUPS_PER_TASK;
        const int64_t g1 = g0 + GROUPS_PER_TASK < groups ? g0 + GROUPS_PER_TASK : groups;
        for (int64_t i = 0; i < m; i += 4) {
            const int rows = m - i >= 4 ? 4 : (int)(m - i);
            const block_q8a *x[4];
            for (int r = 0; r < rows; r++) x[r] = xq + (i + r) * nb;
            for (int64_t g = g0; g < g1; g++) {
                float tmp[4 * RG];
                kernels[rows - 1]((const uint8_t *)w + g * group_bytes, x, nb, tmp);
                const int cols = n - g * RG >= RG ? RG : (int)(n - g * RG);
                for (int r = 0; r < rows; r++) {
                    const int64_t base = (i + r) * ldy + g * RG;
                    if (out_dtype == SS_F32)
                        memcpy((float *)y + base, tmp + r * RG, sizeof(float) * (size_t)cols);
                    else
                        for (int c = 0; c < cols; c++) ((uint16_t *)y)[base + c] = f32_to_bf16(tmp[r * RG + c]);
                }
            }
        }
    }
}

#if defined(SS_AMX)
/* ------------------------------------------------------------------- several rows on AMX-INT8 tiles */
/* From AMX_MIN_ROWS activation rows on, each block product runs on AMX tiles: 16 activation rows x 16 weight
 * rows (two repacked groups) per TDPBSUD (signed activation bytes x unsigned weight codes, K = one block of
 * 32). The repacked layout already holds each weight row's codes 4 at a time, which is the tile's VNNI form:
 * B row v is group A's qs[v] beside group B's, low nibbles (weights 4v..4v+3), and row v + 4 their high
 * nibbles (16 + 4v..); Q8_0 codes are byte-for-byte B rows. The same integers as the AVX-512 VNNI path; each
 * block's int32 tile is then scaled in float32 as there (d_w d_x, plus m_w s_x). */

#define AMX_MIN_ROWS 5 /* from here the tiles beat the VNNI kernel (measured: equal at 4, 1.2x at 6, 1.6x at 16) */
#define AMX_AHEAD 2 /* blocks between writing a buffer and reading it */
#define AMX_RING 8  /* more than 2 * AMX_AHEAD: block kb - AMX_AHEAD's scales are read after block kb +
                       * AMX_AHEAD's are written */

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

static inline __m512 amx_f16x16(const uint16_t *a, const uint16_t *b) { /* 8 fp16 from each group */
    const __m128i lo = _mm_loadu_si128((const __m128i *)a);
    const __m128i hi = b != NULL ? _mm_loadu_si128((const __m128i *)b) : _mm_setzero_si128();
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}

/* Block kb of groups ga and gb (gb may be NULL: zero codes) as one B tile of codes, with its 16 scales and
 * offsets. */
static inline void amx_codes(const uint8_t *ga, const uint8_t *gb, int is_q8, int64_t kb, uint8_t codes[8][64],
                             __m512 *dw, __m512 *mw) {
    if (is_q8) {
        const group_q8 *a = (const group_q8 *)ga + kb, *b = gb != NULL ? (const group_q8 *)gb + kb : NULL;
        prefetch_ahead(a, sizeof *a);
        if (b != NULL) prefetch_ahead(b, sizeof *b);
        for (int c = 0; c < 8; c++) {
            const __m256i ra = _mm256_loadu_si256((const __m256i *)a->qs[c]);
            const __m256i rb = b != NULL ? _mm256_loadu_si256((const __m256i *)b->qs[c]) : _mm256_setzero_si256();
            _mm512_store_si512(codes[c], _mm512_inserti64x4(_mm512_castsi256_si512(ra), rb, 1));
        }
        *dw = amx_f16x16(a->d, b != NULL ? b->d : NULL);
        *mw = _mm512_mul_ps(*dw, _mm512_set1_ps(-(float)Q8_OFFSET));
    } else {
        const __m512i low = _mm512_set1_epi8(0x0F);
        const group_q4 *a = (const group_q4 *)ga + kb, *b = gb != NULL ? (const group_q4 *)gb + kb : NULL;
        prefetch_ahead(a, sizeof *a);
        if (b != NULL) prefetch_ahead(b, sizeof *b);
        for (int v = 0; v < 4; v++) {
            const __m256i ra = _mm256_loadu_si256((const __m256i *)a->qs[v]);
            const __m256i rb = b != NULL ? _mm256_loadu_si256((const __m256i *)b->qs[v]) : _mm256_setzero_si256();
            const __m512i raw = _mm512_inserti64x4(_mm512_castsi256_si512(ra), rb, 1);
            _mm512_store_si512(codes[v], _mm512_and_si512(raw, low));
            _mm512_store_si512(codes[v + 4], _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
        }
        *dw = amx_f16x16(a->d, b != NULL ? b->d : NULL);
        *mw = amx_f16x16(a->m, b != NULL ? b->m : NULL);
    }
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
static inline void amx_scale(__m512 *acc, int rows, int32_t dots[16][16], const amx_act *a, __m512 dw, __m512 mw) {
    for (int r = 0; r < rows; r++) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(dots[r]));
        acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, _mm512_set1_ps(a->d[r])), acc[r]);
        acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a->s[r]), acc[r]);
    }
}

/* One block's integer dot products on tile set (C, A, B), stored to dots. */
#define AMX_BLOCK(C, A, B, act, codes, dots) \
    do {                                     \
        _tile_zero(C);                       \
        _tile_loadd(A, (act)->qs, QK);       \
        _tile_loadd(B, codes, 64);           \
        _tile_dpbsud(C, A, B);               \
        _tile_stored(C, dots, 64);           \
    } while (0)

static void amx_qgemm_body(const void *w, int wtype, int64_t n, int64_t k, const amx_act *xa, int64_t m, void *y,
                           int out_dtype, int64_t ldy) {
    const int is_q8 = wtype == GGML_Q8_0;
    const int64_t nb = k / QK, groups = (n + RG - 1) / RG, tiles = (groups + 1) / 2;
    const int64_t group_bytes = nb * (int64_t)(is_q8 ? sizeof(group_q8) : sizeof(group_q4));
    int configured = 0;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *ga = (const uint8_t *)w + 2 * t * group_bytes;
        const uint8_t *gb = 2 * t + 1 < groups ? ga + group_bytes : NULL;
        const int cols = n - 2 * t * RG >= 16 ? 16 : (int)(n - 2 * t * RG);
        for (int64_t i0 = 0; i0 < m; i0 += 16) {
            const int rows = m - i0 >= 16 ? 16 : (int)(m - i0);
            if (rows != configured) amx_configure(configured = rows);
            __m512 acc[16];
            for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
            const amx_act *xb = xa + (i0 / 16) * nb;
            /* A pipeline over blocks: codes are written AHEAD blocks before a tile reads them, and a block's
             * dot products are read AHEAD blocks after a tile wrote them, so that neither waits on the other's
             * stores; consecutive blocks use the two tile sets. */
            _Alignas(64) uint8_t codes[AMX_RING][QK / 4][64];
            _Alignas(64) int32_t dots[AMX_RING][16][16];
            __m512 dw[AMX_RING], mw[AMX_RING];
            for (int64_t j = 0; j < AMX_AHEAD && j < nb; j++) amx_codes(ga, gb, is_q8, j, codes[j], &dw[j], &mw[j]);
            for (int64_t kb = 0; kb < nb; kb++) {
                const int at = (int)(kb % AMX_RING);
                if (kb + AMX_AHEAD < nb) {
                    const int next = (int)((kb + AMX_AHEAD) % AMX_RING);
                    amx_codes(ga, gb, is_q8, kb + AMX_AHEAD, codes[next], &dw[next], &mw[next]);
                }
                if (kb & 1)
                    AMX_BLOCK(3, 4, 5, xb + kb, codes[at], dots[at]);
                else
                    AMX_BLOCK(0, 1, 2, xb + kb, codes[at], dots[at]);
                if (kb >= AMX_AHEAD) {
                    const int old = (int)((kb - AMX_AHEAD) % AMX_RING);
                    amx_scale(acc, rows, dots[old], xb + kb - AMX_AHEAD, dw[old], mw[old]);
                }
            }
            for (int64_t kb = nb > AMX_AHEAD ? nb - AMX_AHEAD : 0; kb < nb; kb++) {
                const int old = (int)(kb % AMX_RING);
                amx_scale(acc, rows, dots[old], xb + kb, dw[old], mw[old]);
            }
            const __mmask16 keep = (__mmask16)((1u << cols) - 1);
            for (int r = 0; r < rows; r++) {
                const int64_t base = (i0 + r) * ldy + 2 * t * RG;
                if (out_dtype == SS_F32)
                    _mm512_mask_storeu_ps((float *)y + base, keep, acc[r]);
                else
                    _mm256_mask_storeu_epi16((uint16_t *)y + base, keep, (__m256i)_mm512_cvtneps_pbh(acc[r]));
            }
        }
    }
    if (configured) _tile_release();
}
#endif

/* Y[M, N] (out_dtype, rows ldy apart) = X[M, K] (x_dtype, rows x_stride apart) . W[N, K]^T with W repacked by
 * ss_repack, K a multiple of 32. scratch holds M * K/32 activation blocks (ss_act_block_bytes each), or is
 * NULL to allocate. Returns 0, or -1 for an unknown weight type, a K not a multiple of 32 or no memory. */
int ss_quant_matmul(const void *x, int x_dtype, int64_t x_stride, int64_t m, int64_t k, const void *w, int wtype,
                    int64_t n, void *y, int out_dtype, int64_t ldy, void *scratch, int num_threads) {
    if (ss_packed_bytes(wtype, n, k) < 0) return -1;
    block_q8a *xq = scratch != NULL ? (block_q8a *)scratch : malloc(sizeof(block_q8a) * (size_t)(m * (k / QK)));
    if (xq == NULL) return -1;
    quantize_rows(x, x_dtype, x_stride, m, k, xq, num_threads);
    const int threads = m * n * k >= (1 << 16) ? num_threads : 1;
#if defined(SS_AMX)
    amx_act *xa = m >= AMX_MIN_ROWS && ss_amx_permitted()
                      ? aligned_alloc(64, sizeof(amx_act) * (size_t)((m + 15) / 16 * (k / QK)))
                      : NULL;
    if (xa != NULL) {
        amx_activations(xq, m, k / QK, xa);
#pragma omp parallel num_threads(threads)
        amx_qgemm_body(w, wtype, n, k, xa, m, y, out_dtype, ldy);
        free(xa);
        if (scratch == NULL) free(xq);
        return 0;
    }
#endif
#pragma omp parallel num_threads(threads)
    qgemm_body(w, wtype, n, k, xq, m, y, out_dtype, ldy);
    if (scratch == NULL) free(xq);
    return 0;
}

/* Dequantize weight rows [n0, n1) to float32 [n1 - n0, K] (tests and the PyTorch reference). */
int ss_dequantize_rows(const void *w, int wtype, int64_t k, int64_t n0, int64_t n1, float *out) {
    const int64_t nb = k / QK, row_bytes = ss_quant_row_bytes(wtype, k);
    if (row_bytes < 0 || k % QK != 0) return -1;
    for (int64_t r = n0; r < n1; r++) {
        const uint8_t *row = (const uint8_t *)w + r * row_bytes;
        float *o = out + (r - n0) * k;
        for (int64_t b = 0; b < nb; b++) {
            if (wtype == GGML_Q8_0) {
                const block_q8_0 *blk = (const block_q8_0 *)row + b;
                for (int j = 0; j < QK; j++) o[b * QK + j] = f16_to_f32(blk->d) * blk->qs[j];
                continue;
            }
            const uint8_t *qs;
            float d, mn;
            if (wtype == GGML_Q4_0) {
                const block_q4_0 *blk = (const block_q4_0 *)row + b;
                qs = blk->qs, d = f16_to_f32(blk->d), mn = -8.0f * d;
            } else {
                const block_q4_1 *blk = (const block_q4_1 *)row + b;
                qs = blk->qs, d = f16_to_f32(blk->d), mn = f16_to_f32(blk->m);
            }
            for (int j = 0; j < QK / 2; j++) {
                o[b * QK + j] = d * (float)(qs[j] & 0x0F) + mn;
                o[b * QK + j + QK / 2] = d * (float)(qs[j] >> 4) + mn;
            }
        }
    }
    return 0;
}

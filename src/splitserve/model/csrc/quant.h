/*
 * The quantized matmul's formats, shared by its generic part (quant_matmul.c: quantizing activations, repacking
 * weights, the tiling and the dispatch) and its per-architecture kernels (arch/x86/quant.c, arch/arm/quant.c,
 * arch/scalar/quant.c, amx/quant_matmul.c), the layout ggml-cpu has: one generic file, one file per
 * architecture. Every build compiles every file; each architecture's file holds code only for its own level,
 * so exactly one of arch/ defines group_kernel; quantize_block is x86's (arch/x86/quant.c) or else the
 * portable one in quant_matmul.c.
 *
 * The hooks are internal to the library (hidden: only the ss_ functions of ss_kernels.h are exported).
 */
#ifndef SS_QUANT_H
#define SS_QUANT_H

#include "common.h"

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

/* ------------------------------------------------------------------------- the repacked layout */
/* At load, weights are repacked into groups of RG rows interleaved 4 weights at a time, so one vector holds 4
 * consecutive weights of each of the RG rows. An integer dot product against 4 activation bytes broadcast to
 * every lane then gives RG rows' partial sums in RG lanes: no horizontal sums, and the per-block scales are
 * one vector operation for RG rows (llama.cpp's repacked q4_0_8x8 kernels work the same way). */
#if defined(SS_NEON)
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

#define SS_HIDDEN __attribute__((visibility("hidden")))

/* ------------------------------------------------------------------ what each architecture provides */
/* 32 floats to one activation block (round to nearest, d = max |x| / 127). */
SS_HIDDEN void quantize_block(const float *x, block_q8a *y);
/* out[i * RG + r] = sum over the nb blocks of activation row x[i] . weight row r of the group w (a group_q8
 * when is_q8, else a group_q4), for i < rows (1 to 4). */
SS_HIDDEN void group_kernel(const void *w, int is_q8, const block_q8a *const *x, int rows, int64_t nb, float *out);

#if defined(SS_AMX)
#define AMX_MIN_ROWS 5 /* from here the tiles beat the VNNI kernel (measured: equal at 4, 1.2x at 6, 1.6x at 16) */
/* Y = Xq . W^T on AMX tiles for m >= AMX_MIN_ROWS (amx/quant_matmul.c). Returns 0, or -1 where the tiles are
 * not permitted or memory runs out (the caller then uses the group kernels). */
SS_HIDDEN int amx_quant_matmul(const block_q8a *xq, int64_t m, int64_t k, const void *w, int wtype, int64_t n,
                               void *y, int out_dtype, int64_t ldy, int threads);
#endif

#if defined(SS_AVX512)
/* Two repacked groups side by side in one 512-bit vector, for the kernels that take 16 weight rows at once (the
 * AMX tiles, the 512-bit VNNI tiles); b NULL (past the last group): zeros. */
static inline __m512i join_groups(const uint8_t *a, const uint8_t *b) { /* 32 bytes of each group */
    const __m256i lo = _mm256_loadu_si256((const __m256i *)a);
    const __m256i hi = b != NULL ? _mm256_loadu_si256((const __m256i *)b) : _mm256_setzero_si256();
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
static inline __m512 join_groups_f16(const uint16_t *a, const uint16_t *b) { /* RG fp16 of each group, as floats */
    const __m128i lo = _mm_loadu_si128((const __m128i *)a);
    const __m128i hi = b != NULL ? _mm_loadu_si128((const __m128i *)b) : _mm_setzero_si128();
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}
#endif

#if defined(SS_AVX512) && defined(SS_VNNI) && !defined(SS_AVXVNNI)
#define SS_WIDE 1
#define WIDE_MIN_ROWS 5
/* Y = Xq . W^T in 512-bit VNNI tiles for m >= WIDE_MIN_ROWS (arch/x86/quant_avx512.c): the group kernels' bits.
 * Returns 0, or -1 where memory runs out (the caller then uses the group kernels). */
SS_HIDDEN int wide_quant_matmul(const block_q8a *xq, int64_t m, int64_t k, const void *w, int wtype, int64_t n,
                                void *y, int out_dtype, int64_t ldy, int threads);
#endif

#if defined(SS_AVX2)
/* Each kernel asks for the weight block PREFETCH_AHEAD blocks past the one it reads (2.5 KB ahead for Q4_1,
 * 4.3 KB for Q8_0). The hardware prefetcher alone left a single-stream step's 96 MB of weights streaming at
 * 16-17 GB/s on an AMX VM whose L3 share held none of them; with 16 blocks ahead, 20-31 GB/s (4 rows:
 * 12.5-13.3 -> 7.3-8.0 ms for every matrix of the model once; 8 and 32 ahead were slower). */
#define PREFETCH_AHEAD 16
static inline void prefetch_ahead(const void *block, size_t bytes) {
    const char *p = (const char *)block + PREFETCH_AHEAD * bytes;
    for (size_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
}
#endif

#endif

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

enum {
    GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8,
    GGML_Q2_K = 10, GGML_Q3_K = 11, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14, GGML_IQ4_NL = 20, GGML_IQ4_XS = 23,
};
#define QK 32
#define QK_K 256 /* a K-quant super-block: 8 blocks of 32 */

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
    uint8_t qh[4]; /* bit j of the little-endian word: bit 4 of weight j */
    uint8_t qs[QK / 2];
} block_q5_0;
typedef struct {
    uint16_t d, m;
    uint8_t qh[4];
    uint8_t qs[QK / 2];
} block_q5_1;
typedef struct {
    uint16_t d;
    int8_t qs[QK];
} block_q8_0;
typedef struct { /* IQ4_NL: 4-bit indices into a fixed table of 16 signed 8-bit values (ggml's kvalues_iq4nl) */
    uint16_t d;
    uint8_t qs[QK / 2]; /* as block_q4_0's */
} block_iq4_nl;
/* ggml's kvalues_iq4nl: the values IQ4_NL's and IQ4_XS's 4-bit indices name */
#define IQ4_VALUES -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113
typedef struct { /* IQ4_XS: 8 blocks of 32 IQ4_NL indices, each block's 6-bit scale ls (d (ls - 32)) */
    uint16_t d;
    uint16_t scales_h; /* bits 2 b, 2 b + 1: bits 4, 5 of block b's ls */
    uint8_t scales_l[QK_K / 64]; /* block b's low 4 bits: nibble b % 2 of byte b / 2 */
    uint8_t qs[QK_K / 2];        /* block b: 16 bytes as block_iq4_nl's qs */
} block_iq4_xs;
/* llama.cpp's K-quant super-blocks (ggml-common.h): 256 weights, 8 blocks of 32 with 6-bit scales and mins
 * (Q4_K, Q5_K), 16 of 16 with 8-bit scales (Q6_K) or 4-bit scales and mins (Q2_K). */
typedef struct {
    uint8_t scales[QK_K / 16]; /* half block h: its scale in the low nibble, its min in the high one */
    uint8_t qs[QK_K / 4];      /* weight 128 n + 32 j + l: bits 2 j of byte 32 n + l */
    uint16_t d, dmin;
} block_q2_K;
typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qs[QK_K / 2];
} block_q4_K;
typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[QK_K / 8];
    uint8_t qs[QK_K / 2];
} block_q5_K;
typedef struct {
    uint8_t hmask[QK_K / 8]; /* bit 4 of a weight's code, as a mask: clear means 4 below its 2 low bits */
    uint8_t qs[QK_K / 4];
    uint8_t scales[12]; /* 16 6-bit scales, stored + 32 */
    uint16_t d;
} block_q3_K;
typedef struct {
    uint8_t ql[QK_K / 2];
    uint8_t qh[QK_K / 4];
    int8_t scales[QK_K / 16];
    uint16_t d;
} block_q6_K;
/* An activation block: x_k ~ d * qs[k], s = d * sum(qs), h[i] = the sum of qs over weights 16 i .. 16 i + 15
 * (for Q6_K, whose scales change every 16 weights). */
typedef struct {
    float d, s;
    int16_t h[2];
    int8_t qs[QK];
} block_q8a;

/* ------------------------------------------------------------------------- the repacked layout */
/* At load, weights are repacked into groups of RG rows interleaved 4 weights at a time, so one vector holds 4
 * consecutive weights of each of the RG rows. An integer dot product against 4 activation bytes broadcast to
 * every lane then gives RG rows' partial sums in RG lanes: no horizontal sums, and the per-block scales are
 * one vector operation for RG rows (llama.cpp's repacked q4_0_8x8 kernels work the same way).
 *
 * Every format becomes unsigned codes u (what the dot-product instructions multiply) with, per block of 32 and
 * row, a float scale d_w and offset m_w such that w = d_w u + m_w: Q4_0 (u = q, m_w = -8 d), Q4_1 (its min),
 * Q5_0/Q5_1 (5-bit u: a fifth bit beside the nibbles), Q8_0 (as stored, or + Q8_OFFSET), Q4_K/Q5_K (d_w = d sc
 * and m_w = -dmin mn, products exact in float32: an fp16 times a 6-bit integer). Q6_K's scales change every 16
 * weights, so its rows keep integer scales per half block: w = d sc_h (u - 32), summed in integers (d sc_0 (D_0
 * - 32 h_0) + ...) before the one float scale d. Q3_K (w = d (sc - 32) (q - 4) per 16 weights, q 3 bits) is the same
 * sum: it repacks into Q6_K's groups with u = q + 28 and scales sc - 32, without loss. Q2_K (w = d sc_h q - dmin mn_h
 * per 16 weights, q 2 bits) sums the same way and adds its mins against the activations' half sums: d (sc_0 D_0 +
 * sc_1 D_1) - dmin (mn_0 h_0 + mn_1 h_1), both in integers. The K formats keep a super-block's scales as the file
 * does (one fp16 d per 256 weights and small integers per block), so their groups are as compact as the file.
 * IQ4_NL keeps its 4-bit indices and d, IQ4_XS its indices, d and each block's scale ls - 32 (d_w = d (ls - 32),
 * exact in float32); the kernels turn indices into the table's values (+ Q8_OFFSET) with one byte shuffle and
 * multiply them as Q8_0's codes. */
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

/* The kernels' formats: each GGML type's repacked group (format_of maps one to the other). */
enum { FMT_Q4, FMT_Q5, FMT_Q8, FMT_IQ4, FMT_Q4K, FMT_Q5K, FMT_Q6K, FMT_Q2K, FMT_IQ4K };

typedef struct {
    uint16_t d[RG], m[RG];  /* fp16 scale and offset of each row's block: w = d u + m, u in 0..15 */
    uint8_t qs[4][RG * 4]; /* qs[v][4 r + j]: low nibble u of weight 4 v + j of row r, high nibble weight 16 + 4 v + j */
} group_q4;
typedef struct {
    uint16_t d[RG], m[RG];
    uint8_t qh[RG * 4];    /* bit c of byte 4 r + j: bit 4 of weight 4 c + j of row r */
    uint8_t qs[4][RG * 4]; /* as group_q4's */
} group_q5;
typedef struct {
    uint16_t d[RG];
    uint8_t qs[8][RG * 4]; /* qs[c][4 r + j]: weight 4 c + j of row r, as a byte (+ Q8_OFFSET) */
} group_q8;
typedef struct {
    uint16_t d[RG];
    uint8_t qs[4][RG * 4]; /* IQ4_NL: the table's indices, as group_q4's qs */
} group_iq4;
/* The K formats: one group per super-block, its 8 blocks' codes laid out as group_q4's and group_q5's. */
typedef struct {
    uint16_t d[RG], dmin[RG];      /* fp16, per row */
    uint8_t sc[8][RG], mn[8][RG];  /* block b of row r: d_w = d sc[b][r], m_w = -dmin mn[b][r] */
    uint8_t qs[8][4][RG * 4];
} group_q4k;
typedef struct {
    uint16_t d[RG], dmin[RG];
    uint8_t sc[8][RG], mn[8][RG];
    uint8_t qh[8][RG * 4];
    uint8_t qs[8][4][RG * 4];
} group_q5k;
typedef struct {
    uint16_t d[RG];
    int8_t sc[16][RG];        /* half block h (weights 16 h .. 16 h + 15 of the super-block) of row r */
    uint8_t qh[8][2][RG * 4]; /* block b, byte 4 r + j of qh[b][p]: bits 2 i, 2 i + 1 = bits 4, 5 of weight
                                 4 (4 p + i) + j */
    uint8_t ql[8][4][RG * 4]; /* the low 4 bits, as group_q4's qs */
} group_q6k;
typedef struct {
    uint16_t d[RG], dmin[RG];
    uint8_t sc[16][RG];       /* half block h of row r: its scale in the low nibble, its min in the high one */
    uint8_t qs[8][2][RG * 4]; /* block b, byte 4 r + j of qs[b][p]: bits 2 i, 2 i + 1 = weight 4 (4 p + i) + j (as
                                 group_q6k's qh) */
} group_q2k;
typedef struct {
    uint16_t d[RG];
    int8_t sc[8][RG];         /* block b of row r: d_w = d sc[b][r] */
    uint8_t qs[8][4][RG * 4]; /* block b: the table's indices, as group_q4's qs */
} group_iq4k;
/* The table's values as the kernels multiply them (Q8_0's codes). */
static const int8_t IQ4_CODES[16] = {
#if Q8_OFFSET
#define IQ4_CODE(v) (int8_t)((v) + Q8_OFFSET - 256 * ((v) + Q8_OFFSET > 127))
#else
#define IQ4_CODE(v) (int8_t)(v)
#endif
    IQ4_CODE(-127), IQ4_CODE(-104), IQ4_CODE(-83), IQ4_CODE(-65), IQ4_CODE(-49), IQ4_CODE(-35), IQ4_CODE(-22),
    IQ4_CODE(-10), IQ4_CODE(1), IQ4_CODE(13), IQ4_CODE(25), IQ4_CODE(38), IQ4_CODE(53), IQ4_CODE(69),
    IQ4_CODE(89), IQ4_CODE(113)};
#undef IQ4_CODE

/* The kernel format of a GGML type, or -1. */
static inline int format_of(int wtype) {
    switch (wtype) {
        case GGML_Q4_0:
        case GGML_Q4_1: return FMT_Q4;
        case GGML_Q5_0:
        case GGML_Q5_1: return FMT_Q5;
        case GGML_Q8_0: return FMT_Q8;
        case GGML_IQ4_NL: return FMT_IQ4;
        case GGML_Q4_K: return FMT_Q4K;
        case GGML_Q5_K: return FMT_Q5K;
        case GGML_Q3_K:
        case GGML_Q6_K: return FMT_Q6K;
        case GGML_Q2_K: return FMT_Q2K;
        case GGML_IQ4_XS: return FMT_IQ4K;
        default: return -1;
    }
}
static inline int is_k_format(int fmt) { return fmt >= FMT_Q4K; }
/* A format whose scales change every 16 weights, summed per half block in integers (Q6_K, Q2_K). */
static inline int is_half_format(int fmt) { return fmt == FMT_Q6K || fmt == FMT_Q2K; }
/* A format whose codes are signed weights (+ Q8_OFFSET), as Q8_0's. */
static inline int has_q8_codes(int fmt) { return fmt == FMT_Q8 || fmt == FMT_IQ4 || fmt == FMT_IQ4K; }
/* Bytes of one group's blocks kb .. kb + 7 (K formats) or block kb (the others). */
static inline size_t format_unit_bytes(int fmt) {
    static const size_t bytes[] = {sizeof(group_q4), sizeof(group_q5), sizeof(group_q8), sizeof(group_iq4),
                                   sizeof(group_q4k), sizeof(group_q5k), sizeof(group_q6k), sizeof(group_q2k),
                                   sizeof(group_iq4k)};
    return bytes[fmt];
}
/* Bytes of one group of RG rows over nb blocks. */
static inline int64_t group_bytes_of(int fmt, int64_t nb) {
    return (is_k_format(fmt) ? nb / 8 : nb) * (int64_t)format_unit_bytes(fmt);
}

#define SS_HIDDEN __attribute__((visibility("hidden")))

/* An activation block's half sums (block_q8a.h), from its codes. */
static inline void half_sums(block_q8a *y) {
    int a = 0, b = 0;
    for (int k = 0; k < QK / 2; k++) a += y->qs[k], b += y->qs[k + QK / 2];
    y->h[0] = (int16_t)a, y->h[1] = (int16_t)b;
}

/* ------------------------------------------------------------------ what each architecture provides */
/* 32 floats to one activation block (round to nearest, d = max |x| / 127), with its sums. */
SS_HIDDEN void quantize_block(const float *x, block_q8a *y);
/* out[i * RG + r] = sum over the nb blocks of activation row x[i] . weight row r of the group w (of format fmt),
 * for i < rows (1 to 4). */
SS_HIDDEN void group_kernel(const void *w, int fmt, const block_q8a *const *x, int rows, int64_t nb, float *out);

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

/* Two groups' scales for a K format's block: d (fp16 per row) times a byte per row (b NULL: zeros), as floats;
 * negated bytes where `negate` (the offsets -dmin mn). The products are exact, as the 256-bit kernels' are. */
static inline __m512 join_scaled(const uint16_t *da, const uint16_t *db, const uint8_t *sa, const uint8_t *sb,
                                 int negate) {
    const __m128i lo = _mm_loadl_epi64((const __m128i *)sa);
    const __m128i bytes = _mm_unpacklo_epi64(lo, sb != NULL ? _mm_loadl_epi64((const __m128i *)sb) : _mm_setzero_si128());
    __m512i ints = _mm512_cvtepu8_epi32(bytes);
    if (negate) ints = _mm512_sub_epi32(_mm512_setzero_si512(), ints);
    return _mm512_mul_ps(join_groups_f16(da, db), _mm512_cvtepi32_ps(ints));
}

/* Block kb of groups ga and gb (gb NULL past the last group: zero codes and scales) for 16 weight rows, any format
 * but Q6_K and Q2_K: the codes as dpbusd and the AMX tiles read them (8 vectors of 4 codes per row), the scales d_w and the
 * offsets m_w. The AVX-512 VNNI tiles and the AMX tiles both take their blocks from here. */
static inline void unpack16(const uint8_t *ga, const uint8_t *gb, const int fmt, int64_t kb, __m512i *u, __m512 *dw,
                            __m512 *mw) {
    const __m512i low = _mm512_set1_epi8(0x0F), one = _mm512_set1_epi8(1);
    const uint8_t(*qa)[RG * 4] = NULL, (*qb)[RG * 4] = NULL; /* nibbles */
    const uint8_t *ha = NULL, *hb = NULL;                    /* fifth bits */
    const int j = (int)(kb & 7);
    switch (fmt) {
        case FMT_Q8: {
            const group_q8 *a = (const group_q8 *)ga + kb, *b = gb != NULL ? (const group_q8 *)gb + kb : NULL;
            for (int c = 0; c < 8; c++) u[c] = join_groups(a->qs[c], b != NULL ? b->qs[c] : NULL);
            *dw = join_groups_f16(a->d, b != NULL ? b->d : NULL);
            *mw = _mm512_mul_ps(*dw, _mm512_set1_ps(-(float)Q8_OFFSET));
            return;
        }
        case FMT_Q4:
        case FMT_Q5: {
            const group_q4 *a4 = (const group_q4 *)ga + kb, *b4 = gb != NULL ? (const group_q4 *)gb + kb : NULL;
            const group_q5 *a5 = (const group_q5 *)ga + kb, *b5 = gb != NULL ? (const group_q5 *)gb + kb : NULL;
            const uint16_t *d_a = fmt == FMT_Q4 ? a4->d : a5->d, *m_a = fmt == FMT_Q4 ? a4->m : a5->m;
            const uint16_t *d_b = gb == NULL ? NULL : fmt == FMT_Q4 ? b4->d : b5->d;
            const uint16_t *m_b = gb == NULL ? NULL : fmt == FMT_Q4 ? b4->m : b5->m;
            *dw = join_groups_f16(d_a, d_b), *mw = join_groups_f16(m_a, m_b);
            qa = fmt == FMT_Q4 ? a4->qs : a5->qs;
            qb = gb == NULL ? NULL : fmt == FMT_Q4 ? b4->qs : b5->qs;
            if (fmt == FMT_Q5) ha = a5->qh, hb = gb != NULL ? b5->qh : NULL;
            break;
        }
        case FMT_Q4K: {
            const group_q4k *a = (const group_q4k *)ga + kb / 8, *b = gb != NULL ? (const group_q4k *)gb + kb / 8 : NULL;
            *dw = join_scaled(a->d, b != NULL ? b->d : NULL, a->sc[j], b != NULL ? b->sc[j] : NULL, 0);
            *mw = join_scaled(a->dmin, b != NULL ? b->dmin : NULL, a->mn[j], b != NULL ? b->mn[j] : NULL, 1);
            qa = a->qs[j], qb = b != NULL ? b->qs[j] : NULL;
            break;
        }
        case FMT_IQ4:
        case FMT_IQ4K: {
            if (fmt == FMT_IQ4) {
                const group_iq4 *a = (const group_iq4 *)ga + kb, *b = gb != NULL ? (const group_iq4 *)gb + kb : NULL;
                *dw = join_groups_f16(a->d, b != NULL ? b->d : NULL);
                qa = a->qs, qb = b != NULL ? b->qs : NULL;
            } else {
                const group_iq4k *a = (const group_iq4k *)ga + kb / 8, *b = gb != NULL ? (const group_iq4k *)gb + kb / 8 : NULL;
                const __m128i lo = _mm_loadl_epi64((const __m128i *)a->sc[j]);
                const __m128i sc = _mm_unpacklo_epi64(lo, b != NULL ? _mm_loadl_epi64((const __m128i *)b->sc[j]) : _mm_setzero_si128());
                *dw = _mm512_mul_ps(join_groups_f16(a->d, b != NULL ? b->d : NULL), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
                qa = a->qs[j], qb = b != NULL ? b->qs[j] : NULL;
            }
            *mw = _mm512_mul_ps(*dw, _mm512_set1_ps(-(float)Q8_OFFSET));
            const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)IQ4_CODES));
            for (int v = 0; v < 4; v++) {
                const __m512i raw = join_groups(qa[v], qb != NULL ? qb[v] : NULL);
                u[v] = _mm512_shuffle_epi8(table, _mm512_and_si512(raw, low));
                u[v + 4] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
            }
            return;
        }
        default: { /* FMT_Q5K */
            const group_q5k *a = (const group_q5k *)ga + kb / 8, *b = gb != NULL ? (const group_q5k *)gb + kb / 8 : NULL;
            *dw = join_scaled(a->d, b != NULL ? b->d : NULL, a->sc[j], b != NULL ? b->sc[j] : NULL, 0);
            *mw = join_scaled(a->dmin, b != NULL ? b->dmin : NULL, a->mn[j], b != NULL ? b->mn[j] : NULL, 1);
            qa = a->qs[j], qb = b != NULL ? b->qs[j] : NULL;
            ha = a->qh[j], hb = b != NULL ? b->qh[j] : NULL;
            break;
        }
    }
    for (int v = 0; v < 4; v++) {
        const __m512i raw = join_groups(qa[v], qb != NULL ? qb[v] : NULL);
        u[v] = _mm512_and_si512(raw, low);
        u[v + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
    if (ha != NULL) {
        const __m512i h = join_groups(ha, hb);
        for (int c = 0; c < 8; c++)
            u[c] = _mm512_or_si512(u[c], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, c), one), 4));
    }
}
#endif

#if defined(SS_AVX512) && defined(SS_VNNI) && !defined(SS_AVXVNNI)
#define SS_WIDE 1
#define WIDE_MIN_ROWS 5
/* Y = Xq . W^T in 512-bit VNNI tiles for m >= WIDE_MIN_ROWS (arch/x86/quant_avx512.c): the group kernels' bits.
 * Returns 0, or -1 where memory runs out (the caller then uses the group kernels). */
SS_HIDDEN int wide_quant_matmul(const block_q8a *xq, int64_t m, int64_t k, const void *w, int wtype, int64_t n,
                                void *y, int out_dtype, int64_t ldy, int threads);
#if defined(SS_AMX)
/* Y = Xq . W^T for 1 to 4 activation rows (a decode step's), 16 weight rows per 512-bit vector straight from the
 * groups (arch/x86/quant_avx512.c; the amx build's only). Returns 0, or -1 for more rows. */
SS_HIDDEN int stream_quant_matmul(const block_q8a *xq, int64_t m, int64_t k, const void *w, int wtype, int64_t n,
                                  void *y, int out_dtype, int64_t ldy, int threads);
#endif
#endif

#if defined(SS_AVX2)
/* Each kernel asks for the weight block PREFETCH_AHEAD blocks past the one it reads (2.5 KB ahead for Q4_1,
 * 4.3 KB for Q8_0). The hardware prefetcher alone left a single-stream step's 96 MB of weights streaming at
 * 16-17 GB/s on an AMX VM whose L3 share held none of them; with 16 blocks ahead, 20-31 GB/s (4 rows:
 * 12.5-13.3 -> 7.3-8.0 ms for every matrix of the model once; 8 and 32 ahead were slower). A K format's group
 * holds 8 blocks at once: its kernels ask for the one 2 groups ahead, an eighth at each block (prefetch_k_unit;
 * 1 and 4 groups ahead were no faster). */
#define PREFETCH_AHEAD 16
static inline void prefetch_ahead_bytes(const void *block, size_t bytes, size_t ahead) {
    const char *p = (const char *)block + ahead;
    for (size_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
}
static inline void prefetch_ahead(const void *block, size_t bytes) {
    prefetch_ahead_bytes(block, bytes, PREFETCH_AHEAD * bytes);
}
/* A K format's group of 8 blocks (its unit, `bytes` long), read at block kb: each block asks for an eighth of the
 * unit 2 ahead. */
static inline void prefetch_k_unit(const void *unit, size_t bytes, int64_t kb) {
    const size_t part = (bytes / 8 + 63) & ~(size_t)63, at = (size_t)(kb & 7) * part;
    if (at < bytes) prefetch_ahead_bytes((const char *)unit + at, part, 2 * bytes);
}
#endif

#endif

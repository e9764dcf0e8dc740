/*
 * What every kernel source shares: scalar conversions between float32 and the 16-bit storage formats, and
 * the instruction-set switches. Each source is compiled once per instruction-set level (kernel_build.py:
 * scalar, avx2, avxvnni, avx512, amx on x86; scalar, neon, neon-dotprod on ARM), so every path below is chosen
 * by the compiler's own macros.
 */
#ifndef SPLITSERVE_COMMON_H
#define SPLITSERVE_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if !defined(SS_SCALAR) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SS_AVX2 1
#include <immintrin.h>
#endif
#if defined(SS_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SS_AVX512 1
#endif
#if defined(SS_AVX512) && defined(__AVX512VNNI__)
#define SS_VNNI 1 /* dpbusd on 256-bit vectors through AVX-512 VL */
#elif defined(SS_AVX2) && defined(__AVXVNNI__)
#define SS_VNNI 1
#define SS_AVXVNNI 1 /* the VEX-encoded dpbusd (Alder Lake and later, without AVX-512) */
#endif
#if defined(SS_AVX512) && defined(__AVX512BF16__)
#define SS_BF16_DOT 1 /* dpbf16: attention scores from bfloat16 pairs (cpu_kernels.c's pair_scores) */
#endif
#if defined(SS_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && \
    defined(__AVX512BF16__)
#define SS_AMX 1 /* AMX tiles: prefill attention in bf16, quantized matmuls of several rows in int8 */
typedef struct { /* the LDTILECFG operand */
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} ss_tile_config;
/* amx/attention.c: the amx build's paged attention, bfloat16 K/V with head size SS_AMX_HEAD_DIM, for every row
 * of a call (cpu_kernels.c's ss_paged_attention_bf16 hands it over); -1 where it does not apply or memory runs
 * out. */
#define SS_AMX_HEAD_DIM 64
__attribute__((visibility("hidden"))) int amx_paged_attention_bf16(
    const uint16_t *q, int64_t q_row_stride, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *tables,
    int64_t max_blocks, const int64_t *row_seq, const int64_t *lens, uint16_t *out, int num_rows, int num_heads,
    int num_kv_heads, int head_dim, int block_size, float scale, int num_threads);
#endif
#if !defined(SS_SCALAR) && defined(__ARM_NEON)
#define SS_NEON 1
#include <arm_neon.h>
#endif

/* A function whose one compiled body serves every caller: never inlined, cloned or specialised, so that the
 * rows of every step run the same instructions (paged attention's partition and merge). With the build's
 * -ffp-contract=off, no a * b + c is fused in one copy of the code and not in another. */
#if defined(__GNUC__) && !defined(__clang__)
#define SS_ONE_BODY __attribute__((noipa))
#else
#define SS_ONE_BODY __attribute__((noinline))
#endif

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* IEEE half to float: the GGUF block scales. */
static inline float f16_to_f32(uint16_t h) {
#if defined(SS_AVX2)
    return _cvtsh_ss(h);
#elif defined(SS_NEON)
    __fp16 v;
    memcpy(&v, &h, sizeof v);
    return (float)v;
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
    if (exponent == 0x1fu) {
        bits = sign | 0x7f800000u | (mantissa << 13); /* inf, NaN */
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        exponent = 113u;
        while ((mantissa & 0x400u) == 0) {
            mantissa <<= 1;
            exponent--;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* float to IEEE half, rounding to nearest even (repacking scales; not on a hot path). */
static inline uint16_t f32_to_f16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    const uint32_t magnitude = bits & 0x7fffffffu;
    if (magnitude >= 0x7f800000u) return sign | 0x7c00u | (magnitude > 0x7f800000u ? 0x200u : 0u); /* inf, NaN */
    if (magnitude >= 0x477ff000u) return sign | 0x7c00u;                                            /* overflow */
    if (magnitude < 0x38800000u) { /* half subnormal or zero: scale to an integer count of 2^-24 */
        float scaled;
        uint32_t m = magnitude;
        memcpy(&scaled, &m, sizeof scaled);
        return sign | (uint16_t)nearbyintf(scaled * 16777216.0f);
    }
    const uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);
    return sign | (uint16_t)((rounded - 0x38000000u) >> 13);
}

/* Storage dtype codes shared with kernels.py: the KV cache is one of them, q and the attention output the first
 * two (bfloat16 beside an int8 cache). */
enum { SS_F32 = 0, SS_BF16 = 1, SS_INT8 = 2, SS_FP8 = 3 };

/* The int8 KV format (--kv-cache-dtype int8): each (slot, KV head) row is head_dim int8 values followed by one
 * signed exponent byte per group of SS_KV_INT8_GROUP values: value d is q[d] * 2^e[d / 16]. A group's exponent is
 * the smallest (at least -126) with max |x| <= 127 * 2^e, and q = rint(x / 2^e), ties to even, so |q| <= 127 and
 * the division is exact. Each stored value is then exactly a bfloat16 (seven significant bits times a power of
 * two): attention widens a row to bfloat16 without rounding and runs the bfloat16 cache's arithmetic on it, so an
 * int8 cache gives what a bfloat16 cache holding the same values gives. A group of 16 rather than one scale per
 * row: an outlier channel coarsens only its own group (SmolLM2's K: 1.0% relative error against 1.6% with one
 * scale per head of 64, in the same 68 bytes). model/kv_format.py's quantize_rows is the same arithmetic in
 * PyTorch (the tests compare the bytes). head_dim must be a multiple of the group. */
#define SS_KV_INT8_GROUP 16
static inline int64_t kv_int8_row_bytes(int head_dim) { return (int64_t)head_dim + head_dim / SS_KV_INT8_GROUP; }

/* A group's exponent: the least e in [lo, hi] with max |x| <= limit * 2^e (limit in [2^top, 2^(top+1))), 0 for a
 * group of zeros; NaN is left out and inf counts as the largest float. */
static inline int kv_group_exponent(const float *xg, int top, float limit, int lo, int hi) {
    float amax = 0.f;
    for (int d = 0; d < SS_KV_INT8_GROUP; d++) amax = fabsf(xg[d]) > amax ? fabsf(xg[d]) : amax; /* NaN: out */
    if (amax == 0.f) return 0;
    if (amax > 3.0e38f) amax = 3.0e38f;
    int e = ilogbf(amax) - top; /* amax / 2^e in [2^top, 2^(top+1)) */
    if (ldexpf(amax, -e) > limit) e++;
    return e < lo ? lo : e > hi ? hi : e;
}

/* int8 codes of 16 (8 on AVX2) values already divided by their group's scale: rint (ties to even, the default
 * rounding) within [-127, 127], NaN to 0 */
#if defined(SS_AVX512)
static inline __m128i int8_of_16(__m512 y) {
    const __m512 clamped = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));
    const __m512i q = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(y, y, _CMP_ORD_Q), _mm512_cvtps_epi32(clamped));
    return _mm512_cvtepi32_epi8(q);
}
#elif defined(SS_AVX2)
/* the low byte of each 32-bit lane of v, 8 bytes */
static inline __m128i low_bytes_of_8(__m256i v) {
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i b = _mm256_shuffle_epi8(v, pick);
    return _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
}

static inline __m128i int8_of_8(__m256 y) {
    const __m256 clamped = _mm256_min_ps(_mm256_max_ps(y, _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f));
    const __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_ORD_Q));
    return low_bytes_of_8(_mm256_and_si256(ordered, _mm256_cvtps_epi32(clamped)));
}
#endif

static inline float kv_int8_scale(int8_t e) { /* 2^e for e in [-126, 127] */
    const uint32_t bits = (uint32_t)(e + 127) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* A stored int8 row as bfloat16: exact (see above), so the top half of each float32. */
static inline void kv_int8_row_to_bf16(const int8_t *src, int head_dim, uint16_t *dst) {
    const int8_t *e = src + head_dim;
    int d = 0;
#if defined(SS_AVX512)
    for (; d + 16 <= head_dim; d += 16) {
        const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + d))));
        const __m512 v = _mm512_mul_ps(q, _mm512_set1_ps(kv_int8_scale(e[d / SS_KV_INT8_GROUP])));
        _mm256_storeu_si256((__m256i *)(dst + d), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
    }
#elif defined(SS_AVX2)
    for (; d + 8 <= head_dim; d += 8) {
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src + d))));
        const __m256i hi = _mm256_srli_epi32(
            _mm256_castps_si256(_mm256_mul_ps(q, _mm256_set1_ps(kv_int8_scale(e[d / SS_KV_INT8_GROUP])))), 16);
        _mm_storeu_si128((__m128i *)(dst + d), _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)));
    }
#endif
    for (; d < head_dim; d++) {
        const float v = (float)src[d] * kv_int8_scale(e[d / SS_KV_INT8_GROUP]);
        uint32_t bits;
        memcpy(&bits, &v, sizeof bits);
        dst[d] = (uint16_t)(bits >> 16);
    }
}

/* The fp8 KV format (--kv-cache-dtype fp8, vLLM's name; fp8_e4m3 too): the int8 format's row (head_dim bytes, then
 * an exponent byte per 16) with OCP E4M3FN values (1 sign bit, 4 exponent bits biased by 7, 3 mantissa bits; no
 * infinity, 448 the largest). A group's exponent is the least in [-117, 119] with max |x| <= 448 * 2^e, and each
 * value x / 2^e is rounded to E4M3, ties to even (torch's cast), NaN to zero. A stored value is then at most four
 * significant bits times a power of two in [2^-126, 2^127]: exactly a bfloat16, so attention runs on it as on
 * int8 rows. Coarser than int8 (4 significant bits against up to 7) for the same bytes; it is there for vLLM's
 * flag. */
#define SS_KV_FP8_MIN_EXPONENT (-117) /* the least subnormal, 2^-9, times 2^e stays a normal bfloat16 */
#define SS_KV_FP8_MAX_EXPONENT 119    /* 448 times 2^e stays finite */

static inline uint8_t f32_to_e4m3(float y) {
    const uint8_t sign = signbit(y) ? 0x80 : 0;
    const float a = fabsf(y);
    if (a != a) return 0;
    if (a >= 448.f) return sign | 0x7e;
    if (a < 0.015625f) return sign | (uint8_t)nearbyintf(a * 512.f); /* subnormal: q 2^-9, q 8 is 2^-6 (code 8) */
    int exponent = ilogbf(a);                                          /* -6 .. 8 */
    int mantissa = (int)nearbyintf((ldexpf(a, -exponent) - 1.f) * 8.f); /* exact until the rounding */
    if (mantissa == 8) exponent++, mantissa = 0;
    return sign | (uint8_t)(((exponent + 7) << 3) | mantissa);
}

#if defined(SS_AVX512)
/* f32_to_e4m3 for 16 values: below 2^-6, rint(|y| 2^9) is the code (the default rounding: ties to even); above,
 * the float's bits rounded to three mantissa bits, ties to even (add 0x7ffff and the kept last bit, then drop 20
 * bits; a carry moves into the exponent), rebiased from 127 to 7. */
static inline __m128i e4m3_of_16(__m512 y) {
    const __m512i bits = _mm512_castps_si512(y);
    const __m512 a = _mm512_min_ps(_mm512_abs_ps(y), _mm512_set1_ps(448.f));
    const __m512i ab = _mm512_castps_si512(a);
    const __m512i sub = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(512.f)));
    const __m512i rounded = _mm512_add_epi32(
        ab, _mm512_add_epi32(_mm512_set1_epi32(0x7ffff), _mm512_and_si512(_mm512_srli_epi32(ab, 20), _mm512_set1_epi32(1))));
    const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(rounded, 20), _mm512_set1_epi32((127 - 7) << 3));
    __m512i code = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(a, _mm512_set1_ps(0.015625f), _CMP_LT_OQ), normal, sub);
    code = _mm512_or_si512(code, _mm512_srli_epi32(_mm512_and_si512(bits, _mm512_set1_epi32((int)0x80000000u)), 24));
    code = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(y, y, _CMP_ORD_Q), code); /* NaN: 0 */
    return _mm512_cvtepi32_epi8(code);
}
#endif

#if defined(SS_AVX2) && !defined(SS_AVX512)
/* e4m3_of_16's arithmetic for 8 values */
static inline __m128i e4m3_of_8(__m256 y) {
    const __m256i bits = _mm256_castps_si256(y);
    const __m256 a = _mm256_min_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), y), _mm256_set1_ps(448.f));
    const __m256i ab = _mm256_castps_si256(a);
    const __m256i sub = _mm256_cvtps_epi32(_mm256_mul_ps(a, _mm256_set1_ps(512.f)));
    const __m256i rounded = _mm256_add_epi32(
        ab, _mm256_add_epi32(_mm256_set1_epi32(0x7ffff), _mm256_and_si256(_mm256_srli_epi32(ab, 20), _mm256_set1_epi32(1))));
    const __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(rounded, 20), _mm256_set1_epi32((127 - 7) << 3));
    const __m256 small = _mm256_cmp_ps(a, _mm256_set1_ps(0.015625f), _CMP_LT_OQ);
    __m256i code = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(normal), _mm256_castsi256_ps(sub), small));
    code = _mm256_or_si256(code, _mm256_srli_epi32(_mm256_and_si256(bits, _mm256_set1_epi32((int)0x80000000u)), 24));
    code = _mm256_and_si256(code, _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_ORD_Q))); /* NaN: 0 */
    return low_bytes_of_8(code);
}
#endif

static inline int8_t int8_code(float y) { /* int8_of_16's arithmetic for one value */
    y = nearbyintf(y);
    return (int8_t)(y > 127.f ? 127.f : y < -127.f ? -127.f : y == y ? y : 0.f);
}

/* One head's row x[head_dim] into a packed row at dst (SS_INT8 or SS_FP8): each group's exponent, its values'
 * codes, the exponent bytes after the codes. Always inlined with a constant format: one copy per format. */
static inline __attribute__((always_inline)) void kv_store_row(const float *x, int head_dim, uint8_t *dst,
                                                               const int format) {
    const int fp8 = format == SS_FP8;
    for (int g = 0; g < head_dim / SS_KV_INT8_GROUP; g++) {
        const float *xg = x + g * SS_KV_INT8_GROUP;
        uint8_t *q = dst + g * SS_KV_INT8_GROUP;
        const int e = fp8 ? kv_group_exponent(xg, 8, 448.f, SS_KV_FP8_MIN_EXPONENT, SS_KV_FP8_MAX_EXPONENT)
                          : kv_group_exponent(xg, 6, 127.f, -126, 127);
        const float inverse = ldexpf(1.f, -e);
#if defined(SS_AVX512)
        const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(xg), _mm512_set1_ps(inverse));
        _mm_storeu_si128((__m128i *)q, fp8 ? e4m3_of_16(y) : int8_of_16(y));
#elif defined(SS_AVX2)
        for (int h = 0; h < SS_KV_INT8_GROUP; h += 8) {
            const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(xg + h), _mm256_set1_ps(inverse));
            _mm_storel_epi64((__m128i *)(q + h), fp8 ? e4m3_of_8(y) : int8_of_8(y));
        }
#else
        for (int d = 0; d < SS_KV_INT8_GROUP; d++)
            q[d] = fp8 ? f32_to_e4m3(xg[d] * inverse) : (uint8_t)int8_code(xg[d] * inverse);
#endif
        dst[head_dim + g] = (uint8_t)(int8_t)e;
    }
}

/* A stored fp8 row as bfloat16, exactly: an E4M3 value's bfloat16 bits, its exponent raised by the group's (every
 * nonzero E4M3 value, subnormals included, is a normal bfloat16, and the clamp keeps it one). */
static inline uint16_t e4m3_to_bf16_bits(uint8_t c) {
    const int exponent = (c >> 3) & 15, mantissa = c & 7;
    const float v = exponent == 0 ? ldexpf((float)mantissa, -9) : ldexpf((float)(8 + mantissa), exponent - 10);
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    return (uint16_t)((bits >> 16) | (c & 0x80 ? 0x8000u : 0u));
}

static inline void kv_fp8_row_to_bf16(const uint8_t *src, int head_dim, const uint16_t *table, uint16_t *dst) {
    const int8_t *e = (const int8_t *)src + head_dim;
    int d = 0;
#if defined(SS_AVX512)
    /* 32 codes at a time: the table's 128 magnitudes from four registers (vpermi2w picks among 64), the sign
     * bit, then each group's exponent added to the nonzero values' exponent fields */
    const __m512i t0 = _mm512_loadu_si512(table), t1 = _mm512_loadu_si512(table + 32);
    const __m512i t2 = _mm512_loadu_si512(table + 64), t3 = _mm512_loadu_si512(table + 96);
    const __m512i low7 = _mm512_set1_epi16(0x7f), bit6 = _mm512_set1_epi16(0x40), magnitude = _mm512_set1_epi16(0x7fff);
    for (; d + 32 <= head_dim; d += 32) {
        const __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(src + d)));
        const __m512i idx = _mm512_and_si512(c, low7);
        const __m512i lo = _mm512_permutex2var_epi16(t0, idx, t1), hi = _mm512_permutex2var_epi16(t2, idx, t3);
        __m512i b = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(idx, bit6), lo, hi);
        b = _mm512_or_si512(b, _mm512_slli_epi16(_mm512_andnot_si512(low7, c), 8)); /* the sign: bit 7 to bit 15 */
        const __m512i add = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((short)(e[d / SS_KV_INT8_GROUP] * 128))),
                                               _mm256_set1_epi16((short)(e[d / SS_KV_INT8_GROUP + 1] * 128)), 1);
        b = _mm512_mask_add_epi16(b, _mm512_test_epi16_mask(b, magnitude), b, add);
        _mm512_storeu_si512(dst + d, b);
    }
#elif defined(SS_AVX2)
    /* 8 codes at a time, as float32 bits: a normal code's value (8 + m) 2^(E - 10) has the bits (E + 120) << 23 |
     * m << 20, the code's low 7 bits shifted by 20 plus 120 << 23; a subnormal one's (E = 0) is m 2^-9, converted;
     * then the group's exponent added to the nonzero values, the sign, and the top half of each */
    for (; d + 8 <= head_dim; d += 8) {
        const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(src + d)));
        const __m256i mag = _mm256_and_si256(c, _mm256_set1_epi32(0x7f));
        const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23));
        const __m256i sub = _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.f / 512.f)));
        __m256i v = _mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag));
        const __m256i nonzero = _mm256_andnot_si256(_mm256_cmpeq_epi32(mag, _mm256_setzero_si256()), _mm256_set1_epi32(-1));
        v = _mm256_add_epi32(v, _mm256_and_si256(nonzero, _mm256_set1_epi32(e[d / SS_KV_INT8_GROUP] * (1 << 23))));
        v = _mm256_or_si256(v, _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24));
        const __m256i hi = _mm256_srli_epi32(v, 16);
        _mm_storeu_si128((__m128i *)(dst + d), _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)));
    }
#endif
    for (; d < head_dim; d++) {
        const uint16_t b = table[src[d]];
        dst[d] = (b & 0x7fffu) != 0 ? (uint16_t)((int)b + e[d / SS_KV_INT8_GROUP] * 128) : b;
    }
}

/* Always inlined: a body whose dtype (and other constant arguments) its callers fix, one copy per caller, with
 * no per-element branch on the dtype. */
#define SS_INLINE static inline __attribute__((always_inline))

/* Element i of a row stored as dtype. */
static inline const void *elem(const void *base, int dtype, int64_t i) {
    return (const char *)base + i * (dtype == SS_BF16 ? (int64_t)sizeof(uint16_t) : (int64_t)sizeof(float));
}

static inline float load_elem(const void *base, int dtype, int64_t i) {
    return dtype == SS_BF16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline void store_elem(void *base, int dtype, int64_t i, float v) {
    if (dtype == SS_BF16)
        ((uint16_t *)base)[i] = f32_to_bf16(v);
    else
        ((float *)base)[i] = v;
}

#endif

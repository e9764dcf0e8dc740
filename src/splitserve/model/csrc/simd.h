/*
 * The kernels' one SIMD mapping (as ggml-cpu's simd-mappings.h): a float vector type vf of LANES lanes and its
 * operations, for AVX-512 (16 lanes) and AVX2 (8); no LANES on other builds, whose kernels keep their own scalar
 * loops (or NEON intrinsics). And the one exponential every kernel uses: ss_expf for a float, vexp for a vector,
 * the same arithmetic lane by lane (Cody-Waite reduction, n = round(x / ln 2) and r = x - n ln 2 in two parts,
 * then the degree-7 Taylor polynomial of exp(r) on |r| <= ln 2 / 2, relative error under 1e-8, scaled by 2^n),
 * so a softmax's tail computed one element at a time agrees bit for bit with its vector lanes.
 */
#ifndef SS_SIMD_H
#define SS_SIMD_H

#include "common.h"

#define SS_EXP_LOWEST (-87.f) /* exp of anything lower is taken as exp(-87): 2^n stays a normal float */
#define SS_EXP_HIGHEST 88.f
#define SS_LOG2E 1.44269504088896341f
#define SS_LN2_HI 0.693359375f
#define SS_LN2_LO (-2.12194440e-4f)

static inline float ss_expf(float x) {
    x = fminf(fmaxf(x, SS_EXP_LOWEST), SS_EXP_HIGHEST);
    const float k = nearbyintf(x * SS_LOG2E);
    const float r = fmaf(-k, SS_LN2_LO, fmaf(-k, SS_LN2_HI, x));
    float p = 1.f / 5040.f;
    p = fmaf(p, r, 1.f / 720.f);
    p = fmaf(p, r, 1.f / 120.f);
    p = fmaf(p, r, 1.f / 24.f);
    p = fmaf(p, r, 1.f / 6.f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.f);
    p = fmaf(p, r, 1.f);
    return ldexpf(p, (int)k);
}

#if defined(SS_AVX2)
static inline __m256 reduce8(const __m256 *a) { /* lane j = the sum of a[j]'s 8 lanes */
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

#if defined(SS_AVX512)
#define LANES 16
typedef __m512 vf;
static inline vf vload(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline __m256i vto_bf16(vf v) { /* round to nearest even, as f32_to_bf16 (no NaN here: finite inputs) */
    __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
}
static inline void vstore(uint16_t *p, vf v) { _mm256_storeu_si256((__m256i *)p, vto_bf16(v)); }
#define vset1 _mm512_set1_ps
#define vloadf _mm512_loadu_ps
#define vstoref _mm512_storeu_ps
#define vmul _mm512_mul_ps
#define vadd _mm512_add_ps
#define vsub _mm512_sub_ps
#define vfmadd _mm512_fmadd_ps
#define vfmsub _mm512_fmsub_ps
#define vfnmadd _mm512_fnmadd_ps
#define vmax _mm512_max_ps
#define vmin _mm512_min_ps
#define vround(x) _mm512_roundscale_ps((x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vscale2(p, k) _mm512_scalef_ps((p), (k)) /* p * 2^k */
/* The sum of v's lanes in one fixed tree (GCC's _mm512_reduce_add_ps, written out so that no compiler picks
 * another): b = hi + lo halves, c = b's halves, then c0 + c2 and c1 + c3, then those two. */
static inline float vsum(vf v) {
    const __m256 b = _mm256_add_ps(_mm512_extractf32x8_ps(v, 1), _mm512_castps512_ps256(v));
    const __m128 c = _mm_add_ps(_mm256_extractf128_ps(b, 1), _mm256_castps256_ps128(b));
    const __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));
    return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}
/* out[j] = the sum of acc[j]'s lanes, j < LANES: halves first, then one transposing reduction per 8 vectors */
static inline void vsum_each(const vf *acc, float *out) {
    __m256 half[16];
    for (int j = 0; j < 16; j++)
        half[j] = _mm256_add_ps(_mm512_castps512_ps256(acc[j]), _mm512_extractf32x8_ps(acc[j], 1));
    _mm256_storeu_ps(out, reduce8(half));
    _mm256_storeu_ps(out + 8, reduce8(half + 8));
}
static inline vf vrecip(vf d) { /* 14-bit estimate and one Newton step */
    const vf y = _mm512_rcp14_ps(d);
    return vmul(y, vfnmadd(d, y, vset1(2.f)));
}
#elif defined(SS_AVX2)
#define LANES 8
typedef __m256 vf;
static inline vf vload(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline void vstore(uint16_t *p, vf v) {
    __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    bits = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
    bits = _mm256_srli_epi32(bits, 16);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
    _mm_storeu_si128((__m128i *)p, packed);
}
#define vset1 _mm256_set1_ps
#define vloadf _mm256_loadu_ps
#define vstoref _mm256_storeu_ps
#define vmul _mm256_mul_ps
#define vadd _mm256_add_ps
#define vsub _mm256_sub_ps
#define vfmadd _mm256_fmadd_ps
#define vfmsub _mm256_fmsub_ps
#define vfnmadd _mm256_fnmadd_ps
#define vmax _mm256_max_ps
#define vmin _mm256_min_ps
#define vround(x) _mm256_round_ps((x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static inline vf vscale2(vf p, vf k) { /* p * 2^k, 2^k built in the exponent bits (|k| <= 127) */
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return vmul(p, _mm256_castsi256_ps(bits));
}
static inline vf vrecip(vf d) {
    const vf y = _mm256_rcp_ps(d);
    return vmul(y, vfnmadd(d, y, vset1(2.f)));
}
static inline void vsum_each(const vf *acc, float *out) { _mm256_storeu_ps(out, reduce8(acc)); }
static inline float vsum(vf v) { /* (hi + lo) halves, then pairs: a fixed order */
    __m128 h = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#endif

#if defined(LANES)
/* LANES elements of a row stored as dtype, from element i. */
SS_INLINE vf vload_at(const void *base, int dtype, int64_t i) {
    return dtype == SS_BF16 ? vload((const uint16_t *)base + i) : vloadf((const float *)base + i);
}
SS_INLINE void vstore_at(void *base, int dtype, int64_t i, vf v) {
    if (dtype == SS_BF16)
        vstore((uint16_t *)base + i, v);
    else
        vstoref((float *)base + i, v);
}

static inline vf vexp(vf x) { /* ss_expf, lane by lane */
    x = vmin(vmax(x, vset1(SS_EXP_LOWEST)), vset1(SS_EXP_HIGHEST));
    const vf k = vround(vmul(x, vset1(SS_LOG2E)));
    const vf r = vfnmadd(k, vset1(SS_LN2_LO), vfnmadd(k, vset1(SS_LN2_HI), x));
    vf p = vset1(1.f / 5040.f);
    p = vfmadd(p, r, vset1(1.f / 720.f));
    p = vfmadd(p, r, vset1(1.f / 120.f));
    p = vfmadd(p, r, vset1(1.f / 24.f));
    p = vfmadd(p, r, vset1(1.f / 6.f));
    p = vfmadd(p, r, vset1(0.5f));
    p = vfmadd(p, r, vset1(1.f));
    p = vfmadd(p, r, vset1(1.f));
    return vscale2(p, k);
}
static inline vf vsigmoid(vf x) { return vrecip(vfmadd(vexp(vmul(x, vset1(-1.f))), vset1(1.f), vset1(1.f))); }
#endif

#if defined(SS_AVX512)
/* 2^t for finite t <= 8 (the AMX prefill attention keeps its softmax in log2 units): the degree-5 polynomial of
 * 2^f on the fraction, the exponent by scalef. */
static inline __m512 vexp2(__m512 t) {
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n); /* [-0.5, 0.5] */
    __m512 p = _mm512_set1_ps(1.3333558e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}
#endif

#endif

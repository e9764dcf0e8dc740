/*
 * The prefill's elementwise steps in bfloat16, one pass each: SiLU(gate) x up over the fused gate/up matmul's
 * output, and the rotate-half rotary embedding in place. And, for the one-call step in float32, the two gated
 * activations: SiLU (SwiGLU) and tanh-approximated GELU (GeGLU: Gemma). PyTorch runs the first as two ops over a strided
 * view (about a quarter of a bf16 prefill on 2 cores) and the second as five. Both compute in float32 and
 * round to bfloat16 once. The float32 model keeps PyTorch's ops, so that it matches transformers bit for bit.
 */
#include "common.h"
#include "simd.h"
#include "ss_kernels.h"

static inline float silu_mul(float g, float u) { return g / (1.f + ss_expf(-g)) * u; }

/* GELU's tanh form, 0.5 g (1 + tanh(c (g + 0.044715 g^3))), written as g sigmoid(2 c (g + 0.044715 g^3)). */
#define SS_GELU_2C 1.5957691216057308f /* 2 sqrt(2 / pi) */
static inline float gelu_mul(float g, float u) {
    return g / (1.f + ss_expf(-SS_GELU_2C * (g + 0.044715f * g * g * g))) * u;
}

/* o[i] = silu(g[i]) * u[i] for i < n, stored as dtype. */
SS_INLINE void silu_mul_row(const void *g, const void *u, void *o, int dtype, int64_t n) {
    int64_t i = 0;
#if defined(LANES)
    for (; i + LANES <= n; i += LANES) {
        const vf x = vload_at(g, dtype, i);
        vstore_at(o, dtype, i, vmul(vmul(x, vsigmoid(x)), vload_at(u, dtype, i)));
    }
#endif
    for (; i < n; i++) store_elem(o, dtype, i, silu_mul(load_elem(g, dtype, i), load_elem(u, dtype, i)));
}

/* o[i] = gelu_tanh(g[i]) * u[i] for i < n, float32. */
static void gelu_mul_row(const float *g, const float *u, float *o, int64_t n) {
    int64_t i = 0;
#if defined(LANES)
    for (; i + LANES <= n; i += LANES) {
        const vf x = vloadf(g + i);
        const vf inner = vmul(vset1(SS_GELU_2C), vfmadd(vmul(vmul(x, x), x), vset1(0.044715f), x));
        vstoref(o + i, vmul(vmul(x, vsigmoid(inner)), vloadf(u + i)));
    }
#endif
    for (; i < n; i++) o[i] = gelu_mul(g[i], u[i]);
}

void ss_gelu_tanh_mul_f32(const float *gu, int64_t gu_stride, int64_t rows, int64_t n, float *out, int num_threads) {
    const int threads = rows * n >= (1 << 14) ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) gelu_mul_row(gu + r * gu_stride, gu + r * gu_stride + n, out + r * n, n);
}

/* out[r][i] = silu(gu[r][i]) * gu[r][n + i] for r < rows, i < n; gu's rows are gu_stride elements apart. Once
 * for bfloat16 (the prefill's MLP), once for float32 (the one-call decode step's). */
void ss_silu_mul_bf16(const uint16_t *gu, int64_t gu_stride, int64_t rows, int64_t n, uint16_t *out,
                      int num_threads) {
    const int threads = rows * n >= (1 << 14) ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        silu_mul_row(gu + r * gu_stride, gu + r * gu_stride + n, out + r * n, SS_BF16, n);
}

void ss_silu_mul_f32(const float *gu, int64_t gu_stride, int64_t rows, int64_t n, float *out, int num_threads) {
    const int threads = rows * n >= (1 << 14) ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        silu_mul_row(gu + r * gu_stride, gu + r * gu_stride + n, out + r * n, SS_F32, n);
}

/* x [tokens, heads, head_dim] in place (token rows row_stride elements apart): rotate-half rotary with each
 * token's cos/sin rows ([tokens, head_dim], bfloat16). */
void ss_rotary_bf16(uint16_t *x, int64_t row_stride, int64_t num_tokens, int num_heads, int head_dim,
                    const uint16_t *cos, const uint16_t *sin, int num_threads) {
    const int half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < num_tokens; t++) {
        const uint16_t *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int h = 0; h < num_heads; h++) {
            uint16_t *v = x + t * row_stride + (int64_t)h * head_dim;
            int d = 0;
#if defined(LANES)
            for (; d + LANES <= half; d += LANES) {
                const vf a = vload(v + d), b = vload(v + d + half);
                vstore(v + d, vfmsub(a, vload(c + d), vmul(b, vload(s + d))));
                vstore(v + d + half, vfmadd(b, vload(c + d + half), vmul(a, vload(s + d + half))));
            }
#endif
            for (; d < half; d++) {
                const float a = bf16_to_f32(v[d]), b = bf16_to_f32(v[d + half]);
                v[d] = f32_to_bf16(a * bf16_to_f32(c[d]) - b * bf16_to_f32(s[d]));
                v[d + half] = f32_to_bf16(b * bf16_to_f32(c[d + half]) + a * bf16_to_f32(s[d + half]));
            }
        }
    }
}

/*
 * The prefill's elementwise steps in bfloat16, one pass each: SiLU(gate) x up over the fused gate/up matmul's
 * output, and the rotate-half rotary embedding in place. PyTorch runs the first as two ops over a strided
 * view (about a quarter of a bf16 prefill on 2 cores) and the second as five. Both compute in float32 and
 * round to bfloat16 once. The float32 model keeps PyTorch's ops, so that it matches transformers bit for bit.
 */
#include "common.h"
#include "simd.h"
#include "ss_kernels.h"

#if defined(SS_AMX)
#include <sys/syscall.h>
#include <unistd.h>

/* Linux hands out AMX tile state only on request, once per process (prefill_attention.c, quant_matmul.c). */
int ss_amx_permitted(void) {
    static int state; /* 0: not asked, 1: granted, -1: refused */
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0 ? 1 : -1;
    return state > 0;
}
#else
int ss_amx_permitted(void) { return 0; }
#endif

static inline float silu_mul(float g, float u) { return g / (1.f + ss_expf(-g)) * u; }

static inline uint16_t silu_mul_bf16(uint16_t g, uint16_t u) {
    return f32_to_bf16(silu_mul(bf16_to_f32(g), bf16_to_f32(u)));
}
#if defined(LANES)
#define SILU_LANES LANES
#else /* no vector path: the vector loop below is dead code */
#define SILU_LANES 0
#define vload(p) 0
#define vloadf(p) 0
#define vstore(p, v) (void)(v)
#define vstoref(p, v) (void)(v)
#define vsigmoid(x) (x)
#define vmul(a, b) (a)
typedef float vf;
#endif

/* out[r][i] = silu(gu[r][i]) * gu[r][n + i] for r < rows, i < n; gu's rows are gu_stride elements apart. Once
 * for bfloat16 (the prefill's MLP), once for float32 (the one-call decode step's). */
#define DEFINE_SILU_MUL(NAME, T, LOAD, STORE, SCALAR)                                                        \
    void NAME(const T *gu, int64_t gu_stride, int64_t rows, int64_t n, T *out, int num_threads) {            \
        const int threads = rows * n >= (1 << 14) ? num_threads : 1;                                         \
        _Pragma("omp parallel for num_threads(threads) schedule(static)") for (int64_t r = 0; r < rows; r++) { \
            const T *g = gu + r * gu_stride, *u = g + n;                                                     \
            T *o = out + r * n;                                                                              \
            int64_t i = 0;                                                                                   \
            for (; SILU_LANES > 0 && i + SILU_LANES <= n; i += SILU_LANES) {                                 \
                const vf x = LOAD(g + i);                                                                    \
                STORE(o + i, vmul(vmul(x, vsigmoid(x)), LOAD(u + i)));                                       \
            }                                                                                                \
            for (; i < n; i++) o[i] = SCALAR(g[i], u[i]);                                                    \
        }                                                                                                    \
    }
DEFINE_SILU_MUL(ss_silu_mul_bf16, uint16_t, vload, vstore, silu_mul_bf16)
DEFINE_SILU_MUL(ss_silu_mul_f32, float, vloadf, vstoref, silu_mul)

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

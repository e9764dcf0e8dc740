/*
 * Matmuls straight from a GGUF's quantized weights, the generic part: quantizing activations, repacking
 * weights, the tiling over threads and the dispatch to each architecture's kernels (quant.h names them).
 *
 * Y[M, N] = X[M, K] . W[N, K]^T, with W in llama.cpp's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 or IQ4_NL blocks (32 weights
 * each) or Q2_K, Q3_K, Q4_K, Q5_K, Q6_K or IQ4_XS super-blocks (256), repacked at load from the file's blocks without
 * loss (IQ4_NL's and IQ4_XS's indices name 8-bit values that are multiplied as Q8_0's codes), and X quantized on
 * the fly to 8 bits per block of 32 (scale d, sum s = d * sum(q)), so every block product is an integer dot
 * product:
 *
 *     sum_k w_k x_k = d_w d_x sum_k u_k q_k + m_w s_x      (w_k = d_w u_k + m_w, x_k ~ d_x q_k)
 *
 * where u is the weight code the instruction set multiplies and m_w the offset that makes it exact (quant.h says
 * what each format's are; Q6_K and Q2_K sum their two half blocks in integers first; each architecture's file says which
 * codes it uses: arch/x86/quant.c, arch/arm/quant.c, arch/scalar/quant.c, amx/quant_matmul.c).
 *
 * The layout is the reading of llama.cpp's ggml-cpu vec_dot_q4_1_q8_1 and friends; the tiling is ours: a
 * tile is up to 4 activation rows x a group of RG weight rows (quant.h), so each decoded weight block serves
 * every row of the tile and each activation block the group's RG weight rows. Threads split the weight rows
 * (OpenMP), so decode (M = 1..32) and prefill (M in the hundreds) both use every core, and each thread's
 * weight rows stay in its cache while it walks all activation rows. From 5 rows on, the amx build runs AMX-INT8
 * tiles (amx/quant_matmul.c) and the avx512 build 512-bit tiles of 8 rows x 16 weight rows
 * (arch/x86/quant_avx512.c), with the same integers and float operations as the row tiles.
 */
#include <stdlib.h>

#include "quant.h"
#include "ss_kernels.h"

_Static_assert(sizeof(block_q4_0) == 18 && sizeof(block_q4_1) == 20 && sizeof(block_q5_0) == 22 &&
                   sizeof(block_q5_1) == 24 && sizeof(block_q8_0) == 34 && sizeof(block_q4_K) == 144 &&
                   sizeof(block_q3_K) == 110 && sizeof(block_q5_K) == 176 && sizeof(block_q6_K) == 210 &&
                   sizeof(block_iq4_nl) == 18 && sizeof(block_q2_K) == 84 && sizeof(block_iq4_xs) == 136,
               "GGML blocks");

/* A unit of a GGUF row: one block of 32 weights, or a K format's super-block of 256. */
static int64_t unit_weights(int wtype) { return is_k_format(format_of(wtype)) ? QK_K : QK; }
static int64_t unit_bytes(int wtype) {
    switch (wtype) {
        case GGML_Q4_0: return sizeof(block_q4_0);
        case GGML_Q4_1: return sizeof(block_q4_1);
        case GGML_Q5_0: return sizeof(block_q5_0);
        case GGML_Q5_1: return sizeof(block_q5_1);
        case GGML_Q8_0: return sizeof(block_q8_0);
        case GGML_IQ4_NL: return sizeof(block_iq4_nl);
        case GGML_Q2_K: return sizeof(block_q2_K);
        case GGML_IQ4_XS: return sizeof(block_iq4_xs);
        case GGML_Q3_K: return sizeof(block_q3_K);
        case GGML_Q4_K: return sizeof(block_q4_K);
        case GGML_Q5_K: return sizeof(block_q5_K);
        case GGML_Q6_K: return sizeof(block_q6_K);
        default: return -1;
    }
}

int64_t ss_quant_row_bytes(int wtype, int64_t k) {
    const int64_t bytes = unit_bytes(wtype);
    return bytes < 0 || k % unit_weights(wtype) != 0 ? -1 : k / unit_weights(wtype) * bytes;
}

/* ------------------------------------------------------------------ a GGUF unit as integer codes */
/* One unit of a row, decoded without loss: each weight's code u (the unsigned code the kernels multiply; Q8_0 the
 * signed weight) and the integers and fp16 values that scale it (quant.h). The repacking and the dequantizer both
 * read this, so the two agree with each other by construction and with llama.cpp's dequantize_row_* by test. */
typedef struct {
    int16_t u[QK_K];       /* IQ4_NL, IQ4_XS: the table's indices */
    uint16_t d, m;         /* fp16: the block's d and m_w (Q4/Q5/Q8 formats), or the super-block's d and dmin */
    uint8_t sc[8], mn[8];  /* Q4_K, Q5_K: each block's 6-bit scale and min */
    int8_t sc16[16];       /* Q6_K, Q3_K, Q2_K: each half block's scale; IQ4_XS: each block's ls - 32 */
    uint8_t mn16[16];      /* Q2_K: each half block's min */
} decoded_unit;

/* Q4_K's and Q5_K's packed 6-bit scale and min of block j (ggml's get_scale_min_k4). */
static void scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = q[j] & 63, *mn = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4));
        *mn = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

static void decode_unit(const uint8_t *src, int wtype, decoded_unit *o) {
    memset(o, 0, sizeof *o);
    switch (wtype) {
        case GGML_Q4_0:
        case GGML_Q4_1: {
            const uint8_t *qs;
            if (wtype == GGML_Q4_0) {
                const block_q4_0 *b = (const block_q4_0 *)src;
                o->d = b->d, o->m = f32_to_f16(-8.0f * f16_to_f32(b->d)); /* exact: a power of two */
                qs = b->qs;
            } else {
                const block_q4_1 *b = (const block_q4_1 *)src;
                o->d = b->d, o->m = b->m;
                qs = b->qs;
            }
            for (int t = 0; t < QK / 2; t++) o->u[t] = qs[t] & 0x0F, o->u[t + QK / 2] = qs[t] >> 4;
            break;
        }
        case GGML_Q5_0:
        case GGML_Q5_1: {
            const uint8_t *qs, *qh;
            if (wtype == GGML_Q5_0) {
                const block_q5_0 *b = (const block_q5_0 *)src;
                o->d = b->d, o->m = f32_to_f16(-16.0f * f16_to_f32(b->d)); /* exact: a power of two */
                qs = b->qs, qh = b->qh;
            } else {
                const block_q5_1 *b = (const block_q5_1 *)src;
                o->d = b->d, o->m = b->m;
                qs = b->qs, qh = b->qh;
            }
            const uint32_t high = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
            for (int t = 0; t < QK / 2; t++) {
                o->u[t] = (int16_t)((qs[t] & 0x0F) | (((high >> t) & 1) << 4));
                o->u[t + QK / 2] = (int16_t)((qs[t] >> 4) | (((high >> (t + QK / 2)) & 1) << 4));
            }
            break;
        }
        case GGML_Q8_0: {
            const block_q8_0 *b = (const block_q8_0 *)src;
            o->d = b->d;
            for (int t = 0; t < QK; t++) o->u[t] = b->qs[t];
            break;
        }
        case GGML_IQ4_NL: { /* ggml's dequantize_row_iq4_nl: d times the table's value */
            const block_iq4_nl *b = (const block_iq4_nl *)src;
            o->d = b->d;
            for (int t = 0; t < QK / 2; t++) o->u[t] = b->qs[t] & 0x0F, o->u[t + QK / 2] = b->qs[t] >> 4;
            break;
        }
        case GGML_Q4_K:
        case GGML_Q5_K: {
            const uint8_t *scales, *qs, *qh = NULL;
            if (wtype == GGML_Q4_K) {
                const block_q4_K *b = (const block_q4_K *)src;
                o->d = b->d, o->m = b->dmin, scales = b->scales, qs = b->qs;
            } else {
                const block_q5_K *b = (const block_q5_K *)src;
                o->d = b->d, o->m = b->dmin, scales = b->scales, qs = b->qs, qh = b->qh;
            }
            for (int j = 0; j < 8; j++) scale_min_k4(j, scales, &o->sc[j], &o->mn[j]);
            for (int c = 0; c < 4; c++) /* 64 weights: block 2c in the low nibbles of 32 bytes, 2c + 1 the high */
                for (int l = 0; l < 32; l++) {
                    const uint8_t q = qs[32 * c + l];
                    int lo = q & 0x0F, hi = q >> 4;
                    if (qh != NULL) lo |= ((qh[l] >> (2 * c)) & 1) << 4, hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                    o->u[64 * c + l] = (int16_t)lo, o->u[64 * c + 32 + l] = (int16_t)hi;
                }
            break;
        }
        case GGML_Q2_K: { /* w = d sc q - dmin mn per 16 weights (ggml's dequantize_row_q2_K) */
            const block_q2_K *b = (const block_q2_K *)src;
            o->d = b->d, o->m = b->dmin;
            for (int h = 0; h < 16; h++) o->sc16[h] = (int8_t)(b->scales[h] & 0x0F), o->mn16[h] = b->scales[h] >> 4;
            for (int half = 0; half < 2; half++) /* 128 weights from 32 bytes of qs, 2 bits at a time */
                for (int j = 0; j < 4; j++)
                    for (int l = 0; l < 32; l++) o->u[128 * half + 32 * j + l] = (b->qs[32 * half + l] >> (2 * j)) & 3;
            break;
        }
        case GGML_IQ4_XS: { /* w = d (ls - 32) value[index] per 32 weights (ggml's dequantize_row_iq4_xs) */
            const block_iq4_xs *b = (const block_iq4_xs *)src;
            o->d = b->d;
            for (int j = 0; j < 8; j++) {
                const int ls = ((b->scales_l[j / 2] >> (4 * (j % 2))) & 0x0F) | (((b->scales_h >> (2 * j)) & 3) << 4);
                o->sc16[j] = (int8_t)(ls - 32);
                for (int t = 0; t < QK / 2; t++)
                    o->u[QK * j + t] = b->qs[16 * j + t] & 0x0F, o->u[QK * j + t + QK / 2] = b->qs[16 * j + t] >> 4;
            }
            break;
        }
        case GGML_Q3_K: { /* as Q6_K: u - 32 = q - 4, the half blocks' scales sc - 32 (ggml's dequantize_row_q3_K) */
            const block_q3_K *b = (const block_q3_K *)src;
            o->d = b->d;
            uint32_t aux[4];
            memcpy(aux, b->scales, 12);
            const uint32_t tmp = aux[2], low4 = 0x0f0f0f0f, two = 0x03030303;
            aux[2] = ((aux[0] >> 4) & low4) | (((tmp >> 4) & two) << 4);
            aux[3] = ((aux[1] >> 4) & low4) | (((tmp >> 6) & two) << 4);
            aux[0] = (aux[0] & low4) | (((tmp >> 0) & two) << 4);
            aux[1] = (aux[1] & low4) | (((tmp >> 2) & two) << 4);
            const uint8_t *sc = (const uint8_t *)aux;
            for (int h = 0; h < 16; h++) o->sc16[h] = (int8_t)(sc[h] - 32);
            for (int half = 0; half < 2; half++) /* 128 weights from 32 bytes of qs, 2 bits at a time */
                for (int j = 0; j < 4; j++)
                    for (int l = 0; l < 32; l++) {
                        const int low = (b->qs[32 * half + l] >> (2 * j)) & 3;
                        const int high = (b->hmask[l] >> (4 * half + j)) & 1;
                        o->u[128 * half + 32 * j + l] = (int16_t)(low - (high ? 0 : 4) + 32);
                    }
            break;
        }
        default: { /* GGML_Q6_K */
            const block_q6_K *b = (const block_q6_K *)src;
            o->d = b->d;
            memcpy(o->sc16, b->scales, sizeof o->sc16);
            for (int half = 0; half < 2; half++) { /* 128 weights from 64 bytes of ql and 32 of qh */
                const uint8_t *ql = b->ql + 64 * half, *qh = b->qh + 32 * half;
                int16_t *u = o->u + 128 * half;
                for (int l = 0; l < 32; l++) {
                    u[l] = (int16_t)((ql[l] & 0x0F) | ((qh[l] & 3) << 4));
                    u[l + 32] = (int16_t)((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4));
                    u[l + 64] = (int16_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                    u[l + 96] = (int16_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
                }
            }
            break;
        }
    }
}

/* Weight t of a decoded unit, in float32 as llama.cpp's dequantize_row_* computes it. */
static float decoded_weight(const decoded_unit *o, int wtype, int t) {
    const float d = f16_to_f32(o->d);
    const int fmt = format_of(wtype);
    switch (fmt) {
        case FMT_Q8: return d * (float)o->u[t];
        case FMT_Q4K:
        case FMT_Q5K: return d * (float)o->sc[t / QK] * (float)o->u[t] - f16_to_f32(o->m) * (float)o->mn[t / QK];
        case FMT_Q6K: return d * (float)o->sc16[t / 16] * (float)(o->u[t] - 32);
        case FMT_Q2K: return d * (float)o->sc16[t / 16] * (float)o->u[t] - f16_to_f32(o->m) * (float)o->mn16[t / 16];
        case FMT_IQ4:
        case FMT_IQ4K: {
            static const int8_t values[16] = {IQ4_VALUES};
            return (fmt == FMT_IQ4 ? d : d * (float)o->sc16[t / QK]) * (float)values[o->u[t]];
        }
        default: return d * (float)o->u[t] + f16_to_f32(o->m);
    }
}

int64_t ss_act_block_bytes(void) { return (int64_t)sizeof(block_q8a); }

/* ------------------------------------------------------------------ activations to 8 bits per block */

#if !defined(SS_AVX2) /* x86 builds have their own (arch/x86/quant.c) */
void quantize_block(const float *x, block_q8a *y) {
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
    half_sums(y);
}
#endif

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

/* ------------------------------------------------------------------------- the repacked layout (quant.h) */
int64_t ss_packed_bytes(int wtype, int64_t n, int64_t k) {
    const int fmt = format_of(wtype);
    if (fmt < 0 || ss_quant_row_bytes(wtype, k) < 0) return -1;
    return (n + RG - 1) / RG * group_bytes_of(fmt, k / QK);
}

/* Codes t0 .. t0 + 31 of row r (a decoded unit's) into a group's nibbles (qs[4][RG * 4]: byte 4 v + j of row r
 * holds weight 4 v + j low and 16 + 4 v + j high), and their fifth bits (qh: bit c of byte 4 r + j, weight
 * 4 c + j) or bits 4-5 (qh6[2][RG * 4]: bits 2 i of byte 4 r + j of qh6[p], weight 4 (4 p + i) + j). */
static void put_codes(const int16_t *u, int r, uint8_t (*qs)[RG * 4], uint8_t *qh, uint8_t (*qh6)[RG * 4]) {
    for (int v = 0; v < 4; v++)
        for (int j = 0; j < 4; j++)
            qs[v][4 * r + j] = (uint8_t)((u[4 * v + j] & 0x0F) | (u[16 + 4 * v + j] & 0x0F) << 4);
    for (int c = 0; c < 8; c++)
        for (int j = 0; j < 4; j++) {
            const int code = u[4 * c + j];
            if (qh != NULL) qh[4 * r + j] |= (uint8_t)(((code >> 4) & 1) << c);
            if (qh6 != NULL) qh6[c / 4][4 * r + j] |= (uint8_t)(((code >> 4) & 3) << (2 * (c % 4)));
        }
}

/* Unit kb of row r of a group (its first block kb, or super-block kb / 8 of a K format), decoded. */
static void repack_unit(const decoded_unit *o, int fmt, int r, uint8_t *unit) {
    switch (fmt) {
        case FMT_Q4: {
            group_q4 *g = (group_q4 *)unit;
            g->d[r] = o->d, g->m[r] = o->m;
            put_codes(o->u, r, g->qs, NULL, NULL);
            break;
        }
        case FMT_Q5: {
            group_q5 *g = (group_q5 *)unit;
            g->d[r] = o->d, g->m[r] = o->m;
            put_codes(o->u, r, g->qs, g->qh, NULL);
            break;
        }
        case FMT_Q8: {
            group_q8 *g = (group_q8 *)unit;
            g->d[r] = o->d;
            for (int c = 0; c < 8; c++)
                for (int j = 0; j < 4; j++) g->qs[c][4 * r + j] = (uint8_t)(o->u[4 * c + j] + Q8_OFFSET);
            break;
        }
        case FMT_Q4K:
        case FMT_Q5K: {
            group_q4k *g4 = (group_q4k *)unit;
            group_q5k *g5 = (group_q5k *)unit;
            uint16_t *d = fmt == FMT_Q4K ? g4->d : g5->d, *dmin = fmt == FMT_Q4K ? g4->dmin : g5->dmin;
            d[r] = o->d, dmin[r] = o->m;
            for (int b = 0; b < 8; b++) {
                if (fmt == FMT_Q4K) {
                    g4->sc[b][r] = o->sc[b], g4->mn[b][r] = o->mn[b];
                    put_codes(o->u + QK * b, r, g4->qs[b], NULL, NULL);
                } else {
                    g5->sc[b][r] = o->sc[b], g5->mn[b][r] = o->mn[b];
                    put_codes(o->u + QK * b, r, g5->qs[b], g5->qh[b], NULL);
                }
            }
            break;
        }
        case FMT_Q2K: {
            group_q2k *g = (group_q2k *)unit;
            g->d[r] = o->d, g->dmin[r] = o->m;
            for (int h = 0; h < 16; h++) g->sc[h][r] = (uint8_t)(o->sc16[h] | o->mn16[h] << 4);
            for (int b = 0; b < 8; b++)
                for (int c = 0; c < 8; c++)
                    for (int j = 0; j < 4; j++)
                        g->qs[b][c / 4][4 * r + j] |= (uint8_t)(o->u[QK * b + 4 * c + j] << (2 * (c % 4)));
            break;
        }
        case FMT_IQ4: {
            group_iq4 *g = (group_iq4 *)unit;
            g->d[r] = o->d;
            put_codes(o->u, r, g->qs, NULL, NULL);
            break;
        }
        case FMT_IQ4K: {
            group_iq4k *g = (group_iq4k *)unit;
            g->d[r] = o->d;
            for (int b = 0; b < 8; b++) {
                g->sc[b][r] = o->sc16[b];
                put_codes(o->u + QK * b, r, g->qs[b], NULL, NULL);
            }
            break;
        }
        default: { /* FMT_Q6K */
            group_q6k *g = (group_q6k *)unit;
            g->d[r] = o->d;
            for (int h = 0; h < 16; h++) g->sc[h][r] = o->sc16[h];
            for (int b = 0; b < 8; b++) put_codes(o->u + QK * b, r, g->ql[b], NULL, g->qh[b]);
            break;
        }
    }
}

/* GGUF rows [N, K] of wtype -> the grouped layout (ss_packed_bytes(wtype, N, K) bytes). Returns 0 or -1. */
int ss_repack(const void *src, int wtype, int64_t n, int64_t k, void *dst) {
    const int64_t size = ss_packed_bytes(wtype, n, k);
    if (size < 0) return -1;
    memset(dst, 0, (size_t)size); /* the last group's padding rows: zero codes and scales */
    const int fmt = format_of(wtype);
    const int64_t row_bytes = ss_quant_row_bytes(wtype, k), units = k / unit_weights(wtype);
    const int64_t ubytes = unit_bytes(wtype), group_bytes = group_bytes_of(fmt, k / QK);
    decoded_unit o;
    for (int64_t row = 0; row < n; row++)
        for (int64_t kb = 0; kb < units; kb++) {
            decode_unit((const uint8_t *)src + row * row_bytes + kb * ubytes, wtype, &o);
            uint8_t *unit = (uint8_t *)dst + row / RG * group_bytes + kb * (int64_t)format_unit_bytes(fmt);
            repack_unit(&o, fmt, (int)(row % RG), unit);
        }
    return 0;
}

/* Weight groups per OpenMP task: a task's groups stay in cache while it walks every activation row. */
#define GROUPS_PER_TASK 4

/* Y = Xq . W^T for already-quantized activations and repacked weights; the body of an OpenMP region (call
 * it inside one, or alone for one thread). Y is [M, N] of out_dtype, rows ldy elements apart. */
static void qgemm_body(const void *w, int fmt, int64_t n, int64_t k, const block_q8a *xq, int64_t m, void *y,
                       int out_dtype, int64_t ldy) {
    const int64_t nb = k / QK, groups = (n + RG - 1) / RG;
    const int64_t group_bytes = group_bytes_of(fmt, nb);
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
                group_kernel((const uint8_t *)w + g * group_bytes, fmt, x, rows, nb, tmp);
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

/* Y = Xq . W^T for one repacked weight of one format, on the widest kernel that takes it. */
static int quantized_product(const block_q8a *xq, int64_t m, int64_t k, const void *w, int wtype, int64_t n, void *y,
                             int out_dtype, int64_t ldy, int num_threads) {
    const int threads = m * n * k >= (1 << 16) ? num_threads : 1;
#if defined(SS_AMX)
    if (m >= AMX_MIN_ROWS && amx_quant_matmul(xq, m, k, w, wtype, n, y, out_dtype, ldy, threads) == 0) return 0;
#endif
#if defined(SS_WIDE)
    if (m >= WIDE_MIN_ROWS && wide_quant_matmul(xq, m, k, w, wtype, n, y, out_dtype, ldy, threads) == 0) return 0;
#endif
#if defined(SS_AMX) /* decode rows: the 512-bit stream on the amx build (why not elsewhere: at its definition) */
    if (m < WIDE_MIN_ROWS && stream_quant_matmul(xq, m, k, w, wtype, n, y, out_dtype, ldy, threads) == 0) return 0;
#endif
    const int fmt = format_of(wtype);
#pragma omp parallel num_threads(threads)
    qgemm_body(w, fmt, n, k, xq, m, y, out_dtype, ldy);
    return 0;
}

/* A mixed weight's header, checked: its parts are formats the kernels take, their rows add up to n and their
 * data lies within size bytes (-1 for any size: not known here). Returns 0 or -1. */
static int check_mixed(const ss_mixed *h, int64_t n, int64_t k) {
    if (h->num_parts < 1 || h->num_parts > SS_MIXED_PARTS) return -1;
    int64_t rows = 0;
    for (int64_t p = 0; p < h->num_parts; p++) {
        if (ss_packed_bytes((int)h->wtype[p], h->n[p], k) < 0 || h->n[p] < 1 || h->offset[p] < (int64_t)sizeof *h ||
            h->offset[p] % 64 != 0)
            return -1;
        rows += h->n[p];
    }
    return rows == n ? 0 : -1;
}

/* Y[M, N] (out_dtype, rows ldy apart) = X[M, K] (x_dtype, rows x_stride apart) . W[N, K]^T with W repacked by
 * ss_repack (or an SS_MIXED weight: the activations are quantized once for all its parts), K a multiple of 32.
 * scratch holds M * K/32 activation blocks (ss_act_block_bytes each), or is NULL to allocate. Returns 0, or -1
 * for an unknown weight type, a K the format does not divide or no memory. */
int ss_quant_matmul(const void *x, int x_dtype, int64_t x_stride, int64_t m, int64_t k, const void *w, int wtype,
                    int64_t n, void *y, int out_dtype, int64_t ldy, void *scratch, int num_threads) {
    const ss_mixed *mixed = wtype == SS_MIXED ? (const ss_mixed *)w : NULL;
    if (mixed != NULL ? check_mixed(mixed, n, k) < 0 : ss_packed_bytes(wtype, n, k) < 0) return -1;
    block_q8a *xq = scratch != NULL ? (block_q8a *)scratch : malloc(sizeof(block_q8a) * (size_t)(m * (k / QK)));
    if (xq == NULL) return -1;
    quantize_rows(x, x_dtype, x_stride, m, k, xq, num_threads);
    int status = 0;
    if (mixed == NULL) {
        status = quantized_product(xq, m, k, w, wtype, n, y, out_dtype, ldy, num_threads);
    } else {
        const size_t elem = out_dtype == SS_F32 ? 4 : 2;
        int64_t col = 0;
        for (int64_t p = 0; p < mixed->num_parts && status == 0; p++) {
            status = quantized_product(xq, m, k, (const uint8_t *)w + mixed->offset[p], (int)mixed->wtype[p],
                                       mixed->n[p], (uint8_t *)y + (size_t)col * elem, out_dtype, ldy, num_threads);
            col += mixed->n[p];
        }
    }
    if (scratch == NULL) free(xq);
    return status;
}

/* Dequantize weight rows [n0, n1) to float32 [n1 - n0, K] (tests and the PyTorch reference). */
int ss_dequantize_rows(const void *w, int wtype, int64_t k, int64_t n0, int64_t n1, float *out) {
    const int64_t row_bytes = ss_quant_row_bytes(wtype, k);
    if (row_bytes < 0) return -1;
    const int64_t per_unit = unit_weights(wtype), ubytes = unit_bytes(wtype);
    decoded_unit o;
    for (int64_t r = n0; r < n1; r++)
        for (int64_t kb = 0; kb < k / per_unit; kb++) {
            decode_unit((const uint8_t *)w + r * row_bytes + kb * ubytes, wtype, &o);
            for (int t = 0; t < per_unit; t++) out[(r - n0) * k + kb * per_unit + t] = decoded_weight(&o, wtype, t);
        }
    return 0;
}

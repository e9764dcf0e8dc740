/*
 * A self-contained check of the quantized matmul for builds this machine cannot run natively (ARM NEON under
 * qemu on an x86 machine): random GGUF blocks of each format (the K-quants' super-blocks included), ss_quant_matmul against a float64 reference
 * over ss_dequantize_rows (plain C) and activations rounded as the kernels round them; then batch invariance:
 * a matmul row and an attention row give the same bits alone as in a batch (a prefill chunk beside a decode
 * row), with 1 and 2 threads. Prints "ok" and exits 0 when every case agrees; tests/engine/test_quant_kernels.py builds and runs it.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../src/splitserve/model/csrc/ss_kernels.h"

static uint32_t state = 12345u;
static uint32_t next(void) {
    state = state * 1664525u + 1013904223u;
    return state >> 8;
}
static float uniform(void) { return (float)next() / 16777216.0f; } /* [0, 1) */

static const uint16_t HALF_SCALES[] = {0x2000, 0x2266, 0x23ff, 0x1c00}; /* about 0.0078 .. 0.0039 */

static int is_k(int wtype) { return (wtype >= 10 && wtype <= 14) || wtype == 23; }

/* Random blocks of each format, with small positive fp16 scales (and a small negative Q4_1/Q5_1 minimum). */
static void random_rows(uint8_t *rows, int wtype, int64_t n, int64_t k) {
    const int64_t units = n * (k / (is_k(wtype) ? 256 : 32));
    const int64_t block = n * ss_quant_row_bytes(wtype, k) / units;
    for (int64_t b = 0; b < units; b++) {
        uint8_t *p = rows + b * block;
        for (int64_t i = 0; i < block; i++) p[i] = (uint8_t)next();
        uint16_t d = HALF_SCALES[next() % 4], m = 0xA000;
        memcpy(p + (wtype == 14 ? 208 : wtype == 11 ? 108 : wtype == 10 ? 80 : 0), &d, 2); /* Q2_K, Q3_K, Q6_K: d last */
        if (wtype == 3 || wtype == 7) memcpy(p + 2, &m, 2);
        if (wtype == 12 || wtype == 13) memcpy(p + 2, &d, 2); /* dmin */
        if (wtype == 10) memcpy(p + 82, &d, 2);
    }
}

static int check(int wtype, int64_t m, int64_t n, int64_t k) {
    uint8_t *rows = malloc((size_t)(n * ss_quant_row_bytes(wtype, k)));
    uint8_t *packed = malloc((size_t)ss_packed_bytes(wtype, n, k));
    float *w = malloc(sizeof(float) * (size_t)(n * k)), *x = malloc(sizeof(float) * (size_t)(m * k));
    float *y = malloc(sizeof(float) * (size_t)(m * n));
    random_rows(rows, wtype, n, k);
    for (int64_t i = 0; i < m * k; i++) x[i] = (uniform() - 0.5f) * 4.0f;
    x[1] = 30.0f; /* an outlier */
    if (ss_repack(rows, wtype, n, k, packed) || ss_dequantize_rows(rows, wtype, k, 0, n, w) ||
        ss_quant_matmul(x, 0, k, m, k, packed, wtype, n, y, 0, n, NULL, 2)) {
        printf("type %d: a call failed\n", wtype);
        return 1;
    }
    double worst = 0.0;
    for (int64_t i = 0; i < m; i++) {
        double xq[4096];
        for (int64_t b = 0; b < k / 32; b++) { /* the kernels' rounding: d = max / 127, q = round(x * 127 / max) */
            float top = 0.0f;
            for (int j = 0; j < 32; j++) top = fmaxf(top, fabsf(x[i * k + b * 32 + j]));
            const float inv = top > 0.0f ? 127.0f / top : 0.0f;
            for (int j = 0; j < 32; j++)
                xq[b * 32 + j] = nearbyintf(x[i * k + b * 32 + j] * inv) * (double)(top / 127.0f);
        }
        for (int64_t r = 0; r < n; r++) {
            double ref = 0.0, scale = 0.0;
            for (int64_t t = 0; t < k; t++) {
                ref += xq[t] * w[r * k + t];
                scale += fabs(xq[t] * w[r * k + t]);
            }
            const double err = fabs(ref - y[i * n + r]) / (scale + 1e-6);
            if (err > worst) worst = err;
        }
    }
    free(rows), free(packed), free(w), free(x), free(y);
    if (worst > 1e-5) {
        printf("type %d, m %ld: relative error %g\n", wtype, (long)m, worst);
        return 1;
    }
    return 0;
}

/* Rows of a 37-row matmul against each row alone, at 1 and 2 threads: the same bits. */
static int matmul_invariance(int wtype) {
    const int64_t m = 37, n = 40, k = 512;
    uint8_t *rows = malloc((size_t)(n * ss_quant_row_bytes(wtype, k)));
    uint8_t *packed = malloc((size_t)ss_packed_bytes(wtype, n, k));
    float *x = malloc(sizeof(float) * (size_t)(m * k)), *all = malloc(sizeof(float) * (size_t)(m * n));
    float one[40];
    random_rows(rows, wtype, n, k);
    for (int64_t i = 0; i < m * k; i++) x[i] = (uniform() - 0.5f) * 4.0f;
    int failures = ss_repack(rows, wtype, n, k, packed) || ss_quant_matmul(x, 0, k, m, k, packed, wtype, n, all, 0, n, NULL, 2);
    for (int threads = 1; threads <= 2; threads++)
        for (int64_t i = 0; i < m; i++) {
            failures += ss_quant_matmul(x + i * k, 0, k, 1, k, packed, wtype, n, one, 0, n, NULL, threads) != 0;
            failures += memcmp(one, all + i * n, sizeof one) != 0;
        }
    free(rows), free(packed), free(x), free(all);
    if (failures) printf("type %d: a matmul row depends on the batch\n", wtype);
    return failures != 0;
}

/* A 300-token sequence's queries as one prefill chunk beside a decode row of another sequence, against each
 * query alone, at 1 and 2 threads: the same bits; over the whole context, or a sliding window (the last rows' first
 * partition skipped), or with soft-capped scores. */
static int attention_invariance(int64_t window, float softcap) {
    enum { LEN = 300, H = 4, HKV = 2, D = 32, BS = 16, BLOCKS = (LEN + BS - 1) / BS };
    float *k = malloc(sizeof(float) * BLOCKS * BS * HKV * D), *v = malloc(sizeof(float) * BLOCKS * BS * HKV * D);
    float *q = malloc(sizeof(float) * (LEN + 1) * H * D), *all = malloc(sizeof(float) * (LEN + 1) * H * D);
    float one[H * D];
    int64_t tables[2 * BLOCKS], seq[LEN + 1], lens[LEN + 1];
    for (int i = 0; i < BLOCKS * BS * HKV * D; i++) k[i] = (uniform() - 0.5f) * 6.0f, v[i] = uniform() - 0.5f;
    for (int i = 0; i < (LEN + 1) * H * D; i++) q[i] = uniform() - 0.5f;
    for (int b = 0; b < BLOCKS; b++) tables[b] = (b * 7) % BLOCKS, tables[BLOCKS + b] = BLOCKS - 1 - b;
    for (int r = 0; r < LEN; r++) seq[r] = 0, lens[r] = r + 1;
    seq[LEN] = 1, lens[LEN] = LEN;
    int failures = ss_paged_attention_f32(q, H * D, k, v, tables, BLOCKS, seq, lens, all, LEN + 1, H, HKV, D, BS,
                                          0.17f, window, softcap, 2);
    for (int threads = 1; threads <= 2; threads++)
        for (int r = 0; r <= LEN; r += 13) {
            failures += ss_paged_attention_f32(q + r * H * D, H * D, k, v, tables + seq[r] * BLOCKS, BLOCKS, NULL,
                                               lens + r, one, 1, H, HKV, D, BS, 0.17f, window, softcap, threads);
            failures += memcmp(one, all + r * H * D, sizeof one) != 0;
        }
    free(k), free(v), free(q), free(all);
    if (failures) printf("an attention row depends on the batch (window %lld, softcap %g)\n", (long long)window, softcap);
    return failures != 0;
}

int main(void) {
    /* Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K IQ4_NL IQ4_XS */
    const int types[] = {2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23};
    const int num_types = (int)(sizeof types / sizeof types[0]);
    const int64_t rows[] = {1, 3, 4, 5, 17};
    int failures = 0;
    for (int t = 0; t < num_types; t++)
        for (int r = 0; r < 5; r++) failures += check(types[t], rows[r], 44, is_k(types[t]) ? 512 : 96);
    for (int t = 0; t < num_types; t++) failures += matmul_invariance(types[t]);
    failures += attention_invariance(0, 0.f) + attention_invariance(40, 0.f) + attention_invariance(0, 2.f);
    printf(failures ? "failed\n" : "ok\n");
    return failures != 0;
}

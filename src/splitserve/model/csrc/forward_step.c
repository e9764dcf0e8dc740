/*
 * A whole step of a decoder model (model/arch.py) in one call, for any mix of rows: decode tokens and prefill
 * chunks alike. For each layer: add + RMSNorm, q/k/v matmul (+ bias), q/k head norms where the architecture has
 * them, rotary embedding, KV write, paged attention (over the layer's sliding window where it has one), output
 * matmul (+ bias, + RMSNorm where the architecture norms it), add + RMSNorm, gate/up matmul, SiLU- or GELU-and-
 * multiply, down matmul (+ RMSNorm likewise); then the final norm. At 135M
 * parameters a decode step is about 10 ms of arithmetic; run as PyTorch ops it also pays about 600 op
 * dispatches (5-8 us each) and the Python between them. Here only the kernels run, each with its own OpenMP
 * team.
 *
 * **One arithmetic per token.** Every kernel here computes a row from that row alone, in a fixed order: the
 * matmuls quantize each activation row on its own and sum its integer block products in block order
 * (quant_matmul.c, on VNNI or AMX tiles alike), the norms, rotary and SiLU work row by row, and attention
 * follows cpu_kernels.c's fixed partitions. So a token's K/V and logits are the same bits whether it was
 * computed in a decode step, a prefill chunk of any size, the one token a cached prompt recomputes, a
 * migrated stream's recompute or another worker's prefill, at any batch composition and thread count.
 *
 * The matmuls read the GGUF's quantized blocks; the residual stream, norms and rotary are float32; the KV
 * cache is float32 or bfloat16 with attention.py's layout (q and the attention output are rounded to it too),
 * or common.h's int8 or fp8 format (q and the attention output bfloat16). Every row's K/V is written before any row's
 * attention reads the cache, so a chunk's own keys are read back in the stored format, as a later step reads them.
 */
#include <stdlib.h>

#include "common.h"
#include "ss_kernels.h"

int32_t ss_abi_version(void) { return SS_ABI_VERSION; }

int64_t ss_struct_size(int which) {
    switch (which) {
        case 0: return (int64_t)sizeof(ss_layer);
        case 1: return (int64_t)sizeof(ss_model);
        case 2: return (int64_t)sizeof(ss_mixed);
        default: return -1;
    }
}

/* x [num_tokens, n_heads, head_dim] in place: rotate-half rotary at each token's position. */
static void rotary(float *x, int num_tokens, int num_heads, int head_dim, int64_t row_stride, const int64_t *pos,
                   const float *cos, const float *sin) {
    const int half = head_dim / 2;
    for (int t = 0; t < num_tokens; t++) {
        const float *c = cos + pos[t] * head_dim, *s = sin + pos[t] * head_dim;
        for (int h = 0; h < num_heads; h++) {
            float *v = x + t * row_stride + h * head_dim;
            for (int d = 0; d < half; d++) {
                const float a = v[d], b = v[d + half];
                v[d] = a * c[d] - b * s[d];
                v[d + half] = b * c[d + half] + a * s[d + half];
            }
        }
    }
}

/* y[t][i] += bias[i] for each of num_rows rows of n values, row_stride apart. */
static void add_bias(float *y, const float *bias, int num_rows, int64_t n, int64_t row_stride) {
    for (int t = 0; t < num_rows; t++)
        for (int64_t i = 0; i < n; i++) y[t * row_stride + i] += bias[i];
}

/* RMSNorm in place over each head of q (the first num_heads heads of a row) and of k (the next num_kv_heads). */
static void head_norms(float *qkv, int num_rows, int64_t row_stride, const ss_model *m, const float *q_norm,
                       const float *k_norm) {
    const int64_t nq = (int64_t)m->num_heads * m->head_dim;
    for (int t = 0; t < num_rows; t++) {
        float *row = qkv + t * row_stride;
        ss_add_rms_norm_f32(row, NULL, q_norm, row, m->num_heads, m->head_dim, m->eps, 1);
        ss_add_rms_norm_f32(row + nq, NULL, k_norm, row + nq, m->num_kv_heads, m->head_dim, m->eps, 1);
    }
}

/* x: [num_rows, hidden] float32 embeddings (overwritten); row r is the token at positions[r], whose K/V goes to
 * slots[r] and which attends to positions 0 .. lens[r] - 1 of the sequence with block table
 * tables[row_seq[r]] (tables[r] when row_seq is NULL); rows of one prefill chunk share a table and come in
 * position order. out: [num_rows, hidden], the final-normed hidden states. Returns 0; -1 for shapes the step
 * does not take (the caller falls back to the module path) or no memory. */
int ss_forward_step(const ss_model *m, float *x, int num_rows, const int64_t *positions, const int64_t *slots,
                    const int64_t *tables, int64_t max_blocks, const int64_t *row_seq, const int64_t *lens, float *out,
                    int num_threads) {
    const int64_t hd = m->hidden, nq = (int64_t)m->num_heads * m->head_dim, nkv = (int64_t)m->num_kv_heads * m->head_dim;
    const int64_t nqkv = nq + 2 * nkv, inter = m->intermediate, b = num_rows;
    for (int t = 0; t < num_rows; t++)
        if (positions[t] < 0 || positions[t] >= m->max_positions || slots[t] < 0 || slots[t] >= m->num_slots) return -1;
    const int64_t widest = nqkv > 2 * inter ? nqkv : 2 * inter;
    float *h = malloc(sizeof(float) * (size_t)(b * (hd + widest + inter + hd)));
    void *q_cache = malloc(sizeof(float) * (size_t)(b * nq * 2)); /* q and attention output in the cache dtype */
    const int64_t max_k = inter > nq ? inter : nq;
    void *scratch = malloc((size_t)(ss_act_block_bytes() * b * (max_k > hd ? max_k : hd) / 32));
    if (h == NULL || q_cache == NULL || scratch == NULL) {
        free(h), free(q_cache), free(scratch);
        return -1;
    }
    float *wide = h + b * hd, *act = wide + b * widest, *delta = act + b * inter;
    const int packed = m->kv_dtype == SS_INT8 || m->kv_dtype == SS_FP8;
    const int qdt = packed ? SS_BF16 : m->kv_dtype; /* q's and the attention output's dtype */
    const size_t elem = qdt == SS_BF16 ? 2 : 4;
    const int64_t cache_row = nkv, row_bytes = kv_int8_row_bytes(m->head_dim);
    const int64_t slot_bytes = packed ? m->num_kv_heads * row_bytes : nkv * (int64_t)elem;
    const size_t layer_bytes = (size_t)(m->num_slots * slot_bytes);
    int status = 0;
    for (int l = 0; l < m->num_layers && status == 0; l++) {
        const ss_layer *L = m->layers + l;
        uint8_t *k_cache = (uint8_t *)m->kv + (size_t)(2 * l) * layer_bytes;
        uint8_t *v_cache = k_cache + layer_bytes;
        ss_add_rms_norm_f32(x, l == 0 ? NULL : delta, L->input_norm, h, b, hd, m->eps, num_threads);
        status |= ss_quant_matmul(h, SS_F32, hd, b, hd, L->qkv, L->qkv_type, nqkv, wide, SS_F32, nqkv, scratch, num_threads);
        if (L->qkv_bias != NULL) add_bias(wide, L->qkv_bias, num_rows, nqkv, nqkv);
        if (L->q_norm != NULL && L->k_norm != NULL) head_norms(wide, num_rows, nqkv, m, L->q_norm, L->k_norm);
        rotary(wide, num_rows, m->num_heads + m->num_kv_heads, m->head_dim, nqkv, positions,
               L->cos != NULL ? L->cos : m->cos, L->sin != NULL ? L->sin : m->sin);
        for (int t = 0; t < num_rows; t++) { /* K/V to the cache, q to its dtype for attention */
            const float *row = wide + t * nqkv;
            if (packed) {
                for (int h = 0; h < m->num_kv_heads; h++) {
                    const int64_t at = slots[t] * slot_bytes + h * row_bytes;
                    ss_quantize_kv(row + nq + h * m->head_dim, 1, m->head_dim, m->kv_dtype, k_cache + at);
                    ss_quantize_kv(row + nq + nkv + h * m->head_dim, 1, m->head_dim, m->kv_dtype, v_cache + at);
                }
            } else {
                for (int64_t i = 0; i < nkv; i++) {
                    store_elem(k_cache, m->kv_dtype, slots[t] * cache_row + i, row[nq + i]);
                    store_elem(v_cache, m->kv_dtype, slots[t] * cache_row + i, row[nq + nkv + i]);
                }
            }
            for (int64_t i = 0; i < nq; i++) store_elem(q_cache, qdt, t * nq + i, row[i]);
        }
        void *attn_out = (uint8_t *)q_cache + (size_t)(b * nq) * elem;
        if (packed)
            status |= ss_paged_attention_packed(q_cache, nq, k_cache, v_cache, tables, max_blocks, row_seq, lens,
                                                attn_out, num_rows, m->num_heads, m->num_kv_heads, m->head_dim,
                                                m->block_size, m->scale, L->window, m->attn_softcap, num_threads, m->kv_dtype);
        else if (m->kv_dtype == SS_BF16)
            status |= ss_paged_attention_bf16(q_cache, nq, (const uint16_t *)k_cache, (const uint16_t *)v_cache, tables,
                                              max_blocks, row_seq, lens, attn_out, num_rows, m->num_heads,
                                              m->num_kv_heads, m->head_dim, m->block_size, m->scale, L->window, m->attn_softcap, num_threads);
        else
            status |= ss_paged_attention_f32(q_cache, nq, (const float *)k_cache, (const float *)v_cache, tables,
                                             max_blocks, row_seq, lens, attn_out, num_rows, m->num_heads,
                                             m->num_kv_heads, m->head_dim, m->block_size, m->scale, L->window, m->attn_softcap, num_threads);
        status |= ss_quant_matmul(attn_out, qdt, nq, b, nq, L->o, L->o_type, hd, delta, SS_F32, hd, scratch,
                                  num_threads);
        if (L->o_bias != NULL) add_bias(delta, L->o_bias, num_rows, hd, hd);
        if (L->attn_out_norm != NULL) ss_add_rms_norm_f32(delta, NULL, L->attn_out_norm, delta, b, hd, m->eps, num_threads);
        ss_add_rms_norm_f32(x, delta, L->post_norm, h, b, hd, m->eps, num_threads);
        status |= ss_quant_matmul(h, SS_F32, hd, b, hd, L->gate_up, L->gate_up_type, 2 * inter, wide, SS_F32,
                                  2 * inter, scratch, num_threads);
        if (m->activation == SS_ACT_GELU_TANH)
            ss_gelu_tanh_mul_f32(wide, 2 * inter, b, inter, act, num_threads);
        else
            ss_silu_mul_f32(wide, 2 * inter, b, inter, act, num_threads);
        status |= ss_quant_matmul(act, SS_F32, inter, b, inter, L->down, L->down_type, hd, delta, SS_F32, hd, scratch,
                                  num_threads);
        if (L->mlp_out_norm != NULL) ss_add_rms_norm_f32(delta, NULL, L->mlp_out_norm, delta, b, hd, m->eps, num_threads);
    }
    if (status == 0) ss_add_rms_norm_f32(x, delta, m->final_norm, out, b, hd, m->eps, num_threads);
    free(h), free(q_cache), free(scratch);
    return status == 0 ? 0 : -1;
}

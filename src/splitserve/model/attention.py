"""Paged attention over a flat KV cache: the contract between the model runner and the model.

The KV cache of one layer is two tensors ``k_cache`` and ``v_cache`` of shape
``[num_blocks * block_size, num_kv_heads, head_dim]``; the K/V of token position ``p`` of a request lives at
slot ``block_table[p // block_size] * block_size + p % block_size``. The runner builds one
``AttentionMetadata`` per step, shared by every layer.

A model with the GGUF's quantized blocks runs whole steps in the native forward step, whose attention reads
``AttentionMetadata.rows``: every token a query over its own context, computed the same way in a decode step
and in a prefill chunk. The module path (float models, and a fallback) reads the rest: decode attention in the
same native kernel, which reads each sequence's blocks in place, or where it is unavailable a padded gather and
SDPA; prefill attention in bfloat16 on AMX tiles where the CPU has them (``csrc/amx/attention.c``), and
elsewhere in PyTorch's fused (flash) SDPA over the chunk's gathered context.

Token order in a step: all decode tokens first (one query per sequence), then each prefill chunk's tokens
in the order of ``prefills``.

An int8 or fp8 cache (``--kv-cache-dtype``, ``model/kv_format.py``) holds rows of ``head_dim + head_dim / 16``
bytes; the native kernels read it in place, the PyTorch paths widen the gathered rows to the query's dtype.

A sliding-window layer (Mistral's, Gemma's alternate layers) passes its ``window``: a token at position ``p``
attends to positions ``p - window + 1 .. p`` (Hugging Face's and llama.cpp's rule); every path masks the rest. The
cache still holds the whole context for such layers. Gemma 2 passes a ``softcap``: each scaled score ``x`` becomes
``softcap * tanh(x / softcap)`` before the mask and the softmax; the PyTorch paths then compute the scores
themselves (SDPA has no such step), and the AMX tiles decline.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from splitserve.model import kv_format
from splitserve.model.kernels import native

# The soft-capped PyTorch path computes its float32 scores for this many query rows at a time: a whole 1,024-token
# chunk over an 8K context at 32 heads would be a 1 GiB matrix, several times over
SOFTCAP_QUERY_ROWS = 128


@dataclass(frozen=True, slots=True)
class ScoreRule:
    """How a layer forms its attention scores: ``scale`` times q.k, capped to ``softcap * tanh(x / softcap)`` where
    the layer caps them (Gemma 2), over the last ``window`` positions where it slides (None: the whole context)."""

    scale: float
    window: int | None = None
    softcap: float | None = None


@dataclass(slots=True)
class PrefillChunk:
    """A run of ``num_query_tokens`` new tokens of one sequence, attending causally to its whole context."""

    num_query_tokens: int
    context_slots: torch.Tensor  # [num_context_tokens] int64: slots of positions 0..end of this chunk
    num_context_tokens: int  # cached prefix + this chunk
    # [Q, C] additive causal masks over a cached prefix (0 where allowed, -inf elsewhere), by sliding window (None:
    # none), each built by the first layer that needs it
    allowed: dict[int | None, torch.Tensor] = field(default_factory=dict)
    as_decodes: DecodeBatch | None = None  # set for short chunks: each query runs as a decode of this sequence


@dataclass(slots=True)
class DecodeBatch:
    """The decode sequences of a step: one query each, attending to its whole context through its block table."""

    block_tables: torch.Tensor  # [B, max_blocks] int64, rows padded with 0 past a sequence's blocks
    context_lens: torch.Tensor  # [B] int64: tokens each query attends to, its own (just written) included
    block_size: int
    padded: tuple[torch.Tensor, torch.Tensor] | None = None  # the PyTorch path's slots and mask, built once

    def padded_slots(self, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Context slots [B, L_max] (padding points at real slots) and mask [B, 1, 1, L_max], True where real (and,
        with a sliding ``window``, within it)."""
        if self.padded is None:
            num_seqs = self.block_tables.shape[0]
            max_len = int(self.context_lens.max())
            offsets = torch.arange(self.block_size, device=self.block_tables.device)
            slots = (self.block_tables[:, :, None] * self.block_size + offsets).view(num_seqs, -1)[:, :max_len]
            mask = torch.arange(max_len, device=slots.device)[None, :] < self.context_lens[:, None]
            self.padded = slots.contiguous(), mask[:, None, None, :]
        slots, mask = self.padded
        if window is not None:
            positions = torch.arange(mask.shape[-1], device=mask.device)[None, :]
            mask = mask & (positions >= self.context_lens[:, None] - window)[:, None, None, :]
        return slots, mask


@dataclass(slots=True)
class StepRows:
    """Every token of a step as one query row over its own context: what the native forward step reads."""

    block_tables: torch.Tensor  # [S, max_blocks] int64: a table per scheduled sequence, rows padded with 0
    row_seq: torch.Tensor  # [T] int64: the table of each token
    context_lens: torch.Tensor  # [T] int64: the token attends to positions 0 .. len - 1, its own included


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each input token's K/V is written
    num_decode_tokens: int  # the first num_decode_tokens tokens are decodes, one per sequence
    decode: DecodeBatch | None  # present when num_decode_tokens > 0
    prefills: list[PrefillChunk]
    rows: StepRows | None = None  # the same step row by row (CPU), for the native forward step


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store the step's K/V ([T, kv_heads, head_dim]) at their slots."""
    if kv_format.is_packed(k_cache):
        k, v = _quantized(k, k_cache.dtype), _quantized(v, k_cache.dtype)
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)


def _quantized(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed rows of x, by the native kernel where there is one (the forward step's code), else in PyTorch."""
    kernels = native() if x.device.type == "cpu" else None
    x32 = x.float().contiguous()
    rows = kernels.quantize_kv(x32, dtype) if kernels is not None else None
    return rows if rows is not None else kv_format.quantize_rows(x32, dtype)


def _gathered(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cache rows at ``slots`` ([N, kv_heads, head_dim]) in ``dtype``."""
    rows = cache.index_select(0, slots)
    return kv_format.dequantize_rows(rows, dtype) if kv_format.is_packed(cache) else rows


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim], rotary already applied
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim], this step's K already written
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    rule: ScoreRule,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Attention of every query token over its sequence's cached context (its last ``window`` positions)."""
    parts = []
    nd = meta.num_decode_tokens
    if nd:
        assert meta.decode is not None
        parts.append(_decode_attention(q[:nd], k_cache, v_cache, meta.decode, rule))
    start = nd
    for chunk in meta.prefills:
        end = start + chunk.num_query_tokens
        parts.append(_prefill_attention(q[start:end], k_cache, v_cache, chunk, rule))
        start = end
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    decode: DecodeBatch,
    rule: ScoreRule,
) -> torch.Tensor:  # [B, H, D]
    kernels = native() if q.device.type == "cpu" else None
    if kernels is not None:
        out = kernels.paged_attention(
            q, k_cache, v_cache, decode.block_tables, decode.context_lens, decode.block_size, rule.scale,
            window=rule.window, softcap=rule.softcap,
        )  # fmt: skip
        if out is not None:
            return out
    return _decode_attention_torch(q, k_cache, v_cache, decode, rule)


def _decode_attention_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, decode: DecodeBatch, rule: ScoreRule
) -> torch.Tensor:
    """What the native kernel computes, in PyTorch: gather each context into a padded batch, then masked SDPA."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    slots, mask = decode.padded_slots(rule.window)
    # Grouped-query trick: the `group` query heads sharing a KV head act as `group` query rows.
    qd = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
    # index_select over the flattened table is ~2x faster than advanced indexing on CPU
    flat = slots.view(-1)
    kd = _gathered(k_cache, flat, q.dtype).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, L, D]
    vd = _gathered(v_cache, flat, q.dtype).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    od = _attention(qd, kd, vd, mask, rule)
    return od.reshape(num_seqs, num_heads, head_dim)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, rule: ScoreRule) -> torch.Tensor:
    """SDPA of q [..., H, Q, D] over k, v [..., Hkv, C, D] (H a multiple of Hkv) with ``mask`` (bool, True where
    allowed, or additive); with a soft cap, the same computed here, the scores capped before the mask."""
    group, softcap = q.shape[-3] // k.shape[-3], rule.softcap
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=rule.scale, enable_gqa=group > 1)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    kf, vf, parts = k.float().transpose(-1, -2), v.float(), []
    for start in range(0, q.shape[-2], SOFTCAP_QUERY_ROWS):  # a float32 score matrix of this many rows at a time
        rows = slice(start, start + SOFTCAP_QUERY_ROWS)
        part_mask = mask if mask.shape[-2] == 1 else mask[..., rows, :]
        scores = (q[..., rows, :].float() @ kf).mul_(rule.scale).div_(softcap).tanh_().mul_(softcap)
        scores = scores.masked_fill(~part_mask, float("-inf")) if mask.dtype == torch.bool else scores + part_mask
        parts.append(scores.softmax(-1) @ vf)
    return torch.cat(parts, dim=-2).to(q.dtype)


def _prefill_attention(
    q: torch.Tensor,  # [Q, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
    rule: ScoreRule,
) -> torch.Tensor:  # [Q, H, D]
    if chunk.as_decodes is not None:
        return _decode_attention(q, k_cache, v_cache, chunk.as_decodes, rule)
    window, scale = rule.window, rule.scale
    plain = window is None and rule.softcap is None
    kernels = native() if q.device.type == "cpu" and q.dtype == torch.bfloat16 and plain else None
    if kernels is not None:  # AMX tiles where the CPU has them (kernels.py: the amx build); None elsewhere
        out = kernels.prefill_attention(q, k_cache, v_cache, chunk.context_slots, scale)
        if out is not None:
            return out
    num_q, num_ctx = q.shape[0], chunk.num_context_tokens
    k = _gathered(k_cache, chunk.context_slots, q.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, C, D]
    v = _gathered(v_cache, chunk.context_slots, q.dtype).transpose(0, 1).unsqueeze(0)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
    # PyTorch's CPU flash kernel keeps scores in float32 tiles that stay in cache; unfused matmuls + softmax
    # stream a [H, Q, C] score matrix through memory and run 3-7x slower (benchmarks.md).
    if num_q == num_ctx and (window is None or window >= num_ctx) and rule.softcap is None:
        o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:  # query i sits at absolute position C - Q + i: it sees keys 0 (or C - Q + i - window + 1) .. C - Q + i
        # an additive mask in q's dtype: a bool one is converted on every call, 20-30% of a chunk's attention
        allowed = chunk.allowed.get(window)
        if allowed is None:
            keys = torch.arange(num_ctx, device=q.device)[None, :]
            positions = torch.arange(num_ctx - num_q, num_ctx, device=q.device)[:, None]
            seen = (keys <= positions) if window is None else (keys <= positions) & (keys > positions - window)
            allowed = torch.zeros((num_q, num_ctx), dtype=q.dtype, device=q.device).masked_fill_(~seen, float("-inf"))
            chunk.allowed[window] = allowed
        o = _attention(qh, k, v, allowed, rule)
    return o[0].transpose(0, 1)

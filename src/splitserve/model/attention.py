"""Paged attention over a flat KV cache: the contract between the model runner and the model.

The KV cache of one layer is two tensors ``k_cache`` and ``v_cache`` of shape
``[num_blocks * block_size, num_kv_heads, head_dim]``; the K/V of token position ``p`` of a request lives at
slot ``block_table[p // block_size] * block_size + p % block_size``. The runner builds one
``AttentionMetadata`` per step, shared by every layer.

Token order in a step: all decode tokens first (one query per sequence), then each prefill chunk's tokens
in the order of ``prefills``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillChunk:
    """A run of ``num_query_tokens`` new tokens of one sequence, attending causally to its whole context."""

    num_query_tokens: int
    context_slots: torch.Tensor  # [num_context_tokens] int64: slots of positions 0..end of this chunk
    num_context_tokens: int  # cached prefix + this chunk
    blocked: torch.Tensor | None = None  # [group * Q, C] bool, built once per step by ``causal_blocked``


def causal_blocked(num_query: int, num_context: int, group: int, device: torch.device) -> torch.Tensor:
    """[group * Q, C] bool, True where query i (absolute position C - Q + i) must not see a key (the future).

    Rows are repeated ``group`` times because the query heads sharing a KV head are stacked along the
    query axis (see ``_prefill_attention``).
    """
    blocked = torch.ones(num_query, num_context, dtype=torch.bool, device=device).triu_(num_context - num_query + 1)
    return blocked.repeat(group, 1)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each input token's K/V is written
    num_decode_tokens: int  # the first num_decode_tokens tokens are decodes, one per sequence
    decode_slots: torch.Tensor | None  # [B, max_context] int64 context slots per decode sequence, padded
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_context] bool: True where a context slot is real
    prefills: list[PrefillChunk]


def token_slots(block_ids: Sequence[int], positions: Iterable[int], block_size: int) -> list[int]:
    """The KV slot of each token position of a request whose block table is ``block_ids``."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in positions]


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store the step's K/V ([T, kv_heads, head_dim]) at their slots."""
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim], rotary already applied
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim], this step's K already written
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Attention of every query token over its sequence's cached context."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    parts = []
    nd = meta.num_decode_tokens
    if nd:
        assert meta.decode_slots is not None and meta.decode_mask is not None
        # Grouped-query trick: the `group` query heads sharing a KV head act as `group` query rows.
        qd = q[:nd].view(nd, num_kv_heads, group, head_dim)  # [B, Hkv, G, D]
        # index_select over the flattened table is ~2x faster than advanced indexing on CPU
        slots = meta.decode_slots.view(-1)
        kd = k_cache.index_select(0, slots).view(nd, -1, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, L, D]
        vd = v_cache.index_select(0, slots).view(nd, -1, num_kv_heads, head_dim).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        parts.append(od.view(nd, num_heads, head_dim))
    start = nd
    for chunk in meta.prefills:
        end = start + chunk.num_query_tokens
        parts.append(_prefill_attention(q[start:end], k_cache, v_cache, chunk, group, scale))
        start = end
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _prefill_attention(
    q: torch.Tensor,  # [Q, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
    group: int,
    scale: float,
) -> torch.Tensor:  # [Q, H, D]
    num_q, num_heads, head_dim = q.shape
    num_ctx = chunk.num_context_tokens
    num_kv_heads = num_heads // group
    k = k_cache.index_select(0, chunk.context_slots).transpose(0, 1)  # [Hkv, C, D]
    v = v_cache.index_select(0, chunk.context_slots).transpose(0, 1)
    # [Hkv, G*Q, D]: the group's query heads stacked along the query axis
    qg = q.view(num_q, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, group * num_q, head_dim)
    blocked = chunk.blocked if chunk.blocked is not None else causal_blocked(num_q, num_ctx, group, q.device)
    # Plain float32 matmuls + softmax: on CPU about 1.5x faster than bfloat16 SDPA at prefill shapes
    # (1024 x 2500: 107 ms against 168 ms per layer), and scores are never rounded to bfloat16.
    scores = torch.bmm(qg.float(), k.float().transpose(1, 2)).mul_(scale)  # [Hkv, G*Q, C]
    scores.masked_fill_(blocked, float("-inf"))
    o = torch.bmm(scores.softmax(dim=-1), v.float()).to(q.dtype)  # [Hkv, G*Q, D]
    return o.view(num_kv_heads, group, num_q, head_dim).permute(2, 0, 1, 3).reshape(num_q, num_heads, head_dim)

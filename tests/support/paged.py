"""Our model driven step by step over a paged KV cache with block size 1: one prefill chunk, then one decode token
per step, the way ``ModelRunner`` lays out a step's metadata; and greedy decoding on it, and on a transformers
model with its own KV cache."""

from __future__ import annotations

import torch
import transformers

from splitserve.model.attention import AttentionMetadata, DecodeBatch, PrefillChunk, StepRows
from splitserve.model.decoder import DecoderForCausalLM


class PagedRunner:
    """Drives our model: one prefill chunk, then one decode token per step, slots 0..n.

    ``kv_dtype`` set: the cache is one tensor in that dtype, bound to the model as ``ModelRunner`` binds it, so a
    model with quantized weights runs its steps in the native forward step; otherwise per-layer float32
    caches and the module path.
    """

    def __init__(self, model: DecoderForCausalLM, num_slots: int, kv_dtype: torch.dtype | None = None) -> None:
        cfg = model.config
        shape = (cfg.num_hidden_layers, 2, num_slots, cfg.num_key_value_heads, cfg.head_dim)
        self.model = model
        cache = torch.zeros(shape, dtype=kv_dtype or torch.float32)
        self.kv = [(layer[0], layer[1]) for layer in cache]
        if kv_dtype is not None:
            model.bind_kv_cache(cache, block_size=1)
        self.slots = torch.arange(num_slots)
        self.num_tokens = 0

    def prefill(self, ids: list[int]) -> torch.Tensor:  # [n, vocab]
        n = len(ids)
        meta = AttentionMetadata(self.slots[:n], 0, None, [PrefillChunk(n, self.slots[:n], n)])
        # block size 1: the block table is the slot list
        meta.rows = StepRows(
            self.slots[None, :n].contiguous(), torch.zeros(n, dtype=torch.long), torch.arange(1, n + 1)
        )
        self.num_tokens = n
        return self.model.compute_logits(self.model(torch.tensor(ids), torch.arange(n), self.kv, meta))

    def decode(self, token: int) -> torch.Tensor:  # [vocab]
        p = self.num_tokens
        decode = DecodeBatch(self.slots[None, : p + 1].contiguous(), torch.tensor([p + 1]), block_size=1)
        meta = AttentionMetadata(self.slots[p : p + 1], 1, decode, [])
        meta.rows = StepRows(decode.block_tables, torch.zeros(1, dtype=torch.long), decode.context_lens)
        self.num_tokens += 1
        return self.model.compute_logits(self.model(torch.tensor([token]), torch.tensor([p]), self.kv, meta))[0]


def greedy(model: DecoderForCausalLM, ids: list[int], steps: int, kv_dtype: torch.dtype | None = None) -> list[int]:
    """``steps`` greedy tokens after ``ids``."""
    runner = PagedRunner(model, len(ids) + steps, kv_dtype)
    out = [int(runner.prefill(ids)[-1].argmax())]
    while len(out) < steps:
        out.append(int(runner.decode(out[-1]).argmax()))
    return out


@torch.no_grad()
def hf_greedy(hf: transformers.PreTrainedModel, ids: list[int], steps: int) -> list[int]:
    """``steps`` greedy tokens after ``ids`` from a transformers model, through its KV cache."""
    result = hf(torch.tensor([ids]), use_cache=True)
    out = [int(result.logits[0, -1].argmax())]
    while len(out) < steps:
        result = hf(torch.tensor([[out[-1]]]), past_key_values=result.past_key_values, use_cache=True)
        out.append(int(result.logits[0, -1].argmax()))
    return out

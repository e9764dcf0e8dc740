"""Owns the model and its paged KV cache; turns a ``SchedulerOutput`` into one forward pass and tokens."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from splitserve.engine.sampler import Sampler
from splitserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from splitserve.model.attention import AttentionMetadata, DecodeBatch, PrefillChunk, token_slots
from splitserve.model.kernels import native
from splitserve.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [N] token index whose logits pick each sampled request's next token
    sampled: list[ScheduledRequest]  # the N requests that sample this step, in sample_indices order


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, num_blocks: int, block_size: int, device: torch.device, seed: int = 0
    ) -> None:
        cfg = model.config
        if device.type == "cpu":
            native()  # build (or load) the CPU kernels now, not in the first request's step
        model.prepare_for_inference()
        self.model = model
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = model.dtype
        # [layers, 2, slots, kv_heads, head_dim]; zeros so padded gathers never read NaN garbage
        self.kv_cache = torch.zeros(
            cfg.num_hidden_layers,
            2,
            num_blocks * block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            dtype=self.dtype,
            device=device,
        )
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_cache]
        model.bind_kv_cache(self.kv_cache, block_size)
        self.sampler = Sampler(seed)
        self._offsets = torch.arange(block_size, device=device)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> dict[str, int]:
        """Run one forward pass over the scheduled tokens; returns request_id -> sampled token id."""
        inputs = self.prepare(sched)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        if not inputs.sampled:
            return {}
        logits = self.model.compute_logits(hidden[inputs.sample_indices])
        tokens = self.sampler(logits, [s.request for s in inputs.sampled])
        return {s.request.request_id: t for s, t in zip(inputs.sampled, tokens, strict=True)}

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        """Flatten the step's tokens: decodes (one new token) first, then prefill chunks."""
        decodes = [s for s in sched.scheduled if s.num_new_tokens == 1]
        prefills = [s for s in sched.scheduled if s.num_new_tokens > 1]
        token_ids: list[int] = []
        positions: list[int] = []
        for s in decodes + prefills:
            start = s.request.num_computed_tokens
            token_ids.extend(s.request.all_token_ids[start : start + s.num_new_tokens])
            positions.extend(range(start, start + s.num_new_tokens))
        slot_mapping = self._slots_for(decodes + prefills, positions)
        meta = AttentionMetadata(slot_mapping, len(decodes), self._decode_batch(decodes) if decodes else None, [])
        # a one-token step is a decode for attention, but it samples only if it ends the prompt: it may be
        # a one-token prefill chunk (the budget had one token left)
        sample_indices = [i for i, s in enumerate(decodes) if s.completes_prompt]
        sampled = [s for s in decodes if s.completes_prompt]
        offset = len(decodes)
        for s in prefills:
            num_ctx = s.request.num_computed_tokens + s.num_new_tokens
            context_slots = self._context_slots(s.block_ids, num_ctx)
            meta.prefills.append(PrefillChunk(s.num_new_tokens, context_slots, num_ctx))
            offset += s.num_new_tokens
            if s.completes_prompt:
                sample_indices.append(offset - 1)
                sampled.append(s)
        return StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            meta=meta,
            sample_indices=torch.tensor(sample_indices, dtype=torch.long, device=self.device),
            sampled=sampled,
        )

    def _slots_for(self, scheduled: list[ScheduledRequest], positions: list[int]) -> torch.Tensor:
        """The KV slot of every input token: its block (from the request's table) and offset in it."""
        slots: list[int] = []
        start = 0
        for s in scheduled:
            slots.extend(token_slots(s.block_ids, positions[start : start + s.num_new_tokens], self.block_size))
            start += s.num_new_tokens
        return torch.tensor(slots, dtype=torch.long, device=self.device)

    def _context_slots(self, block_ids: list[int], num_ctx: int) -> torch.Tensor:
        num_blocks = -(-num_ctx // self.block_size)
        table = torch.tensor(block_ids[:num_blocks], dtype=torch.long, device=self.device)
        return (table[:, None] * self.block_size + self._offsets).flatten()[:num_ctx]

    def _decode_batch(self, decodes: list[ScheduledRequest]) -> DecodeBatch:
        """Block tables [B, max_blocks] (padded with 0) and context lengths of the decode sequences."""
        lengths = [s.request.num_computed_tokens + 1 for s in decodes]
        max_blocks = -(-max(lengths) // self.block_size)
        rows = [s.block_ids[:max_blocks] for s in decodes]
        table = torch.tensor([row + [0] * (max_blocks - len(row)) for row in rows], dtype=torch.long)
        lens = torch.tensor(lengths, dtype=torch.long)
        return DecodeBatch(table.to(self.device), lens.to(self.device), self.block_size)

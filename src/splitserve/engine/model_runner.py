"""Owns the model and its paged KV cache; turns a ``SchedulerOutput`` into one forward pass and tokens.

Before the pass it makes the step's copies into the cache: cached tail blocks, then the KV connectors' loads
(``KVLoad``, each by its source connector, from memory). A request whose load came up short is left out of the
pass; the engine rolls it back (``Scheduler.finish_loads``).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from splitserve.engine.connector import KVLoad, LoadedTokens, token_slots
from splitserve.engine.outputs import TokenLogprobs
from splitserve.engine.sampler import Sampler, gather_logprobs
from splitserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from splitserve.engine.speculative import accept
from splitserve.engine.structured import TokenMasks
from splitserve.model import kv_format
from splitserve.model.attention import AttentionMetadata, DecodeBatch, PrefillChunk, StepRows
from splitserve.model.decoder import DecoderForCausalLM
from splitserve.model.kernels import native

logger = logging.getLogger(__name__)

# A prefill chunk of at most this many tokens over a longer context (the tail of a cached prompt) runs its
# attention in the native decode kernel, query by query, reading the blocks in place: at 3,000 tokens of
# context it takes 0.15 ms per layer for one query against 0.85 ms for SDPA with its gather; they meet near 8.
SHORT_CHUNK_TOKENS = 4
PROMPT_LOGITS_ROWS = 256  # prompt logprobs: the logits of this many positions at a time ([rows, vocab] float32)


def _is_decode(s: ScheduledRequest) -> bool:
    """One new token, and not a prompt token whose sample counts: those run in float, like any prefill."""
    if s.num_new_tokens != 1:
        return False
    request = s.request
    if request.num_computed_tokens >= request.num_prompt_tokens:
        return True  # an output token, or one recomputed after a preemption
    transfer = request.params.kv_transfer
    return transfer is not None and transfer.first_token_id is not None  # the sample is replaced anyway


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [N] token index whose logits pick each sampled token
    # the N draws, in sample_indices order: the request, and how many tokens past its next one the draw is (a
    # verification step draws after its last token and after each of its drafts)
    sampled: list[tuple[ScheduledRequest, int]]
    # params.prompt_logprobs: the token index of each prompt position whose next token's logprobs are gathered,
    # and for each, its request and the position
    prompt_indices: list[int] = field(default_factory=list)
    prompt_rows: list[tuple[ScheduledRequest, int]] = field(default_factory=list)


@dataclass(slots=True)
class RunnerOutput:
    """What one ``execute`` did: the tokens sampled, and what each KV load copied."""

    sampled: dict[str, list[int]] = field(default_factory=dict)  # request id -> its new tokens (drafts verified)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # their logprobs, if the request asks
    # params.prompt_logprobs: request id -> the entries of the prompt positions computed this step, in order
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    loaded: dict[str, LoadedTokens] = field(default_factory=dict)  # request id -> its load's result
    skipped: set[str] = field(default_factory=set)  # requests left out of the pass: their load came up short


class ModelRunner:
    def __init__(
        self,
        model: DecoderForCausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        seed: int = 0,
        kv_dtype: torch.dtype | None = None,  # the cache's (model/kv_format.py); None: the model's dtype
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
        self.kv_dtype = kv_dtype or self.dtype
        kv_format.check_head_dim(self.kv_dtype, cfg.head_dim)
        # [layers, 2, slots, kv_heads, row] (row: head_dim values, or int8's head_dim + head_dim / 16 bytes);
        # zeros so padded gathers never read NaN garbage. Written whole here: a cache from calloc, its pages faulted
        # in as first used, cost 2.7x the cold prefill's time and 42% of 16 streams' throughput on a 2-core VM (faults
        # inside the step's parallel kernels)
        self.kv_cache = torch.zeros(
            cfg.num_hidden_layers,
            2,
            num_blocks * block_size,
            cfg.num_key_value_heads,
            kv_format.row_width(self.kv_dtype, cfg.head_dim),
            dtype=self.kv_dtype,
            device=device,
        )
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_cache]
        model.bind_kv_cache(self.kv_cache, block_size)
        self.sampler = Sampler(seed)
        self._mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        self._offsets = torch.arange(block_size, device=device)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Copy the step's blocks and KV loads into the cache, then run one forward pass over the scheduled
        tokens of every request whose load (if any) is complete, and sample."""
        if sched.block_copies:
            self._copy_blocks(sched.block_copies)
        out = RunnerOutput(loaded=self._load_kv(sched.kv_loads))
        for load in sched.kv_loads:
            if not load.is_complete(out.loaded[load.request.request_id]):
                out.skipped.add(load.request.request_id)  # its context is not all there: no pass, no sample
        scheduled = [s for s in sched.scheduled if s.request.request_id not in out.skipped]
        if not scheduled:
            return out
        inputs = self.prepare(scheduled)
        masks = self._start_masks(inputs)  # computed while the forward pass runs
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        if inputs.prompt_rows:
            self._prompt_logprobs(hidden, inputs, out)
        if inputs.sampled:
            logits = self.model.compute_logits(hidden[inputs.sample_indices])
            requests = [s.request for s, _ in inputs.sampled]
            drafts = [s.draft_token_ids[:j] for s, j in inputs.sampled]
            bitmasks = masks.result() if masks is not None else None
            draws = self.sampler(logits, requests, [j for _, j in inputs.sampled], drafts, bitmasks)
            drawn: dict[str, list[int]] = {}
            logprobs: dict[str, list[TokenLogprobs | None]] = {}
            for (s, _), token, entry in zip(inputs.sampled, draws.tokens, draws.logprobs, strict=True):
                drawn.setdefault(s.request.request_id, []).append(token)
                logprobs.setdefault(s.request.request_id, []).append(entry)
            for s, j in inputs.sampled:
                if j == 0:
                    rid = s.request.request_id
                    kept = accept(s.draft_token_ids, drawn[rid]) if s.draft_token_ids else drawn[rid]
                    out.sampled[rid] = kept
                    if s.request.params.logprobs is not None:
                        out.logprobs[rid] = [e for e in logprobs[rid][: len(kept)] if e is not None]
        return out

    def _start_masks(self, inputs: StepInputs) -> Future[TokenMasks] | None:
        """The masks of the step's constrained draws, made on the mask thread; None when no draw is constrained.
        Each grammar is where the tokens so far left it (the engine consumed them)."""
        rows = [(k, s.request.grammar) for k, (s, _) in enumerate(inputs.sampled) if s.request.grammar is not None]
        if not rows:
            return None
        vocab_size = self.model.config.vocab_size

        def fill() -> TokenMasks:
            bitmasks = torch.zeros((len(rows), (vocab_size + 31) // 32), dtype=torch.int32)
            for row, (_, grammar) in zip(bitmasks, rows, strict=True):
                grammar.fill_mask(row)
            return TokenMasks.from_bitmasks([k for k, _ in rows], bitmasks, vocab_size)

        return self._mask_thread.submit(fill)

    def _prompt_logprobs(self, hidden: torch.Tensor, inputs: StepInputs, out: RunnerOutput) -> None:
        """Each prompt position's logits, a slice of positions at a time, and its next prompt token's logprobs."""
        for start in range(0, len(inputs.prompt_rows), PROMPT_LOGITS_ROWS):
            rows = inputs.prompt_rows[start : start + PROMPT_LOGITS_ROWS]
            indices = torch.tensor(inputs.prompt_indices[start : start + PROMPT_LOGITS_ROWS], device=self.device)
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[indices]).float().cpu(), dim=-1)
            next_ids = torch.tensor([s.request.prompt_token_ids[p + 1] for s, p in rows])
            ks = [s.request.params.prompt_logprobs or 0 for s, _ in rows]
            for (s, _), entry in zip(rows, gather_logprobs(logprobs, next_ids, ks), strict=True):
                out.prompt_logprobs.setdefault(s.request.request_id, []).append(entry)

    def _load_kv(self, loads: list[KVLoad]) -> dict[str, LoadedTokens]:
        """Each load by its source connector; one that raises loaded nothing (a bug there never kills the engine)."""
        loaded: dict[str, LoadedTokens] = {}
        for load in loads:
            request_id = load.request.request_id
            try:
                loaded[request_id] = load.source.load_kv(load)
            except Exception:
                logger.exception("KV load of %s from %s failed; computing it instead", request_id,
                                 type(load.source).__name__)  # fmt: skip
                loaded[request_id] = LoadedTokens()
        return loaded

    def prepare(self, scheduled: list[ScheduledRequest]) -> StepInputs:
        """Flatten the step's tokens: decodes (one new token) first, then prefill chunks."""
        decodes: list[ScheduledRequest] = []
        prefills: list[ScheduledRequest] = []
        for s in scheduled:
            (decodes if _is_decode(s) else prefills).append(s)
        token_ids: list[int] = []
        positions: list[int] = []
        for s in decodes + prefills:
            start = s.request.num_computed_tokens
            token_ids.extend(s.token_ids)
            positions.extend(range(start, start + s.num_new_tokens))
        slot_mapping = self._slots_for(decodes + prefills, positions)
        meta = AttentionMetadata(slot_mapping, len(decodes), self._decode_batch(decodes) if decodes else None, [])
        # a decode samples only if it has caught up: it may be recomputing outputs after a preemption
        sample_indices = [i for i, s in enumerate(decodes) if s.completes_prompt]
        sampled = [(s, 0) for s in decodes if s.completes_prompt]
        offset = len(decodes)
        prompt_indices: list[int] = []
        prompt_rows: list[tuple[ScheduledRequest, int]] = []
        for s in prefills:
            if s.request.params.prompt_logprobs is not None:  # positions not gathered yet, before the last
                first = s.request.num_computed_tokens
                end = min(first + s.num_new_tokens, s.request.num_prompt_tokens - 1)
                positions_left = range(max(first, len(s.request.prompt_logprobs)), end)
                prompt_indices.extend(offset + p - first for p in positions_left)
                prompt_rows.extend((s, p) for p in positions_left)
            num_ctx = s.request.num_computed_tokens + s.num_new_tokens
            context_slots = self._context_slots(s.block_ids, num_ctx)
            chunk = PrefillChunk(s.num_new_tokens, context_slots, num_ctx)
            if s.num_new_tokens <= SHORT_CHUNK_TOKENS < num_ctx and self.device.type == "cpu":
                chunk.as_decodes = self._chunk_as_decodes(s.block_ids, s.request.num_computed_tokens, num_ctx)
            meta.prefills.append(chunk)
            offset += s.num_new_tokens
            if s.completes_prompt:  # the last token's draw, then one after each draft
                num_draws = 1 + len(s.draft_token_ids)
                sample_indices.extend(range(offset - num_draws, offset))
                sampled.extend((s, j) for j in range(num_draws))
        position_ids = torch.tensor(positions, dtype=torch.long, device=self.device)
        if self.model.runs_forward_step:
            meta.rows = self._step_rows(decodes + prefills, meta.decode if not prefills else None, position_ids)
        return StepInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.long, device=self.device),
            positions=position_ids,
            meta=meta,
            sample_indices=torch.tensor(sample_indices, dtype=torch.long, device=self.device),
            sampled=sampled,
            prompt_indices=prompt_indices,
            prompt_rows=prompt_rows,
        )

    def _step_rows(
        self, scheduled: list[ScheduledRequest], decode: DecodeBatch | None, positions: torch.Tensor
    ) -> StepRows:
        """The step row by row: each token's block table (its request's) and context (itself and before)."""
        if decode is not None:  # decodes only: one row per sequence, tables as the decode batch has them
            return StepRows(decode.block_tables, torch.arange(len(scheduled)), decode.context_lens)
        ends = [s.request.num_computed_tokens + s.num_new_tokens for s in scheduled]
        max_blocks = -(-max(ends) // self.block_size)
        tables = []
        for s, end in zip(scheduled, ends, strict=True):
            row = s.block_ids[: -(-end // self.block_size)]
            tables.append(row + [0] * (max_blocks - len(row)))
        counts = torch.tensor([s.num_new_tokens for s in scheduled])
        row_seq = torch.repeat_interleave(torch.arange(len(scheduled)), counts)
        return StepRows(torch.tensor(tables, dtype=torch.long), row_seq, positions + 1)

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

    def _chunk_as_decodes(self, block_ids: list[int], start: int, num_ctx: int) -> DecodeBatch:
        """A short chunk's queries as decodes of one sequence: query i sees positions 0 .. start + i."""
        num_blocks = -(-num_ctx // self.block_size)
        table = torch.tensor(block_ids[:num_blocks], dtype=torch.long).expand(num_ctx - start, -1).contiguous()
        return DecodeBatch(table, torch.arange(start + 1, num_ctx + 1, dtype=torch.long), self.block_size)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (every layer, K and V) from source to destination block ids."""
        bs = self.block_size
        for src, dst in copies:
            self.kv_cache[:, :, dst * bs : (dst + 1) * bs] = self.kv_cache[:, :, src * bs : (src + 1) * bs]

    def _decode_batch(self, decodes: list[ScheduledRequest]) -> DecodeBatch:
        """Block tables [B, max_blocks] (padded with 0) and context lengths of the decode sequences."""
        lengths = [s.request.num_computed_tokens + 1 for s in decodes]
        max_blocks = -(-max(lengths) // self.block_size)
        rows = [s.block_ids[:max_blocks] for s in decodes]
        table = torch.tensor([row + [0] * (max_blocks - len(row)) for row in rows], dtype=torch.long)
        lens = torch.tensor(lengths, dtype=torch.long)
        return DecodeBatch(table.to(self.device), lens.to(self.device), self.block_size)

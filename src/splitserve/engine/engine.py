"""The engine: admit requests, run scheduler + model steps, and turn sampled tokens into outputs.

Not thread-safe: every method must be called from one thread (``AsyncEngine`` owns that thread).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from splitserve.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from splitserve.engine.block_pool import BlockPool
from splitserve.engine.connector import KVConnectorBase, KVReceiverLike
from splitserve.engine.detokenizer import IncrementalDetokenizer
from splitserve.engine.kv_cache_manager import KVCacheManager
from splitserve.engine.model_runner import ModelRunner, RunnerOutput
from splitserve.engine.outputs import FinishReason, RequestOutput
from splitserve.engine.request import Request
from splitserve.engine.sampling_params import SamplingParams, StructuredOutput
from splitserve.engine.scheduler import Scheduler, SchedulerOutput
from splitserve.engine.speculative import NgramProposer, SpecStats
from splitserve.engine.structured import Grammar, GrammarCompiler
from splitserve.engine.verifier import ExactnessVerifier
from splitserve.keys import kv_layout
from splitserve.metrics import (
    ITERATION_TOKENS_BUCKETS,
    CumulativeHistogram,
    KVCacheStatsLike,
    PDBufferStatsLike,
    RequestPhases,
)
from splitserve.model import kv_format
from splitserve.model.config import DecoderConfig
from splitserve.model.decoder import DecoderForCausalLM
from splitserve.policy.admission import Backlog
from splitserve.protocol.kv_events import BlockContentSink, KVEventSink, Tier

if TYPE_CHECKING:
    from splitserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# what a step's activations and logits take beside the weights and the KV cache, on CPU
ACTIVATION_HEADROOM_BYTES = 512 << 20
FETCH_POLL_S = 0.002  # when nothing can run until a connector's fetch completes, step again after this


@dataclass(slots=True)
class EngineStats:
    """A snapshot of the engine's state and counters (cumulative since start) for the metrics."""

    num_running: int
    num_waiting: int
    num_waiting_deferred: int  # of the waiting, passed over by the last admission: their KV is being fetched
    kv_cache_usage: float  # fraction of KV blocks in use, 0..1
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache (at first admission)
    prefix_cache_hits: int  # prompt tokens found there
    external_prefix_cache_queries: int  # tokens past that match asked of the KV connectors
    external_prefix_cache_hits: int  # tokens they loaded
    cached_tokens_by_source: dict[str, int]  # prefix_cache_hits + external_prefix_cache_hits, by source
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    iteration_tokens: CumulativeHistogram  # tokens computed per step
    kv_cache: KVCacheStatsLike | None = None  # the KV connector's counters (L1/L2 tiers), if it has one
    pd_buffer: PDBufferStatsLike | None = None  # decode role: the PD buffer's state
    # --verify-sample-rate: requests recomputed cold and compared, and those that differed, by path
    exactness_checks: dict[str, int] = dataclasses.field(default_factory=dict)
    exactness_mismatches: dict[str, int] = dataclasses.field(default_factory=dict)
    spec_decode: SpecStats | None = None  # --speculative-config: drafts computed and kept
    backlog: Backlog = dataclasses.field(default_factory=Backlog)  # what a new request would find ahead of it


def _block_cache(
    num_blocks: int, block_size: int, prefix_caching: bool, events: KVEventSink | None
) -> tuple[BlockPool, KVCacheManager]:
    """The block pool and its manager, telling ``events`` each block hash the prefix cache starts or stops
    holding (and, for a ``BlockContentSink``, the tokens behind them, for vLLM-format events)."""
    pool = BlockPool(num_blocks, prefix_caching)
    if events is not None:
        pool.on_cache = lambda block_hash: events.stored(Tier.ENGINE, (block_hash,))
        pool.on_evict = lambda block_hash: events.removed(Tier.ENGINE, (block_hash,))
    kv = KVCacheManager(pool, block_size)
    if isinstance(events, BlockContentSink):
        kv.on_blocks_cached = events.blocks_cached
    return pool, kv


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model: DecoderForCausalLM,
        tokenizer: Tokenizer | None,
        model_name: str,
        device: torch.device,
        connectors: Sequence[KVConnectorBase] = (),
        events: KVEventSink | None = None,
        kv_receiver: KVReceiverLike | None = None,
    ) -> None:
        """Build the engine around a loaded model; ``connectors`` load and save KV outside the engine (asked in
        this order at admission: the first to offer KV for a request is its source).

        ``events`` is told each block hash the prefix cache starts or stops holding (the ``engine`` tier), and
        the tokens behind them when it is a ``BlockContentSink``.
        ``kv_receiver`` (decode role) is the listener prefill workers push KV to; the engine reports it and
        closes it. ``splitserve.worker.build`` puts these parts together from a config.
        """
        config.validate()
        self.config = config
        self.model_name = model_name
        self.tokenizer = tokenizer
        model_cfg = model.config
        self.vocab_size = model_cfg.vocab_size
        self.max_model_len = _max_model_len(config.model.max_model_len, model_cfg)
        block_size = config.cache.block_size
        num_blocks = self._num_blocks(config, model, device)
        sched_cfg = config.scheduler
        if not sched_cfg.enable_chunked_prefill and sched_cfg.max_num_batched_tokens < self.max_model_len:
            # without chunking a whole prompt must fit in one step
            sched_cfg = dataclasses.replace(sched_cfg, max_num_batched_tokens=self.max_model_len)
        self.pool, self.kv = _block_cache(num_blocks, block_size, config.cache.enable_prefix_caching, events)
        self.connectors = tuple(connectors)
        self.scheduler = Scheduler(sched_cfg, self.kv, self.max_model_len, self.connectors)
        kv_dtype = kv_format.cache_dtype(config.cache.kv_cache_dtype, model.dtype)
        self.runner = ModelRunner(model, num_blocks, block_size, device, config.model.seed, kv_dtype)
        for connector in self.connectors:
            connector.register_kv_cache(self.runner.kv_cache, block_size)
        self.eos_token_ids = _eos_ids(tokenizer, model)
        self.grammars = GrammarCompiler.for_tokenizer(tokenizer, self.vocab_size) if tokenizer is not None else None
        self.requests: dict[str, Request] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}  # requests with a tokenizer: text and stops
        self.kv_receiver = kv_receiver
        rate = sched_cfg.verify_sample_rate
        self.verifier = ExactnessVerifier(rate) if rate > 0 else None
        spec = sched_cfg.speculative_config
        self.proposer = NgramProposer(spec) if spec is not None else None
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.iteration_tokens = CumulativeHistogram(tuple(map(float, ITERATION_TOKENS_BUCKETS)))
        logger.info(
            "engine ready: %d KV blocks of %d tokens (%d tokens, %.2f GiB), max_model_len %d, dtype %s, device %s, "
            "KV cache %s",
            num_blocks, block_size, num_blocks * block_size,
            self.runner.kv_cache.numel() * self.runner.kv_cache.element_size() / 2**30,
            self.max_model_len, self.runner.dtype, device, kv_format.layout_name(self.runner.kv_dtype),
        )  # fmt: skip

    @property
    def kv_capacity_tokens(self) -> int:
        """The tokens the KV cache holds."""
        return self.pool.num_blocks * self.kv.block_size

    def _num_blocks(self, config: EngineConfig, model: DecoderForCausalLM, device: torch.device) -> int:
        """The KV cache's blocks: the override, else what the memory budget holds; at least one longest request."""
        block_size = config.cache.block_size
        num_blocks = config.cache.num_gpu_blocks_override or num_kv_blocks(config, model, device)
        if num_blocks * block_size < self.max_model_len:
            memory = "" if device.type != "cpu" else f" ({_gib(available_memory_bytes())} of memory available)"
            raise ValueError(
                f"the KV cache holds {num_blocks * block_size} tokens, fewer than --max-model-len "
                f"({self.max_model_len}){memory}; raise --kv-cache-memory or lower --max-model-len"
            )
        return num_blocks

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request. Raises ``ValueError`` for a client mistake (nothing is queued then)."""
        self._check_new_request(request_id, prompt_token_ids, params)
        request = Request(request_id, list(prompt_token_ids), params, time.monotonic(), self.eos_token_ids)
        request.grammar = self._grammar_for(request)
        if self.tokenizer is not None:
            stop, include = params.stop, params.include_stop_str_in_output
            resumed = params.resumed_prompt_tokens
            if params.replay_output and resumed:
                prompt, output = prompt_token_ids[:resumed], prompt_token_ids[resumed:]
                detok = IncrementalDetokenizer.replayed(self.tokenizer, stop, include, prompt, output)
            else:
                detok = IncrementalDetokenizer(self.tokenizer, stop, include, prompt_token_ids)
            self._detokenizers[request_id] = detok
        self.requests[request_id] = request
        self.scheduler.add(request)

    def check_structured(self, spec: StructuredOutput) -> None:
        """Compile a structured-output spec ahead of its request (any thread); ``ValueError`` when it is invalid."""
        if self.grammars is None:
            raise ValueError("structured outputs need the model's tokenizer")
        self.grammars.check(spec)

    def _grammar_for(self, request: Request) -> Grammar | None:
        """A request's place in its grammar: at the start, or past the tokens a resumed request made before."""
        spec = request.params.structured
        if spec is None:
            return None
        if self.grammars is None:
            raise ValueError("structured outputs need the model's tokenizer")
        resumed = request.params.resumed_prompt_tokens
        return self.grammars.grammar(spec, request.prompt_token_ids[resumed:] if resumed else ())

    def abort_request(self, request_id: str) -> None:
        """Drop a request and free its KV blocks; unknown or finished ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.scheduler.finish(request, FinishReason.ABORT)
            self._forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[RequestOutput]:
        """Schedule, load KV and run one forward pass, sample; returns outputs of requests that produced a token."""
        began = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.scheduler.waiting:  # waiting only for a connector's fetch: pace the loop, don't spin
                time.sleep(FETCH_POLL_S)
            return []
        ran = self.runner.execute(sched)
        self.scheduler.finish_loads(sched.kv_loads, ran.loaded)
        outputs = self._update(sched, ran)
        self.scheduler.observe_step(sched.num_batched_tokens, time.perf_counter() - began)
        if self.proposer is not None:
            self._propose(self.proposer)
        return outputs

    def _propose(self, proposer: NgramProposer) -> None:
        """Drafts for each decoding request's next step, or none while more requests run than speculation pays
        for (decode steps of many rows are not bound by reading the weights)."""
        running = [r for r in self.scheduler.running if not r.is_shadow]
        pause = len(running) > proposer.config.disable_by_batch_size
        for request in running:
            request.spec_token_ids = []
            if pause or request.num_output_tokens == 0 or request.num_tokens - request.num_computed_tokens != 1:
                continue
            if request.grammar is not None:  # a draft's row would need the mask after the drafts before it
                continue
            # no draft past max_tokens or the model's length: those positions would never be kept
            room = min(request.params.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens)
            request.spec_token_ids = proposer.propose(request.request_id, request.all_token_ids, room - 1)

    def lookup_prefix(self, prompt_token_ids: list[int], cache_salt: str | None = None) -> dict[str, int]:
        """Tokens of this prompt that admission would take from each source instead of computing them.

        ``{"engine": n, "l1": n, "l2": n}`` for a request with ``cache_salt``, as the scheduler would see it now
        (never the last token). Reads
        without locking the engine, so it may run on another thread; the answer is a snapshot.
        """
        params = SamplingParams(max_tokens=1, cache_salt=cache_salt)
        request = Request("kv-lookup", list(prompt_token_ids), params, 0.0)
        held = {"engine": len(self.kv.find_cached_prefix(request)) * self.kv.block_size, "l1": 0, "l2": 0}
        for connector in self.connectors:
            held.update(connector.lookup_tokens(request, held["engine"]))
        return held

    def kv_transfer_info(self) -> dict[str, Any] | None:
        """Decode role: where prefill workers push KV, and the PD buffer's state; None on other roles."""
        if self.kv_receiver is None:
            return None
        stats = self.kv_receiver.buffer.stats()
        return {"addr": self.kv_receiver.addr, "buffer": vars(stats)}

    def close(self) -> None:
        """Finish the connectors' pending KV writes (bounded) and release their connections."""
        if self.kv_receiver is not None:
            self.kv_receiver.close()
        for connector in self.connectors:
            connector.close()

    @property
    def cache_config_info(self) -> dict[str, str]:
        """The labels of vLLM's ``vllm:cache_config_info`` that this engine has a value for (its other labels
        name options splitserve does not have). ``cache_dtype`` "auto": the KV cache takes the model's dtype."""
        cache = self.config.cache
        return {
            "block_size": str(cache.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(cache.enable_prefix_caching),
            "gpu_memory_utilization": str(cache.gpu_memory_utilization),
            "num_gpu_blocks": str(self.pool.num_blocks),  # the engine's KV blocks, on whatever device
            "num_gpu_blocks_override": str(cache.num_gpu_blocks_override),
            "kv_cache_memory_bytes": str(cache.kv_cache_fraction_or_bytes()[1]),
            "prefix_caching_hash_algo": "xxh3_64",  # keys.hash_block
            "sliding_window": str(self.runner.model.config.sliding_window),
            "is_attention_free": "False",
        }

    def backlog(self) -> Backlog:
        """The requests waiting and running, and the prompt tokens they have left to compute (``policy.admission``)."""
        scheduler = self.scheduler
        running = [r for r in scheduler.running if not r.is_shadow]
        waiting = scheduler.waiting
        line = scheduler.step_rate.line()
        return Backlog(
            num_waiting=len(waiting),
            num_in_flight=len(waiting) + len(running),
            prefill_tokens=sum(map(self._prefill_left, waiting)) + sum(map(self._prefill_left, running)),
            seconds_per_token=None if line is None else line[1],
            oldest_waiting_since=min((r.waiting_since for r in waiting), default=None),
            num_prefilling=sum(self._prefill_left(r) > 0 for r in running),
        )

    def _prefill_left(self, request: Request) -> int:
        """The tokens a request still has to compute before it decodes: its prompt's rest, or after a preemption
        its prompt and output; none while it decodes, or when a prefill worker pushed its prompt's KV here."""
        left = request.num_tokens - request.num_computed_tokens
        if left <= 1:  # decoding: one token a step
            return 0
        transfer = request.params.kv_transfer
        if (
            transfer is not None
            and not transfer.is_sender
            and request.num_preemptions == 0
            and self.kv_receiver is not None
            and self.kv_receiver.buffer.peek(transfer.transfer_id) is not None
        ):
            return 0  # loaded from the push, not computed
        return left

    def get_stats(self) -> EngineStats:
        cache = self.kv.stats
        verifier = self.verifier
        backlog = self.backlog()
        return EngineStats(
            num_running=backlog.num_in_flight - backlog.num_waiting,
            num_waiting=backlog.num_waiting,
            num_waiting_deferred=self.scheduler.num_deferred,
            kv_cache_usage=self.pool.usage,
            prefix_cache_queries=cache.num_queries,
            prefix_cache_hits=cache.num_hits,
            external_prefix_cache_queries=cache.num_external_queries,
            external_prefix_cache_hits=cache.num_external_hits,
            cached_tokens_by_source=dict(cache.hits_by_source),
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            iteration_tokens=self.iteration_tokens.copy(),
            kv_cache=next((s for c in self.connectors if (s := c.stats()) is not None), None),
            pd_buffer=self.kv_receiver.buffer.stats() if self.kv_receiver is not None else None,
            exactness_checks=dict(verifier.checks) if verifier is not None else {},
            exactness_mismatches=dict(verifier.mismatches) if verifier is not None else {},
            backlog=backlog,
            spec_decode=self.proposer.stats.snapshot() if self.proposer is not None else None,
        )

    def _check_new_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt:
            raise ValueError("the prompt is empty")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), got {min(prompt)}..{max(prompt)}")
        first = params.kv_transfer.first_token_id if params.kv_transfer is not None else None
        if first is not None and first >= self.vocab_size:
            raise ValueError(f"kv_transfer_params.first_token_id must be below the vocabulary size {self.vocab_size}")
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be below the vocabulary size {self.vocab_size}")
        if any(t >= self.vocab_size for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be below the vocabulary size {self.vocab_size}")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > self.vocab_size:
                raise ValueError(f"{name} must be at most the vocabulary size {self.vocab_size}")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(prompt) + params.max_tokens} tokens ({len(prompt)} in the messages, "
                f"{params.max_tokens} in the completion). Please reduce the length of the messages or completion."
            )

    def _update(self, sched: SchedulerOutput, ran: RunnerOutput) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()  # the step's tokens were sampled now
        num_tokens = 0
        for s in sched.scheduled:
            request = s.request
            if request.request_id in ran.skipped:
                continue  # rolled back (Scheduler.finish_loads): the next step computes it
            num_tokens += s.num_new_tokens
            tokens = ran.sampled.get(request.request_id)
            # a verification step keeps the KV of the drafts it accepted (each equals the token drawn before it)
            num_accepted = len(tokens) - 1 if tokens is not None and s.draft_token_ids else 0
            request.num_computed_tokens += s.num_new_tokens - len(s.draft_token_ids) + num_accepted
            if s.draft_token_ids and self.proposer is not None:
                self.proposer.record(len(s.draft_token_ids), num_accepted)
            if request.is_shadow:
                self._shadow_step(request, tokens[0] if tokens else None)
                continue
            request.prompt_logprobs.extend(ran.prompt_logprobs.get(request.request_id, ()))
            taken = None
            first = False
            if tokens is not None:
                if request.num_output_tokens == 0:
                    request.first_token_time = now
                    self.num_prompt_tokens += request.num_prompt_tokens
                    first = True
                request.last_token_time = now
                taken = self._append_tokens(request, tokens)
                # a stop before the last kept draft: the KV past the last token appended is of no use
                request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
            self.kv.cache_computed_blocks(request)
            self.kv.cache_prompt_tail(request)
            for connector in self.connectors:
                connector.save_completed_chunks(request, s.block_ids)
            if taken is not None:  # None: a prefill chunk that has not reached the end of the prompt yet
                output = self._output_for(request, *taken)
                if request.params.logprobs is not None:
                    entries = ran.logprobs.get(request.request_id, [])[: len(output.new_token_ids)]
                    # the end-of-sequence or stop token that ended it has no text: its logprob goes with it
                    output.new_logprobs = entries[:-1] if _ends_on_silent_token(request, output) else entries
                if first and request.params.prompt_logprobs is not None:
                    output.prompt_logprobs = [None, *request.prompt_logprobs]
                outputs.append(output)
        self.iteration_tokens.observe(num_tokens)
        return outputs

    def _append_tokens(
        self, request: Request, tokens: list[int]
    ) -> tuple[list[int], FinishReason | None, int | str | None]:
        """Append the step's tokens one by one, up to the first that ends the request: (the tokens appended, the
        finish reason or None, the stop reason)."""
        reason: FinishReason | None = None
        stop_reason: int | str | None = None
        detok = self._detokenizers.get(request.request_id)
        appended: list[int] = []
        for token in tokens:
            request.append_output_token(token)
            appended.append(token)
            self.num_generation_tokens += 1
            reason, stop_reason = self._stop_by_token(request, token)
            if detok is not None and reason is None:
                stop_str = detok.update(request.output_token_ids)
                if stop_str is not None:
                    reason, stop_reason = FinishReason.STOP, stop_str
            if reason is None and request.grammar is not None:  # after its text: a completing token is output
                reason, stop_reason = _grammar_step(request.grammar, token)
            if reason is None and (
                request.num_output_tokens >= request.params.max_tokens or request.num_tokens >= self.max_model_len
            ):
                reason = FinishReason.LENGTH
            if reason is not None:
                break
        return appended, reason, stop_reason

    def _output_for(
        self, request: Request, appended: list[int], reason: FinishReason | None, stop_reason: int | str | None
    ) -> RequestOutput:
        """The step's output of a request that got tokens; a finished one leaves the engine."""
        detok = self._detokenizers.get(request.request_id)
        finished = reason is not None
        transfer = None
        if finished:
            rid = request.request_id
            transfer = next((f for c in self.connectors if (f := c.take_transfer_result(rid)) is not None), None)
            self.scheduler.finish(request, reason, stop_reason)  # type: ignore[arg-type]
            del self.requests[request.request_id]
            self._forget(request.request_id)
            shadow = self.verifier.shadow_for(request) if self.verifier is not None else None
            if shadow is not None:
                shadow.grammar = self._grammar_for(shadow)
                self.scheduler.add_shadow(shadow)
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=appended,
            new_text=detok.take_new_text(finished) if detok is not None else "",
            finished=finished,
            finish_reason=reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            stop_reason=stop_reason,
            kv_transfer_result=transfer,
            cached_tokens_by_source=request.cached_tokens_by_source,
            timing=_timing(request) if finished else None,
        )

    def _shadow_step(self, shadow: Request, token: int | None) -> None:
        """A shadow's token (none: a prompt chunk); when it has them all, it is compared and dropped. Its blocks
        are never published and no connector sees it, so it leaves the caches as they were."""
        if token is None:
            return
        shadow.append_output_token(token)
        if shadow.grammar is not None:
            shadow.grammar.accept(token)
        if shadow.num_output_tokens >= shadow.params.max_tokens:
            self.scheduler.finish(shadow, FinishReason.LENGTH)
            assert self.verifier is not None
            self.verifier.finished(shadow)

    def _forget(self, request_id: str) -> None:
        """A request ended: drop what the engine kept for it besides the request itself."""
        self._detokenizers.pop(request_id, None)
        if self.proposer is not None:
            self.proposer.forget(request_id)

    @staticmethod
    def _stop_by_token(request: Request, token: int) -> tuple[FinishReason | None, int | None]:
        params = request.params
        if request.num_output_tokens < params.min_tokens:
            return None, None
        if token in request.eos_token_ids and not params.ignore_eos:
            return FinishReason.STOP, None
        if token in params.stop_token_ids:
            return FinishReason.STOP, token
        return None, None


def _ends_on_silent_token(request: Request, output: RequestOutput) -> bool:
    """Whether the output's last token ended it without text: an EOS, or the stop token id that stopped it."""
    if output.finish_reason != FinishReason.STOP or not output.new_token_ids:
        return False
    last = output.new_token_ids[-1]
    if isinstance(output.stop_reason, int):
        return last == output.stop_reason
    return output.stop_reason is None and last in request.eos_token_ids and not request.params.ignore_eos


def _grammar_step(grammar: Grammar, token: int) -> tuple[FinishReason | None, str | None]:
    """Consume a constrained request's token: it ends when its output is complete (``stop``), or when the token
    breaks the grammar, which only a grammar engine fault can cause (``abort``, the error as the stop reason)."""
    if not grammar.accept(token):
        logger.warning("structured output ended by a grammar error: %s", grammar.error)
        return FinishReason.ABORT, f"grammar error: {grammar.error.splitlines()[0] if grammar.error else ''}"
    return (FinishReason.STOP, None) if grammar.is_finished else (None, None)


def _timing(request: Request) -> RequestPhases:
    """The phases of a request that has produced its last token."""
    scheduled = request.scheduled_time if request.scheduled_time is not None else request.arrival_time
    first = request.first_token_time if request.first_token_time is not None else scheduled
    last = request.last_token_time if request.last_token_time is not None else first
    return RequestPhases(scheduled - request.arrival_time, first - scheduled, last - first, request.num_preemptions)


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when present, else CPU; ``cuda`` without CUDA is a ``ValueError``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA device is available")
    return torch.device(name)


def num_kv_blocks(config: EngineConfig, model: DecoderForCausalLM, device: torch.device) -> int:
    """How many KV blocks fit in the memory ``config.cache`` grants."""
    cache = config.cache
    bytes_per_block = cache.block_size * kv_bytes_per_token(model, cache.kv_cache_dtype)
    fraction, num_bytes = cache.kv_cache_fraction_or_bytes()
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        headroom = int(cache.gpu_memory_utilization * total) - (total - free) - (256 << 20)  # activations
        if fraction is not None:
            num_bytes = int(fraction * free)
        num_bytes = max(0, headroom) if num_bytes is None else min(num_bytes, max(0, headroom))
    else:
        num_bytes = cpu_kv_cache_bytes(fraction, num_bytes, model.prepare_bytes())
    return max(1, num_bytes // bytes_per_block)


def cpu_kv_cache_bytes(fraction: float | None, asked: int | None, reserved: int = 0) -> int:
    """The KV cache's bytes on CPU, with the model loaded: ``fraction`` of the memory available, the size
    ``asked``, or the default where that much is available beside a step's activations and ``reserved`` (what the
    model still allocates before serving: ``prepare_bytes``), else what is. ``ValueError`` naming the sizes where
    an asked size does not fit."""
    if fraction is not None:
        return int(fraction * available_memory_bytes())
    available = known_available_memory()
    if available is None:  # nothing to check against
        return DEFAULT_CPU_KV_CACHE_BYTES if asked is None else asked
    room = max(0, available - ACTIVATION_HEADROOM_BYTES - reserved)
    if asked is None:
        if room < DEFAULT_CPU_KV_CACHE_BYTES:
            logger.warning(
                "%s of memory is available beside the model (%s resident): the KV cache takes %s, not the default %s",
                _gib(available), _gib(resident_bytes()), _gib(room), _gib(DEFAULT_CPU_KV_CACHE_BYTES),
            )  # fmt: skip
            return room
        return DEFAULT_CPU_KV_CACHE_BYTES
    if asked > room:
        raise ValueError(
            f"--kv-cache-memory {_gib(asked)} does not fit: {_gib(available)} of memory is available beside the model "
            f"({_gib(resident_bytes())} resident in this process), of which a step's activations need about "
            f"{_gib(ACTIVATION_HEADROOM_BYTES)} and the model's serving copies {_gib(reserved)}; lower "
            "--kv-cache-memory or give the worker more memory"
        )
    return asked


def check_weights_fit(need: int, what: str) -> None:
    """Before loading: ``ValueError`` naming the sizes where loading a model takes more memory (``need`` bytes, at
    least: ``model.registry.load_footprint_bytes``) than is available, rather than a kill by the kernel halfway."""
    available = known_available_memory()
    if available is not None and need > available:
        raise ValueError(
            f"loading {what} takes at least {_gib(need)}, more than the {_gib(available)} of memory available; give "
            "the worker more memory or serve a smaller (or more quantized) file"
        )


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def kv_bytes_per_token(model: DecoderForCausalLM, kv_cache_dtype: str = "auto") -> int:
    """The bytes a token's K/V take in the cache an engine builds for ``model`` (every layer)."""
    cfg, dtype = model.config, kv_format.cache_dtype(kv_cache_dtype, model.dtype)
    row_bytes = kv_format.row_width(dtype, cfg.head_dim) * dtype.itemsize
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * row_bytes


def kv_cache_layout(model: DecoderForCausalLM, block_size: int, kv_cache_dtype: str = "auto") -> str:
    """The ``keys.kv_layout`` string of the paged KV cache an engine builds for ``model``: its storage dtype and
    row width (``model/kv_format.py``), as ``register_kv_cache`` reads them off the tensor."""
    cfg, dtype = model.config, kv_format.cache_dtype(kv_cache_dtype, model.dtype)
    width = kv_format.row_width(dtype, cfg.head_dim)
    return kv_layout(kv_format.layout_name(dtype), cfg.num_hidden_layers, cfg.num_key_value_heads, width, block_size)


def set_cpu_threads(num_threads: int | None) -> None:
    """Size torch's intra-op thread pool for the calling thread (the engine thread).

    Default: one thread per CPU this process may run on. More threads than free cores is ruinous on CPU:
    every op waits for its slowest thread, so a worker sharing its cores with another busy process runs
    many times slower with 2 threads than with 1. The supervisor passes each role's CPU share.
    """
    if num_threads is None:
        num_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(num_threads)
    torch.set_flush_denormal(True)  # subnormal activations take a slow path on x86


def available_memory_bytes() -> int:
    """The memory this process can still take (``known_available_memory``), else a conservative 4 GiB."""
    known = known_available_memory()
    return 4 << 30 if known is None else known


def known_available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, or less where a cgroup's limit (a container's, a pod's, a systemd
    unit's) leaves less; None where neither is known (then nothing is refused for memory)."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    room = _cgroup_room()
    if room is None:
        return available
    return room if available is None else min(available, room)


_CGROUP_FILES = (  # cgroup v2, then v1: the limit, the usage, the stat file and its inactive-file key
    ("memory.max", "memory.current", "memory.stat", "inactive_file"),
    ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat", "total_inactive_file"),
)


def _cgroup_room(root: Path = Path("/sys/fs/cgroup"), own: Path = Path("/proc/self/cgroup")) -> int | None:
    """The least room any cgroup above this process leaves: its memory limit less its working set (usage less
    inactive file pages, which the kernel reclaims first: the kubelet's measure). The process's own cgroup and each
    parent up to the mount (v2's unified tree, or v1's memory controller), so a systemd unit's or a parent's limit
    counts too; None without a limit."""
    dirs: list[Path] = []
    with contextlib.suppress(OSError):
        for line in own.read_text().splitlines():
            hierarchy, controllers, path = [*line.split(":", 2), "", ""][:3]
            base = (
                root
                if hierarchy == "0" and not controllers
                else root / "memory"
                if "memory" in controllers.split(",")
                else None
            )
            if base is None:
                continue
            here = base / path.strip("/")
            while base == here or base in here.parents:
                dirs.append(here)
                if here == base:
                    break
                here = here.parent
    dirs += [root, root / "memory"]  # a namespaced container sees its own cgroup at the mount
    rooms = [room for room in (_cgroup_level_room(d) for d in dict.fromkeys(dirs)) if room is not None]
    return min(rooms) if rooms else None


def _cgroup_level_room(level: Path) -> int | None:
    for limit_file, usage_file, stat_file, inactive_key in _CGROUP_FILES:
        try:
            limit_text = (level / limit_file).read_text().strip()
            usage = int((level / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or int(limit_text) >= 1 << 60:  # no limit (v1 writes a huge number)
            return None
        inactive = 0
        with contextlib.suppress(OSError, ValueError):
            for line in (level / stat_file).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == inactive_key:
                    inactive = int(value)
        return max(0, int(limit_text) - max(0, usage - inactive))
    return None


def resident_bytes() -> int:
    """This process's resident memory (Linux), else 0."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _eos_ids(tokenizer: Tokenizer | None, model: DecoderForCausalLM) -> frozenset[int]:
    if tokenizer is not None:
        return frozenset(tokenizer.stop_token_ids)
    eos = model.config.eos_token_id
    return frozenset() if eos is None else frozenset([eos])


def _max_model_len(asked: int | None, cfg: DecoderConfig) -> int:
    """The context length: ``asked`` (or the model's), within the model's positions. A sliding window does not
    bound it: its layers attend through the window at any length (``model/attention.py``)."""
    return min(asked or cfg.max_position_embeddings, cfg.max_position_embeddings)

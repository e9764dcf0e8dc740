"""Continuous batching with a per-step token budget, chunked prefill and preemption by recompute.

Each step the scheduler first serves running requests in admission order (decodes need one token each; a
request mid-prefill needs the rest of its prompt, capped by the budget), preempting the most recently
admitted running request when KV blocks run out. Then, if nothing was preempted, it admits waiting
requests while the budget, ``max_num_seqs`` and free blocks allow: in arrival order (``fcfs``), or (``lpm``,
the default) those with the fewest tokens left to compute first, after any that waited past ``max_wait_s``
(oldest first), so that nothing starves. A preempted request drops its blocks and goes back to the front of
the waiting queue; it is recomputed when readmitted (its prefix-cached blocks usually make that cheap).

Each step's budget follows from ``step_time_target`` and the step times the engine measured
(``policy.scheduling``: ``StepRate``, ``step_budget``): a step carrying prompt chunks takes at most a few targets,
and when the request next in line is short (its uncached tokens fit in such a step), one target, of which the
running prompts still in prefill get what the short request leaves (a small chunk at least) and the rest
admits short requests whole. A follow-up turn whose prompt is mostly cached then gets its first token within
one short step, instead of waiting for every chunk of someone else's cold prompt, on any CPU. Cold requests
still queue behind a running prompt.

With KV connectors (``splitserve.engine.connector``), admission goes further than the engine's own prefix
cache: the first connector that names more leading tokens it holds in memory (e.g. from L1/L2, or pushed by a
prefill worker) is their source; blocks are allocated for them, a ``KVLoad`` in the ``SchedulerOutput`` tells
the runner to copy them in before the forward pass, and the request starts past them. Nothing here reads or
copies KV. A load that came up short anyway is rolled back after the step (``finish_loads``): the request
computes from where its KV really ends.

A connector may answer that it is still fetching a request's KV (from L2, on its own thread): that request
keeps its place at the front of the queue, and the ones behind it are admitted meanwhile. So does a request
whose next uncached block a running request is computing now (the same prompt sent n times, or by many users
at once): it starts once that block is cached, and the prompt is computed once.

Shadow requests (``engine.verifier``: a cold recompute of a finished request, to check it) wait in a queue of
their own and are admitted one at a time, only when no other request waits, with no cached or loaded KV. When a
client request arrives, a running shadow is preempted back to that queue, so it never holds a seat or a block
a client could use.

When every full block of a request is cached and another request left the same partial last block (a
repeated prompt), that block is copied too (``block_copies``) and only the last token is computed.

A decoding request with draft tokens (``Request.spec_token_ids``, ``engine.speculative``) computes its last
token and as many drafts as the budget leaves, where their blocks are free: drafts never preempt anyone. The
engine keeps the drafts' KV up to the first rejected one.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from splitserve.config import SchedulerConfig, SchedulingPolicy
from splitserve.engine.connector import KVConnectorBase, KVLoad, LoadedTokens
from splitserve.engine.kv_cache_manager import ENGINE_SOURCE, KVCacheManager
from splitserve.engine.outputs import FinishReason
from splitserve.engine.request import Request, RequestStatus
from splitserve.policy.scheduling import (
    LPM_KEY,
    RunningBudget,
    StepRate,
    StepTokens,
    admitted_tokens,
    lpm_key,
    step_budget,
)


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, starting at request.num_computed_tokens (drafts included)
    block_ids: list[int]  # the request's whole block table after allocation
    draft_token_ids: list[int] = field(default_factory=list)  # drafts computed after its last token, verified

    @property
    def completes_prompt(self) -> bool:
        """True when the request will have caught up after this step, so a token is sampled."""
        num_real = self.num_new_tokens - len(self.draft_token_ids)
        return self.request.num_computed_tokens + num_real == self.request.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """The tokens this step computes: the request's next ones, then the drafts."""
        start = self.request.num_computed_tokens
        num_real = self.num_new_tokens - len(self.draft_token_ids)
        return self.request.all_token_ids[start : start + num_real] + self.draft_token_ids


@dataclass(slots=True)
class SchedulerOutput:
    """The one object that crosses from the scheduler to the model runner each step."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # (source block id, destination block id): copy these KV blocks before the forward pass (cached tails)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # KV that connectors copy into newly admitted requests' blocks before the forward pass
    kv_loads: list[KVLoad] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


MAX_SORTED_WAITING = 256  # lpm orders this many at the head of the queue each step (bounds the step's cost)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        connectors: Sequence[KVConnectorBase] = (),
    ) -> None:
        """``connectors``: asked in this order for KV past the prefix cache; the first to offer is the source."""
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.connectors = tuple(connectors)
        self.waiting: deque[Request] = deque()
        self.shadows: deque[Request] = deque()
        self.running: list[Request] = []
        self._held_back = False  # this step: a running prompt got less than it could, for a short request
        self.num_preemptions = 0
        # waiting requests the last admission passed over: a connector is fetching their KV, or a running request
        # is computing their next block
        self.num_deferred = 0
        self._in_flight: set[int] = set()  # this admission's ``_blocks_in_flight``
        self.step_rate = StepRate()  # the engine's step times, as it reports them (``observe_step``)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.shadows) + len(self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def add_shadow(self, shadow: Request) -> None:
        """Queue a shadow request (``Request.is_shadow``): it runs when nothing else waits."""
        self.shadows.append(shadow)

    def schedule(self) -> SchedulerOutput:
        self.kv.release_pins()  # the previous step, which copied them, has run
        out = SchedulerOutput()
        if self.config.policy == SchedulingPolicy.LPM and len(self.waiting) > 1:
            self._order_by_uncached_tokens()
        self._held_back = False
        self.num_deferred = 0
        if self.waiting:  # a client request waits: a running shadow gives its seat and blocks back
            for shadow in [r for r in self.running if r.is_shadow]:
                self.running.remove(shadow)
                self._preempt(shadow)
        budget = self._schedule_running(out, *self._step_budget())
        if not out.preempted:
            budget = self._schedule_waiting(out, budget, whole_only=self._held_back)
            if self.shadows and not self.waiting and not any(r.is_shadow for r in self.running):
                self._admit_shadow(out, budget)
        return out

    def _admit_shadow(self, out: SchedulerOutput, budget: int) -> None:
        """Start the first shadow from nothing (no prefix cache, no connector), as far as the budget goes."""
        shadow = self.shadows[0]
        num_new = min(shadow.num_tokens, budget)
        if budget == 0 or len(self.running) >= self.config.max_num_seqs or not self.kv.allocate(shadow, num_new):
            return
        self.shadows.popleft()
        shadow.num_computed_tokens = 0
        shadow.status = RequestStatus.RUNNING
        self.running.append(shadow)
        out.scheduled.append(ScheduledRequest(shadow, num_new, self.kv.block_ids(shadow.request_id)))

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """The engine ran a step of ``num_tokens`` tokens in ``seconds``: the budgets follow the measured cost."""
        self.step_rate.observe(num_tokens, seconds)

    def step_tokens(self) -> StepTokens | None:
        """The steps' budgets under ``step_time_target`` (None: no target, or nothing measured yet). Without chunked
        prefill there is none: a prompt runs whole, and a budget below its length would never admit it."""
        if not self.config.enable_chunked_prefill:
            return None
        return self.step_rate.step_tokens(self.config.step_time_target)

    def _step_budget(self) -> tuple[int, int | None]:
        """This step's token budget, and what the running prompts may take of it (``policy.scheduling``)."""
        steps = self.step_tokens()
        if steps is None:  # no target: no need to look the next request up
            return self.config.max_num_batched_tokens, None
        seat_free = self.waiting and len(self.running) < self.config.max_num_seqs
        return step_budget(
            self.config.max_num_batched_tokens,
            steps,
            num_decodes=sum(r.num_tokens - r.num_computed_tokens == 1 for r in self.running),
            head_uncached=self._num_uncached(self.waiting[0]) if seat_free else None,
        )

    def _num_uncached(self, request: Request) -> int:
        """Tokens the request would compute beyond the engine's prefix cache (the tiers' share is unknown here)."""
        return request.num_tokens - len(self.kv.find_cached_prefix(request)) * self.kv.block_size

    def _schedule_running(self, out: SchedulerOutput, tokens: int, prefill_cap: int | None = None) -> int:
        budget = RunningBudget(tokens, prefill_cap)
        running = list(self.running)
        for index, request in enumerate(running):
            if budget.tokens == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = budget.take(request.num_tokens - request.num_computed_tokens)
            if num_new == 0:
                continue
            drafts: list[int] = []
            if request.spec_token_ids and request.num_tokens - request.num_computed_tokens == 1:
                # drafts take only what leaves a token for each running request after this one
                room = budget.tokens - num_new - (len(running) - index - 1)
                drafts = request.spec_token_ids[: max(room, 0)]
            # drafts only where their blocks are free: they never preempt anyone
            if drafts and self.kv.allocate(request, num_new + len(drafts)):
                fits, num_returned = True, 0
            else:
                drafts = []
                fits, num_returned = self._allocate_or_preempt(request, num_new, out)
            budget.tokens += num_returned
            if not fits:
                continue
            num_new += len(drafts)
            out.scheduled.append(ScheduledRequest(request, num_new, self.kv.block_ids(request.request_id), drafts))
            budget.tokens -= num_new
        self._held_back = budget.held_back
        return budget.tokens

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> tuple[bool, int]:
        """Allocate, preempting from the back of ``running`` until it fits.

        Returns (False if ``request`` itself was preempted, the budget tokens of victims already scheduled
        this step, which the caller gets back).
        """
        num_returned = 0
        while not self.kv.allocate(request, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            num_returned += sum(s.num_new_tokens for s in out.scheduled if s.request is victim)
            out.scheduled = [s for s in out.scheduled if s.request is not victim]
            if victim is request:
                return False, num_returned
        return True, num_returned

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.waiting_since = time.monotonic()
        if request.is_shadow:  # back to its own queue: recomputed from nothing, when nothing else waits
            self.shadows.appendleft(request)
            return
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, whole_only: bool = False) -> int:
        """Admit waiting requests in the policy's order; one whose KV the connector is still fetching is passed
        over. ``whole_only`` (a running prompt was held back for them): only requests whose prompt fits whole.
        Returns the budget left."""
        fetching: list[Request] = []
        self._in_flight = self._blocks_in_flight() if self.waiting else set()
        try:
            return self._admit(out, budget, fetching, whole_only)
        finally:
            self.waiting.extendleft(reversed(fetching))  # they keep their place at the front
            self.num_deferred = len(fetching)

    def _admit(self, out: SchedulerOutput, budget: int, fetching: list[Request], whole_only: bool = False) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            cached = self.kv.find_cached_prefix(request)
            if self._in_flight and self._next_block_in_flight(request, len(cached)):
                fetching.append(self.waiting.popleft())
                continue
            num_cached = len(cached) * self.kv.block_size
            found = self._find_external(request, num_cached)
            if found is None:
                fetching.append(self.waiting.popleft())
                continue
            num_external, source = found
            num_new = request.num_tokens - num_cached - num_external
            tail = None if num_external else self.kv.find_cached_tail(request, len(cached))
            if tail is None:  # with a tail, one token is computed: it fits
                admitted = admitted_tokens(
                    num_new, budget, whole_only=whole_only, chunked=self.config.enable_chunked_prefill
                )
                if admitted is None:
                    break
                num_new = admitted
            if not self.kv.allocate(request, num_external + num_new, cached, tail):
                break
            self.waiting.popleft()
            block_ids = self.kv.block_ids(request.request_id)
            if tail is not None:  # all but the last token are in the tail's block: copy it into ours
                out.block_copies.append((tail.block_id, block_ids[len(cached)]))
                num_cached += num_new - 1
            self._start_past_cached(out, request, block_ids, num_cached, num_external, source)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if tail is None:  # with a tail every block is cached already: it computes only the last token
                self._in_flight.update(self._prompt_blocks_to_fill(request, len(cached)))
            request.status = RequestStatus.RUNNING
            if request.scheduled_time is None:  # kept over preemptions, as vLLM's SCHEDULED event
                request.scheduled_time = time.monotonic()
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new, block_ids))
            budget -= num_new
        return budget

    def _blocks_in_flight(self) -> set[int]:
        """The hashes of the full prompt blocks running requests have still to compute (with prefix caching)."""
        if not self.kv.pool.enable_caching:
            return set()
        size = self.kv.block_size
        return {h for r in self.running if r.num_computed_tokens < r.num_prompt_tokens and not r.is_shadow
                for h in r.block_hashes[r.num_computed_tokens // size : r.num_prompt_tokens // size]}  # fmt: skip

    def _prompt_blocks_to_fill(self, request: Request, num_cached_blocks: int) -> list[int]:
        """The hashes of the full prompt blocks a request admitted now computes or loads past its cached ones: a
        request admitted after it in the same round whose next block is one of them waits for it (the same prompt
        sent n times computes it once, and n sequences on a decode worker load a pushed prompt once)."""
        if not self.kv.pool.enable_caching or request.is_shadow:
            return []
        return request.block_hashes[num_cached_blocks : request.num_prompt_tokens // self.kv.block_size]

    def _next_block_in_flight(self, request: Request, num_cached_blocks: int) -> bool:
        """Whether the block after the request's cached ones is being computed by a running request."""
        if request.params.prompt_logprobs is not None:  # reads no cache
            return False
        hashes = request.block_hashes  # find_cached_prefix brought them up to date
        return num_cached_blocks < len(hashes) and hashes[num_cached_blocks] in self._in_flight

    def _start_past_cached(
        self,
        out: SchedulerOutput,
        request: Request,
        block_ids: list[int],
        num_cached: int,
        num_external: int,
        source: KVConnectorBase | None,
    ) -> None:
        """Count the admission, tell every connector, record the source's load: the request starts after it."""
        is_first_admission = self._count_admission(request, num_cached)
        for connector in self.connectors:
            connector.update_state_after_alloc(request, num_cached, num_external if connector is source else 0)
        if source is not None:
            end = num_cached + num_external
            out.kv_loads.append(KVLoad(request, block_ids, num_cached, end, source, is_first_admission))
        request.num_computed_tokens = num_cached + num_external

    def _order_by_uncached_tokens(self) -> None:
        """``lpm``: requests past ``max_wait_s`` first (oldest first), then the fewest tokens not in the engine's
        prefix cache first (ties: arrival order). A cheap estimate: hashes the requests already have, and pool
        lookups; the tiers' share is known only once their lookup is done, at admission."""
        oldest_allowed = time.monotonic() - self.config.max_wait_s

        def key(request: Request) -> LPM_KEY:
            return lpm_key(request.arrival_time, self._num_uncached(request), oldest_allowed)

        head = sorted(itertools.islice(self.waiting, MAX_SORTED_WAITING), key=key)
        self.waiting = deque([*head, *itertools.islice(self.waiting, MAX_SORTED_WAITING, None)])

    def _find_external(self, request: Request, num_cached: int) -> tuple[int, KVConnectorBase | None] | None:
        """The tokens past ``num_cached`` the first connector offering any can load, and that connector (the
        source); ``(0, None)`` when none offers (or the request wants its prompt's logprobs, so computes it);
        None while one asked first is still fetching."""
        if request.params.prompt_logprobs is not None:
            return 0, None
        for connector in self.connectors:
            num = connector.num_external_tokens(request, num_cached)
            if num is None:
                return None
            if num > 0:
                return num, connector
        return 0, None

    def _count_admission(self, request: Request, num_cached: int) -> bool:
        """Count a first admission's prefix-cache hits (``num_cached``) and the tokens asked of the connectors;
        returns whether this is the first admission (its loaded tokens are counted by ``finish_loads``)."""
        if request.num_cached_tokens >= 0:  # readmitted after a preemption: counted once
            return False
        self.kv.record_prefix_lookup(request.num_tokens, num_cached)
        if self.connectors:
            self.kv.record_external_query(request.num_tokens - num_cached)
        request.num_cached_tokens = num_cached
        request.cached_tokens_by_source = ((ENGINE_SOURCE, num_cached),)
        return True

    def finish_loads(self, loads: list[KVLoad], loaded: dict[str, LoadedTokens]) -> None:
        """After the runner performed the step's loads (``loaded``: by request id): count what a first
        admission loaded, and roll back a request whose load came up short (the runner left it out of the
        forward pass) to the tokens really there. It keeps its blocks and computes the rest from the next step.
        """
        for load in loads:
            request = load.request
            result = loaded.get(request.request_id, LoadedTokens())
            num_loaded = min(result.num_tokens, load.num_tokens)
            if load.is_first_admission:
                self.kv.record_external_hits(result.by_source)
                request.num_cached_tokens += num_loaded
                request.cached_tokens_by_source += result.by_source
            if not load.is_complete(result):
                request.num_computed_tokens = load.start_token + num_loaded

    def finish(self, request: Request, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """End a request wherever it is and free its blocks."""
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            (self.shadows if request.is_shadow else self.waiting).remove(request)
        self.kv.free(request)
        for connector in self.connectors if not request.is_shadow else ():
            connector.request_finished(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason

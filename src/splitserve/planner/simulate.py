"""A discrete-event simulation of an endpoint: the router, each worker's queue and engine steps, and KV moves.

Torch-free, pure Python and deterministic: the same workload, topology and costs give the same figures.

**Workers** run the engine's scheduler (``engine/scheduler.py``) on token counts: each step serves the running
requests in admission order (a decode takes one token, a prompt the rest of its tokens up to the step budget
``max_num_batched_tokens``), then admits waiting ones while the budget and ``max_num_seqs`` allow, fewest uncached
tokens first (``lpm``; those waiting past ``max_wait_s`` first), chunking a prompt that does not fit. When the
next waiting request is short, the step aims at ``step_time_target_s`` (``policy.scheduling.step_budget``, with the
worker's step times measured as the engine measures its own: ``StepRate``): running prompts take what the short
request leaves of it and only whole prompts are admitted. A step lasts what
:class:`~splitserve.planner.costs.StepCost` says, plus the copies of KV loaded at admission. Preemption is not
modelled: KV blocks are assumed to suffice.

**Caches.** A request of a prefix group finds, block-aligned, what its worker's engine cache (an LRU over
groups, ``cache_tokens`` in all) holds of the group, then its L1 (``l1_tokens``), then the shared L2 (when on):
the rest is computed. Engine and L1 hits cost a copy each token on the engine thread; an L2 hit is first fetched
off the engine thread (the request is passed over meanwhile). A worker keeps a group's prompt once computed, and
its prompt and output once finished; L1 and L2 keep prompts.

**Disaggregation.** As ``router/disagg.py`` does, the decode worker is chosen first; when the prompt's tokens it
is not believed to hold (the strategy's match) reach ``routing_threshold``, a prefill worker is chosen, which
computes the prompt and samples the first token. Its KV is then pushed (two sender threads per prefill worker,
``push_s`` each), and the client gets the first token when the push is done. The decode worker admits the
request with the pushed KV (copied in), computes the last prompt token (its sample is the forced first token,
not sent again) and streams the rest. Other prompts go straight to the decode worker, which serves them as a
colocated one would. Router and HTTP overheads are not modelled.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from splitserve.bench.metrics import Slo, percentile
from splitserve.config import CacheConfig, Role, RoutingStrategy, SchedulerConfig
from splitserve.planner.costs import LoadCost, StepCost
from splitserve.planner.routing import RoutingQuery, SimRouter
from splitserve.planner.workload import TraceRequest
from splitserve.policy.balance import NOTHING_UNSEEN, PendingPrefill
from splitserve.policy.scheduling import RunningBudget, StepRate, admitted_tokens, lpm_key, step_budget

NUM_SENDER_THREADS = 2  # pd/sender.py's pool
ROUTER_RATE_TOKENS = 1024  # the prompt length at which a worker's seconds per prefill token are taken for routing
_SCHEDULER = SchedulerConfig()  # a worker's defaults, as ``splitserve worker`` has them
_CACHE = CacheConfig()


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """A worker's scheduler and cache settings (the ``splitserve worker`` flags of the same names)."""

    max_num_seqs: int = _SCHEDULER.max_num_seqs
    max_num_batched_tokens: int = _SCHEDULER.max_num_batched_tokens
    step_time_target_s: float = _SCHEDULER.step_time_target  # 0: none, every step takes max_num_batched_tokens
    max_wait_s: float = _SCHEDULER.max_wait_s
    block_size: int = _CACHE.block_size
    cache_tokens: int = 1 << 62  # the engine's KV cache, in tokens (what its prefix cache can keep)
    l1_tokens: int = 0  # 0: no L1


@dataclass(frozen=True, slots=True)
class SimulatedWorker:
    role: Role
    cost: StepCost
    limits: EngineLimits = EngineLimits()


@dataclass(frozen=True, slots=True)
class Topology:
    """The workers of one layout and how requests reach them."""

    workers: tuple[SimulatedWorker, ...]  # all colocated, or prefill and decode ones
    strategy: RoutingStrategy = RoutingStrategy.ROUNDROBIN
    routing_threshold: int | None = None  # disaggregated layouts: prompts from this many tokens go to prefill
    l2_tokens: int = 0  # the shared L2's capacity; 0: none

    def pool(self, role: Role) -> tuple[SimulatedWorker, ...]:
        return tuple(w for w in self.workers if w.role == role)

    @property
    def is_disaggregated(self) -> bool:
        return any(w.role != Role.COLOCATED for w in self.workers)

    def check(self) -> None:
        roles = {w.role for w in self.workers}
        if not self.workers or (Role.COLOCATED in roles and len(roles) > 1):
            raise ValueError(f"a topology has colocated workers, or prefill and decode ones; got {sorted(roles)}")
        if self.is_disaggregated and not self.pool(Role.DECODE):
            raise ValueError("a disaggregated topology needs at least one decode worker")


@dataclass(frozen=True, slots=True)
class KVMoves:
    """What moving KV costs: a PD push of N tokens, and copies at admission."""

    kv_bytes_per_token: int
    push_base_s: float
    push_bytes_per_s: float
    loads: LoadCost

    def push_s(self, num_tokens: int) -> float:
        return self.push_base_s + num_tokens * self.kv_bytes_per_token / self.push_bytes_per_s


# ---------------------------------------------------------------------------------------------- caches


class _LRU:
    """Groups -> tokens held, least recently used first, at most ``capacity`` tokens in all."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._held: OrderedDict[str, int] = OrderedDict()
        self._total = 0

    def get(self, group: str) -> int:
        return self._held.get(group, 0)

    def touch(self, group: str) -> None:
        if group in self._held:
            self._held.move_to_end(group)

    def put(self, group: str, tokens: int) -> list[tuple[str, int]]:
        """Hold ``tokens`` of ``group`` (never fewer than before); returns what was evicted for room."""
        if self.capacity <= 0 or tokens <= 0:
            return []
        old = self._held.pop(group, 0)
        tokens = min(max(tokens, old), self.capacity)
        self._held[group] = tokens
        self._total += tokens - old
        evicted = []
        while self._total > self.capacity:
            victim, held = self._held.popitem(last=False)
            self._total -= held
            evicted.append((victim, held))
        return evicted


# ---------------------------------------------------------------------------------------------- requests


class _Leg(Enum):
    WHOLE = "whole"  # colocated, or a short prompt on a decode worker
    PREFILL = "prefill"  # the prefill worker's part: prompt and first token
    DECODE = "decode"  # the decode worker's part after a push


@dataclass(slots=True)
class _Job:
    """One request on one worker: ``num_computed`` catching up with ``num_tokens``."""

    index: int  # into the workload
    leg: _Leg
    request: TraceRequest
    arrival_s: float  # at this worker
    num_tokens: int  # prompt plus tokens sampled so far
    num_output: int  # tokens this job samples in all
    num_computed: int = 0
    num_sampled: int = 0
    ready_s: float = 0.0  # an L2 fetch in progress: admissible from then
    is_looked_up: bool = False
    queued_tokens: int = 0  # counted in its worker's pending_prefill_tokens until it answers, as the router does

    @property
    def num_prompt(self) -> int:
        return self.request.prompt_tokens


@dataclass(slots=True)
class RequestTiming:
    """What the client saw of one request."""

    arrival_s: float
    token_times_s: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] - self.arrival_s

    @property
    def itls_s(self) -> list[float]:
        times = self.token_times_s
        return [b - a for a, b in itertools.pairwise(times)]


# ---------------------------------------------------------------------------------------------- a worker


class _Worker:
    """One simulated engine: its queues, caches and the step in progress."""

    def __init__(self, name: str, spec: SimulatedWorker, moves: KVMoves, l2: _LRU | None) -> None:
        self.name = name
        self.spec = spec
        self.limits = spec.limits
        self.moves = moves
        self.engine_cache = _LRU(spec.limits.cache_tokens)
        self.l1 = _LRU(spec.limits.l1_tokens)
        self.l2 = l2
        self.waiting: list[_Job] = []
        self.running: list[_Job] = []
        self.in_flight = 0
        self.pending_prefill = PendingPrefill()  # the router's view: uncached tokens of jobs not answered yet
        self.unseen = NOTHING_UNSEEN  # one router: it sent every job
        self.is_busy = False
        self.is_kick_pending = False  # a wake-up is queued at the current time
        self.busy_s = 0.0
        self.sender_free_s = [0.0] * NUM_SENDER_THREADS
        self.step_rate = StepRate()  # the worker's simulated step times, as the engine measures its real ones

    @property
    def pending_prefill_tokens(self) -> int:
        return self.pending_prefill.total

    @property
    def s_per_token(self) -> float:
        """What the router's cost model would measure: seconds per token of a prompt of ROUTER_RATE_TOKENS."""
        return self.spec.cost.prefill.prompt_s(ROUTER_RATE_TOKENS) / ROUTER_RATE_TOKENS

    def held_tokens(self, group: str, max_tokens: int) -> tuple[int, int]:
        local = max(self.engine_cache.get(group), self.l1.get(group))
        shared = self.l2.get(group) if self.l2 is not None else 0
        return min(local, max_tokens), min(shared, max_tokens)

    def add(self, job: _Job) -> None:
        self.waiting.append(job)

    def schedule(self, now_s: float) -> tuple[list[tuple[_Job, int]], float]:
        """The jobs of the next step with their new tokens, and the seconds of KV copies at admission."""
        if len(self.waiting) > 1:
            self._order_waiting(now_s)
        budget = RunningBudget(*self._step_budget())
        scheduled: list[tuple[_Job, int]] = []
        for job in self.running:
            if budget.tokens == 0:
                break
            num_new = budget.take(job.num_tokens - job.num_computed)
            if num_new == 0:
                continue
            scheduled.append((job, num_new))
            budget.tokens -= num_new
        copy_s = self._admit(now_s, budget.tokens, budget.held_back, scheduled)
        return scheduled, copy_s

    def _order_waiting(self, now_s: float) -> None:
        oldest_allowed = now_s - self.limits.max_wait_s
        self.waiting.sort(
            key=lambda job: lpm_key(job.arrival_s, job.num_tokens - self._engine_hit(job), oldest_allowed)
        )

    def _step_budget(self) -> tuple[int, int | None]:
        limits = self.limits
        target = self.step_rate.step_tokens(limits.step_time_target_s)
        seat_free = self.waiting and len(self.running) < limits.max_num_seqs
        head = self.waiting[0] if seat_free else None
        return step_budget(
            limits.max_num_batched_tokens,
            target,
            num_decodes=sum(j.num_tokens - j.num_computed == 1 for j in self.running),
            head_uncached=head.num_tokens - self._engine_hit(head) if head is not None else None,
        )

    def _admit(self, now_s: float, budget: int, whole_only: bool, scheduled: list[tuple[_Job, int]]) -> float:
        copy_s = 0.0
        passed_over: list[_Job] = []
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            job = self.waiting[0]
            if not job.is_looked_up:
                self._look_up(job, now_s)
            if job.ready_s > now_s:
                passed_over.append(self.waiting.pop(0))
                continue
            num_cached, job_copy_s = self._cached(job)
            admitted = admitted_tokens(job.num_tokens - num_cached, budget, whole_only=whole_only)
            if admitted is None:
                break
            num_new = admitted
            self.waiting.pop(0)
            job.num_computed = num_cached
            copy_s += job_copy_s
            self.running.append(job)
            scheduled.append((job, num_new))
            budget -= num_new
        self.waiting[:0] = passed_over
        return copy_s

    def _engine_hit(self, job: _Job) -> int:
        group = job.request.prefix_group
        if group is None:
            return 0
        return self._aligned(min(self.engine_cache.get(group), job.request.prefix_tokens), job)

    def _aligned(self, tokens: int, job: _Job) -> int:
        """Whole blocks, and never the last prompt token (it is always computed)."""
        block = self.limits.block_size
        return min(tokens // block * block, job.num_prompt - 1)

    def _look_up(self, job: _Job, now_s: float) -> None:
        """First sight of a job: an L2 hit beyond the local caches starts its fetch."""
        job.is_looked_up = True
        group = job.request.prefix_group
        if group is None or self.l2 is None or job.leg == _Leg.DECODE:
            return
        local = max(self._engine_hit(job), self._aligned(min(self.l1.get(group), job.request.prefix_tokens), job))
        shared = self._aligned(min(self.l2.get(group), job.request.prefix_tokens), job)
        if shared > local:
            job.ready_s = now_s + (shared - local) * self.moves.loads.l2_fetch_s_per_token

    def _cached(self, job: _Job) -> tuple[int, float]:
        """Tokens the job starts with, and the seconds of copying those not in the engine cache."""
        loads = self.moves.loads
        if job.leg == _Leg.DECODE:  # the push holds all but the last prompt token
            engine = self._engine_hit(job)
            return job.num_prompt - 1, (job.num_prompt - 1 - engine) * loads.kv_copy_s_per_token
        group = job.request.prefix_group
        if group is None:
            return 0, 0.0
        engine = self._engine_hit(job)
        self.engine_cache.touch(group)
        l1 = self._aligned(min(self.l1.get(group), job.request.prefix_tokens), job)
        l2 = self._aligned(min(self.l2.get(group), job.request.prefix_tokens), job) if self.l2 is not None else 0
        best = max(engine, l1, l2)
        if best == engine:
            return engine, 0.0
        per_token = loads.l1_load_s_per_token if best == l1 else loads.kv_copy_s_per_token
        return best, (best - engine) * per_token

    def step_s(self, scheduled: Sequence[tuple[_Job, int]]) -> float:
        chunks = [(j.num_computed, j.num_computed + n) for j, n in scheduled if j.num_computed < j.num_prompt]
        decodes = [j.num_computed for j, _ in scheduled if j.num_computed >= j.num_prompt]
        return self.spec.cost.step_s(chunks, decodes)

    def remember(self, job: _Job, num_tokens: int, in_tiers: bool) -> None:
        """Keep ``num_tokens`` of the job's group in the engine cache (evicted groups go to L1), and in L1/L2."""
        group = job.request.prefix_group
        if group is None:
            return
        for victim, held in self.engine_cache.put(group, num_tokens):
            self.l1.put(victim, held)
        if in_tiers:
            self.l1.put(group, num_tokens)
            if self.l2 is not None:
                self.l2.put(group, num_tokens)


# ---------------------------------------------------------------------------------------------- the simulation


@dataclass(frozen=True, slots=True)
class SimResult:
    timings: tuple[RequestTiming, ...]  # in workload order
    utilization: dict[str, float]  # worker name -> busy share of the run
    duration_s: float  # first arrival to last token


def simulate(requests: Sequence[TraceRequest], topology: Topology, moves: KVMoves) -> SimResult:
    """Run ``requests`` (sorted by arrival) through ``topology``; deterministic."""
    topology.check()
    return _Simulation(requests, topology, moves).run()


class _Simulation:
    def __init__(self, requests: Sequence[TraceRequest], topology: Topology, moves: KVMoves) -> None:
        self.requests = requests
        self.topology = topology
        self.moves = moves
        l2 = _LRU(topology.l2_tokens) if topology.l2_tokens > 0 else None
        self.workers = [_Worker(f"{spec.role.value}-{i}", spec, moves, l2) for i, spec in enumerate(topology.workers)]
        self.routers = {
            role: SimRouter(
                topology.strategy,
                [w for w in self.workers if w.spec.role == role],
                block_size=next(w.limits.block_size for w in self.workers if w.spec.role == role),
            )
            for role in (Role.COLOCATED, Role.PREFILL, Role.DECODE)
            if any(w.spec.role == role for w in self.workers)
        }
        self.timings = [RequestTiming(r.arrival_s) for r in requests]
        self.decode_for: dict[int, _Worker] = {}
        self.prefill_of: dict[int, _Worker] = {}  # a pushing prefill job's worker, until the push is done
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()

    def run(self) -> SimResult:
        for index, request in enumerate(self.requests):
            self._at(request.arrival_s, "arrive", index)
        now_s = 0.0
        while self._events:
            now_s, _, kind, payload = heapq.heappop(self._events)
            self._handle(now_s, kind, payload)
        first = self.requests[0].arrival_s if self.requests else 0.0
        last = max((t.token_times_s[-1] for t in self.timings if t.token_times_s), default=first)
        duration_s = max(last - first, 1e-9)
        utilization = {w.name: w.busy_s / duration_s for w in self.workers}
        return SimResult(tuple(self.timings), utilization, duration_s)

    def _at(self, time_s: float, kind: str, payload: object) -> None:
        heapq.heappush(self._events, (time_s, next(self._seq), kind, payload))

    def _handle(self, now_s: float, kind: str, payload: object) -> None:
        if kind == "arrive":
            assert isinstance(payload, int)
            self._arrive(now_s, payload)
        elif kind == "step_done":
            assert isinstance(payload, tuple)
            self._step_done(now_s, *payload)
        elif kind == "pushed":
            assert isinstance(payload, _Job)
            self._pushed(now_s, payload)
        elif kind == "wake":
            assert isinstance(payload, _Worker)
            payload.is_kick_pending = False
            self._kick(now_s, payload)

    def _route(self, role: Role, request: TraceRequest) -> tuple[_Worker, int]:
        """The worker the router picks in ``role``'s pool, and the tokens it believes that worker holds."""
        worker, matched, _ = self._routed(role, request)
        return worker, matched

    def _routed(self, role: Role, request: TraceRequest) -> tuple[_Worker, int, int]:
        """The pick in ``role``'s pool, the tokens it is believed to hold, and those the router counts as queued
        prefill there."""
        query = RoutingQuery(request.prompt_tokens, request.prefix_group, request.prefix_tokens)
        routed = self.routers[role].select(query)
        assert isinstance(routed.worker, _Worker)
        return routed.worker, routed.matched_tokens, routed.uncached_tokens

    def _arrive(self, now_s: float, index: int) -> None:
        request = self.requests[index]
        threshold = self.topology.routing_threshold
        if not self.topology.is_disaggregated:
            worker, _, queued = self._routed(Role.COLOCATED, request)
            self._start(now_s, worker, _Leg.WHOLE, index, queued)
            return
        decode, matched = self._route(Role.DECODE, request)
        uncached = request.prompt_tokens - matched
        if threshold is None or uncached < threshold or Role.PREFILL not in self.routers:
            self._start(now_s, decode, _Leg.WHOLE, index, uncached)
            return
        self.decode_for[index] = decode
        prefill, prefill_matched = self._route(Role.PREFILL, request)
        self._start(now_s, prefill, _Leg.PREFILL, index, request.prompt_tokens - prefill_matched)

    def _start(self, now_s: float, worker: _Worker, leg: _Leg, index: int, queued_tokens: int = 0) -> None:
        request = self.requests[index]
        num_output = 1 if leg == _Leg.PREFILL else request.output_tokens
        worker.add(_Job(index, leg, request, now_s, request.prompt_tokens, num_output, queued_tokens=queued_tokens))
        worker.in_flight += 1
        worker.pending_prefill.add(queued_tokens)
        if not worker.is_busy and not worker.is_kick_pending:  # after all else arriving now: one step for all
            worker.is_kick_pending = True
            self._at(now_s, "wake", worker)

    def _kick(self, now_s: float, worker: _Worker) -> None:
        """Start the worker's next step if it is idle and has anything to run."""
        if worker.is_busy or not (worker.running or worker.waiting):
            return
        scheduled, copy_s = worker.schedule(now_s)
        if not scheduled:  # only L2 fetches in progress: look again when the first is done
            ready_s = min((j.ready_s for j in worker.waiting), default=now_s)
            if ready_s <= now_s:
                raise RuntimeError(f"{worker.name} has work but scheduled none at {now_s:.3f} s (a simulator bug)")
            self._at(ready_s, "wake", worker)
            return
        duration_s = worker.step_s(scheduled) + copy_s
        worker.step_rate.observe(sum(num_new for _, num_new in scheduled), duration_s)
        worker.is_busy = True
        worker.busy_s += duration_s
        self._at(now_s + duration_s, "step_done", (worker, scheduled))

    def _step_done(self, now_s: float, worker: _Worker, scheduled: list[tuple[_Job, int]]) -> None:
        worker.is_busy = False
        for job, num_new in scheduled:
            was_prefill = job.num_computed < job.num_prompt
            job.num_computed += num_new
            if was_prefill and job.num_computed >= job.num_prompt:
                worker.remember(job, job.num_prompt, in_tiers=job.leg != _Leg.DECODE)
            if job.num_computed == job.num_tokens:
                self._sampled(now_s, worker, job)
        self._kick(now_s, worker)

    def _sampled(self, now_s: float, worker: _Worker, job: _Job) -> None:
        job.num_sampled += 1
        job.num_tokens += 1
        if job.leg != _Leg.PREFILL:  # its first token is its answer's start (a prefill answers once pushed)
            self._answered(worker, job)
        if job.leg == _Leg.WHOLE or (job.leg == _Leg.DECODE and job.num_sampled > 1):
            self.timings[job.index].token_times_s.append(now_s)
        if job.num_sampled < job.num_output:
            return
        worker.running.remove(job)
        worker.in_flight -= 1
        worker.remember(job, job.num_tokens - 1, in_tiers=False)
        if job.leg == _Leg.PREFILL:
            start_s = max(now_s, min(worker.sender_free_s))
            done_s = start_s + self.moves.push_s(job.num_prompt)
            worker.sender_free_s[worker.sender_free_s.index(min(worker.sender_free_s))] = done_s
            self.prefill_of[job.index] = worker
            self._at(done_s, "pushed", job)

    def _answered(self, worker: _Worker, job: _Job) -> None:
        worker.pending_prefill.remove(job.queued_tokens)
        job.queued_tokens = 0

    def _pushed(self, now_s: float, job: _Job) -> None:
        self._answered(self.prefill_of.pop(job.index), job)
        self.timings[job.index].token_times_s.append(now_s)  # the router sends prefill's first token
        if job.request.output_tokens > 1:
            self._start(now_s, self.decode_for.pop(job.index), _Leg.DECODE, job.index)


# ---------------------------------------------------------------------------------------------- figures


@dataclass(frozen=True, slots=True)
class Prediction:
    """A layout's predicted figures over one workload (seconds; rates per second)."""

    num_requests: int
    duration_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    output_tokens_per_s: float
    requests_per_s: float
    goodput_requests_per_s: float  # requests meeting the SLO, per second of the run
    slo_attainment: float  # share of requests meeting the SLO
    utilization: dict[str, float]


def summarize(result: SimResult, slo: Slo) -> Prediction:
    """The percentiles (interpolated, as ``splitserve bench`` computes them), throughput and goodput."""
    timings = [t for t in result.timings if t.token_times_s]
    ttfts = [t.ttft_s for t in timings]
    itls = [gap for t in timings for gap in t.itls_s]
    good = sum(1 for t in timings if _meets(t, slo))
    duration_s = result.duration_s
    return Prediction(
        num_requests=len(timings),
        duration_s=duration_s,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        itl_p50_s=percentile(itls, 50) if itls else 0.0,
        itl_p99_s=percentile(itls, 99) if itls else 0.0,
        output_tokens_per_s=sum(len(t.token_times_s) for t in timings) / duration_s,
        requests_per_s=len(timings) / duration_s,
        goodput_requests_per_s=good / duration_s,
        slo_attainment=good / len(timings) if timings else math.nan,
        utilization=result.utilization,
    )


def _meets(timing: RequestTiming, slo: Slo) -> bool:
    itls = timing.itls_s
    return timing.ttft_s <= slo.ttft_s and (not itls or percentile(itls, 99) <= slo.itl_s)

"""The planner predicts the router and the scheduler that really run: one trace through each pair, step by step.

- **Routing.** A planner workload is given token ids (a group's requests share their first ``prefix_tokens``,
  and a prompt's tokens that a later request of its group takes as its prefix), then sent both through the
  router's policies (``router/policies.py``, on real block hashes, its prefix index and its KV index) and
  through the planner's routing (``planner/routing.py``, on prefix groups). The load the two see is the same:
  requests answer and finish at the same moments. Every pick must be the same worker with the same tokens.
- **Scheduling.** A trace of prompts and outputs runs through the engine's ``Scheduler`` (on a real KV cache
  manager, no model) and through the simulator's worker; every step must schedule the same requests with the
  same token counts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from splitserve.config import Role, RouterConfig, RoutingStrategy, SchedulerConfig, SchedulingPolicy
from splitserve.planner.costs import LoadCost
from splitserve.planner.routing import RoutingQuery, SimRouter
from splitserve.planner.workload import TraceRequest, WorkloadShape, generate
from splitserve.policy.balance import NOTHING_UNSEEN, PendingPrefill, Unseen
from splitserve.policy.scheduling import StepRate
from splitserve.protocol.kv_events import EventKind, Tier
from splitserve.router.cost import PrefillCostModel
from splitserve.router.discovery import Worker
from splitserve.router.kv_index import KVIndex
from splitserve.router.policies import RoutingRequest, build_policy

BLOCK_SIZE = 16
URLS = [f"http://worker-{i}:8000" for i in range(4)]


def token_ids(trace: list[TraceRequest]) -> list[list[int]]:
    """Each request's prompt: its group's stream where the request shares it (its prefix, and what a later
    request of the group takes as prefix), its own tokens elsewhere."""
    later_prefix = [0] * len(trace)
    reach: dict[str, int] = {}
    for i in range(len(trace) - 1, -1, -1):
        group = trace[i].prefix_group
        if group is not None:
            later_prefix[i] = reach.get(group, 0)
            reach[group] = max(reach.get(group, 0), trace[i].prefix_tokens)
    streams: dict[str, list[int]] = {}
    prompts = []
    for i, request in enumerate(trace):
        shared = 0
        if request.prefix_group is not None:
            shared = max(request.prefix_tokens, min(request.prompt_tokens, later_prefix[i]))
            stream = streams.setdefault(request.prefix_group, [])
            rng = random.Random(request.prefix_group)
            while len(stream) < shared:
                stream.append(rng.randrange(30_000))  # a group's tokens: below 30,000, its own sequence
        own = [30_000 + i * 10_000 + p for p in range(shared, request.prompt_tokens)]  # nobody else's
        prompts.append(streams.get(request.prefix_group or "", [])[:shared] + own)
    return prompts


@dataclass(eq=False)
class SimWorker:
    """The planner's view of one worker; ``held`` is what its engine cache holds, by group."""

    name: str
    s_per_token: float = 1e-3
    in_flight: int = 0
    pending_prefill: PendingPrefill = field(default_factory=PendingPrefill)
    held: dict[str, int] = field(default_factory=dict)
    unseen: Unseen = NOTHING_UNSEEN  # the planner routes as the only router

    @property
    def pending_prefill_tokens(self) -> int:
        return self.pending_prefill.total

    def held_tokens(self, group: str, max_tokens: int) -> tuple[int, int]:
        return min(self.held.get(group, 0), max_tokens), 0


@pytest.mark.parametrize("cost_model", [True, False], ids=["score", "thresholds"])
@pytest.mark.parametrize("strategy", list(RoutingStrategy))
@pytest.mark.parametrize("shape", [WorkloadShape.CHAT, WorkloadShape.RAG, WorkloadShape.MIXED])
def test_the_planner_routes_a_trace_as_the_router_does(
    strategy: RoutingStrategy, shape: WorkloadShape, cost_model: bool
) -> None:
    trace = generate(shape, num_requests=240, seed=3, max_model_len=4096)
    prompts = token_ids(trace)
    workers = [Worker(url) for url in URLS]
    config = RouterConfig(backends=tuple(URLS), routing_strategy=strategy, block_size=BLOCK_SIZE)
    kv_index = KVIndex(BLOCK_SIZE, config.kv_chunk_size, 1 << 30)
    for worker in workers:
        kv_index.apply(worker.url, worker.url, True, [])
    rates = [1e-3, 1.5e-3, 0.8e-3, 1e-3]  # the router's measured seconds per token; the planner's calibrated
    cost = PrefillCostModel(dict(zip(URLS, rates, strict=True))) if cost_model else None
    router = build_policy(config, lambda: workers, kv_index, cost)
    sims = [SimWorker(url, rate) for url, rate in zip(URLS, rates, strict=True)]
    planner = SimRouter(strategy, sims, block_size=BLOCK_SIZE, cost_model=cost_model)
    rng = random.Random(7)
    outstanding: list[tuple[int, int, bool]] = []  # (worker, queued tokens, answered)
    for i, request in enumerate(trace):
        routing = RoutingRequest("/v1/completions", session_id=request.prefix_group, token_ids=prompts[i])
        routing.block_size = BLOCK_SIZE
        real = router.select(routing, workers)
        predicted = planner.select(RoutingQuery(request.prompt_tokens, request.prefix_group, request.prefix_tokens))
        at = f"request {i} ({request.prefix_group}, {request.prefix_tokens}/{request.prompt_tokens})"
        assert URLS.index(predicted.worker.name) == workers.index(real.worker), at
        assert (predicted.matched_tokens, predicted.uncached_tokens) == (real.matched_tokens, real.uncached_tokens), at
        chosen = workers.index(real.worker)
        router.on_routed(routing, real.worker)
        for side in (workers[chosen], sims[chosen]):
            side.in_flight += 1
            side.pending_prefill.add(real.uncached_tokens)
        outstanding.append((chosen, real.uncached_tokens, False))
        hashes = routing.block_hashes
        kv_index.apply(real.worker.url, real.worker.url, False, [(Tier.ENGINE, EventKind.STORED, hashes)])
        if request.prefix_group is not None:
            held = sims[chosen].held
            held[request.prefix_group] = max(held.get(request.prefix_group, 0), request.prompt_tokens)
        for j in reversed(range(len(outstanding))):  # the same answers and ends on both sides
            worker, queued, answered = outstanding[j]
            if not answered and rng.random() < 0.5:
                for side in (workers[worker], sims[worker]):
                    side.pending_prefill.remove(queued)
                outstanding[j] = (worker, queued, True)
            elif answered and rng.random() < 0.3:
                for side in (workers[worker], sims[worker]):
                    side.in_flight -= 1
                outstanding.pop(j)


# ---------------------------------------------------------------------------------------------- scheduling


def test_the_simulator_schedules_a_trace_as_the_engine_does() -> None:
    from splitserve.engine.block_pool import BlockPool
    from splitserve.engine.kv_cache_manager import KVCacheManager
    from splitserve.engine.request import Request
    from splitserve.engine.sampling_params import SamplingParams
    from splitserve.engine.scheduler import Scheduler
    from splitserve.planner import simulate
    from tests.support.scheduling import account_step

    rng = random.Random(11)
    trace = [TraceRequest(0.0, rng.choice([3, 20, 90, 300, 900]), rng.choice([1, 4, 30]), None, 0) for _ in range(40)]
    limits = simulate.EngineLimits(max_num_seqs=8, max_num_batched_tokens=128, step_time_target_s=0.032, max_wait_s=1e9)
    scheduler_config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=128, step_time_target=0.032, policy=SchedulingPolicy.LPM,
        max_wait_s=1e9, verify_sample_rate=0.0,
    )  # fmt: skip
    scheduler = Scheduler(scheduler_config, KVCacheManager(BlockPool(4096, enable_caching=False), BLOCK_SIZE), 4096)
    no_cost: Any = None  # the simulator's worker prices a step only when it runs one; here it only schedules
    moves = simulate.KVMoves(1, 0.0, 1.0, LoadCost(0.0, 0.0, 0.0))
    sim = simulate._Worker("w", simulate.SimulatedWorker(Role.COLOCATED, no_cost, limits), moves, None)
    # one measured step cost on both sides (1 ms per token): a target of 32 tokens, prompt chunks of up to 128
    scheduler.step_rate = StepRate(large=(100.0, 0.1))
    sim.step_rate = StepRate(large=(100.0, 0.1))
    by_id: dict[str, int] = {}

    def arrive(i: int, request: TraceRequest) -> None:  # on both sides at once
        params = SamplingParams(max_tokens=request.output_tokens, ignore_eos=True)
        real = Request(f"r{i}", list(range(1, request.prompt_tokens + 1)), params, arrival_time=float(i))
        by_id[real.request_id] = i
        scheduler.add(real)
        sim.add(simulate._Job(i, simulate._Leg.WHOLE, request, float(i), request.prompt_tokens, request.output_tokens))

    for step in range(10_000):
        if step % 3 == 0 and step // 3 < len(trace):  # one arrival every third step: short ones meet long prompts
            arrive(step // 3, trace[step // 3])
        out = scheduler.schedule()
        scheduled, _ = sim.schedule(now_s=0.0)
        real_step = [(by_id[s.request.request_id], s.num_new_tokens) for s in out.scheduled]
        assert real_step == [(job.index, n) for job, n in scheduled], f"step {step}"
        if not real_step and step // 3 >= len(trace):
            break
        account_step(scheduler, out)  # the engine's bookkeeping (LLMEngine._update)
        for job, num_new in scheduled:  # the simulator's (_Simulation._step_done and _sampled)
            job.num_computed += num_new
            if job.num_computed == job.num_tokens:
                job.num_sampled += 1
                job.num_tokens += 1
                if job.num_sampled >= job.num_output:
                    sim.running.remove(job)
    assert step > len(trace) and not scheduler.num_unfinished and not sim.running and not sim.waiting

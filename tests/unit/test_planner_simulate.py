"""The planner's simulator on scripted cases with known answers: queueing theory, a decode batch, a KV push,
chunked prefill, prefix caches and routing."""

from __future__ import annotations

import random

import pytest

from splitserve.config import Role, RoutingStrategy
from splitserve.planner.costs import DecodeCost, LoadCost, PrefillCost, StepCost
from splitserve.planner.simulate import (
    EngineLimits,
    KVMoves,
    SimulatedWorker,
    Slo,
    Topology,
    simulate,
    summarize,
)
from splitserve.planner.workload import TraceRequest

NO_LOADS = LoadCost(0.0, 0.0, 0.0)
FREE_MOVES = KVMoves(kv_bytes_per_token=1000, push_base_s=0.0, push_bytes_per_s=1e12, loads=NO_LOADS)


def step_cost(
    prefill: tuple[float, float, float] = (0.0, 0.0, 0.0), decode: tuple[float, float, float] = (0.0, 0.0, 0.0)
) -> StepCost:
    return StepCost(PrefillCost(*prefill), DecodeCost(*decode))


# The scripted cases count whole budgets: no step-time target (its own case is below)
UNTARGETED = EngineLimits(step_time_target_s=0)


def colocated(cost: StepCost, n: int = 1, limits: EngineLimits | None = None, **kwargs: object) -> Topology:
    spec = SimulatedWorker(Role.COLOCATED, cost, limits or UNTARGETED)
    return Topology((spec,) * n, **kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- queueing


def test_one_worker_with_deterministic_service_waits_as_pollaczek_khinchine_says() -> None:
    """M/D/1: Poisson arrivals at rate lambda, service S: mean wait lambda S^2 / (2 (1 - rho))."""
    service_s, rate = 1.0, 0.7
    rng = random.Random(7)
    requests, at_s = [], 0.0
    for _ in range(40_000):
        at_s += rng.expovariate(rate)
        requests.append(TraceRequest(at_s, 100, 1))
    limits = EngineLimits(max_num_seqs=1, max_num_batched_tokens=4096, step_time_target_s=0)
    result = simulate(requests, colocated(step_cost(prefill=(service_s, 0.0, 0.0)), limits=limits), FREE_MOVES)
    waits = [t.ttft_s - service_s for t in result.timings]
    rho = rate * service_s
    expected = rate * service_s**2 / (2 * (1 - rho))
    assert sum(waits) / len(waits) == pytest.approx(expected, rel=0.04)
    assert min(waits) == pytest.approx(0.0, abs=1e-9)
    assert result.utilization["colocated-0"] == pytest.approx(rho, rel=0.02)


# ---------------------------------------------------------------------------------------------- exact step times


def test_a_decode_batch_steps_exactly_as_the_cost_model_says() -> None:
    """Eight requests at once: one prefill step for all, then decode steps whose time grows with the context."""
    prefill, decode = (0.1, 0.001, 0.0), (0.02, 0.005, 1e-5)
    num_seqs, prompt, output = 8, 32, 10
    requests = [TraceRequest(0.0, prompt, output) for _ in range(num_seqs)]
    result = simulate(requests, colocated(step_cost(prefill, decode)), FREE_MOVES)
    first_s = 0.1 + num_seqs * prompt * 0.001
    itls = [0.02 + 0.005 * num_seqs + 1e-5 * num_seqs * (prompt + j) for j in range(output - 1)]
    for timing in result.timings:
        assert timing.ttft_s == pytest.approx(first_s, rel=1e-12)
        assert timing.itls_s == pytest.approx(itls, rel=1e-9)
    prediction = summarize(result, Slo(ttft_s=1.0, itl_s=1.0))
    assert prediction.duration_s == pytest.approx(first_s + sum(itls), rel=1e-12)
    assert prediction.output_tokens_per_s == pytest.approx(num_seqs * output / (first_s + sum(itls)), rel=1e-12)
    assert prediction.goodput_requests_per_s == pytest.approx(prediction.requests_per_s)


def test_a_long_prompt_is_chunked_by_the_step_budget() -> None:
    """2,500 tokens with a budget of 1,024: three steps, each paying the base, and the quadratic term per chunk."""
    prefill = (0.05, 0.001, 1e-7)
    limits = EngineLimits(max_num_batched_tokens=1024, step_time_target_s=0)
    result = simulate([TraceRequest(0.0, 2500, 1)], colocated(step_cost(prefill), limits=limits), FREE_MOVES)
    chunks = [(0, 1024), (1024, 2048), (2048, 2500)]
    expected = sum(0.05 + 0.001 * (e - s) + 1e-7 * (e * e - s * s) for s, e in chunks)
    assert result.timings[0].ttft_s == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(2 * 0.05 + PrefillCost(*prefill).prompt_s(2500), rel=1e-12)


def test_a_decode_beside_a_prompt_chunk_runs_on_the_prefill_path() -> None:
    """A running request decodes in the same step as a newcomer's prompt: the step is priced as prefill."""
    prefill, decode = (0.1, 0.001, 0.0), (0.02, 0.0, 0.0)
    requests = [TraceRequest(0.0, 100, 3), TraceRequest(0.05, 200, 1)]
    result = simulate(requests, colocated(step_cost(prefill, decode)), FREE_MOVES)
    first = result.timings[0]
    assert first.ttft_s == pytest.approx(0.1 + 0.1)  # alone: 100 tokens
    mixed_s = 0.1 + 0.001 * 200 + 0.001 * 1  # the newcomer's prompt and one decode token
    assert first.itls_s == pytest.approx([mixed_s, 0.02])
    assert result.timings[1].token_times_s == pytest.approx([0.2 + mixed_s])


def test_with_a_step_time_target_a_short_request_passes_a_long_prompt_in_one_short_step() -> None:
    """The simulator measures its steps as the engine does: after the first (whole-budget) chunk, a long prompt
    runs in chunks of 4 targets, and a short request arriving beside it is admitted in a step of about one target."""
    prefill = (0.01, 0.001, 0.0)  # 10 ms a step, 1 ms a token
    limits = EngineLimits(max_num_batched_tokens=1024, step_time_target_s=0.05)
    requests = [TraceRequest(0.0, 3000, 1), TraceRequest(1.2, 40, 1)]
    result = simulate(requests, colocated(step_cost(prefill), limits=limits), FREE_MOVES)
    short = result.timings[1]
    # the step in flight at 1.2 s is at most 4 targets long (the line's fit: 1.034 s / 1024 tokens, 200 tokens)
    assert short.ttft_s < 4 * 0.05 + 0.01 + 0.001 * (40 + 16) + 1e-9
    untargeted = simulate(requests, colocated(step_cost(prefill)), FREE_MOVES)
    assert untargeted.timings[1].ttft_s > 0.5  # behind 1,024-token chunks


# ---------------------------------------------------------------------------------------------- disaggregation


def dpd(cost: StepCost, threshold: int, moves: KVMoves, num_prefill: int = 1) -> Topology:
    workers = (SimulatedWorker(Role.PREFILL, cost),) * num_prefill + (SimulatedWorker(Role.DECODE, cost),)
    return Topology(workers, RoutingStrategy.ROUNDROBIN, threshold)


def test_a_kv_push_adds_exactly_its_time_to_the_first_token() -> None:
    cost = step_cost(prefill=(0.05, 0.001, 0.0), decode=(0.01, 0.0, 0.0))
    moves = KVMoves(kv_bytes_per_token=1000, push_base_s=0.02, push_bytes_per_s=1e9, loads=LoadCost(1e-6, 0.0, 0.0))
    request = [TraceRequest(0.0, 1000, 5)]
    alone = simulate(request, colocated(cost), moves).timings[0]
    split = simulate(request, dpd(cost, 512, moves), moves).timings[0]
    push_s = 0.02 + 1000 * 1000 / 1e9
    assert alone.ttft_s == pytest.approx(0.05 + 1.0, rel=1e-12)
    assert split.ttft_s - alone.ttft_s == pytest.approx(push_s, rel=1e-9)
    # decode: the pushed KV copied in and the last prompt token computed (its forced sample is not sent), then
    # one decode step per token
    admission_s = 0.05 + 0.001 * 1 + 999 * 1e-6
    assert split.itls_s == pytest.approx([admission_s + 0.01, 0.01, 0.01, 0.01], rel=1e-9)
    assert len(split.token_times_s) == 5


def test_prompts_under_the_threshold_never_visit_a_prefill_worker() -> None:
    cost = step_cost(prefill=(0.05, 0.001, 0.0), decode=(0.01, 0.0, 0.0))
    requests = [TraceRequest(i * 0.5, 300 + i, 3) for i in range(10)]
    result = simulate(requests, dpd(cost, 512, FREE_MOVES), FREE_MOVES)
    assert result.utilization["prefill-0"] == 0.0
    assert result.utilization["decode-1"] > 0
    at_threshold = simulate([TraceRequest(0.0, 512, 3)], dpd(cost, 512, FREE_MOVES), FREE_MOVES)
    assert at_threshold.utilization["prefill-0"] > 0  # "from this many tokens": the threshold itself splits


def test_a_one_token_answer_ends_at_the_prefill_worker() -> None:
    cost = step_cost(prefill=(0.05, 0.001, 0.0), decode=(0.01, 0.0, 0.0))
    result = simulate([TraceRequest(0.0, 1000, 1)], dpd(cost, 512, FREE_MOVES), FREE_MOVES)
    assert len(result.timings[0].token_times_s) == 1
    assert result.utilization["decode-1"] == 0.0


def test_pushes_share_two_sender_threads_per_prefill_worker() -> None:
    """Three prompts prefilled in one step: the third push waits for a sender thread."""
    cost = step_cost(prefill=(0.0, 0.0, 0.0), decode=(0.01, 0.0, 0.0))
    moves = KVMoves(kv_bytes_per_token=1, push_base_s=1.0, push_bytes_per_s=1e12, loads=NO_LOADS)
    requests = [TraceRequest(0.0, 600, 1) for _ in range(3)]
    result = simulate(requests, dpd(cost, 512, moves), moves)
    assert sorted(t.ttft_s for t in result.timings) == pytest.approx([1.0, 1.0, 2.0])


# ---------------------------------------------------------------------------------------------- caches and routing


def two_turns(gap_s: float = 10.0) -> list[TraceRequest]:
    return [TraceRequest(0.0, 600, 1, "conv", 0), TraceRequest(gap_s, 700, 1, "conv", 600)]


@pytest.mark.parametrize(
    ("strategy", "cached"),
    [
        (RoutingStrategy.PREFIXAWARE, True),
        (RoutingStrategy.KVAWARE, True),
        (RoutingStrategy.SESSION, True),
        (RoutingStrategy.ROUNDROBIN, False),
    ],
)
def test_a_follow_up_finds_its_prefix_where_the_strategy_sends_it(strategy: RoutingStrategy, cached: bool) -> None:
    cost = step_cost(prefill=(0.0, 0.001, 0.0))
    result = simulate(two_turns(), colocated(cost, n=2, strategy=strategy), FREE_MOVES)
    computed = 700 - 592 if cached else 700  # the cached prefix is whole blocks of 16 tokens
    assert result.timings[1].ttft_s == pytest.approx(computed * 0.001)


def test_an_evicted_prefix_is_computed_again_unless_l1_keeps_it() -> None:
    cost = step_cost(prefill=(0.0, 0.001, 0.0))
    moves = KVMoves(1000, 0.0, 1e12, LoadCost(0.0, 1e-5, 0.0))
    requests = [*two_turns(gap_s=20.0), TraceRequest(10.0, 900, 1, "other", 0)]
    requests.sort(key=lambda r: r.arrival_s)
    small = EngineLimits(cache_tokens=1000)  # "other" (900 tokens) evicts "conv" (600)
    evicted = simulate(requests, colocated(cost, limits=small), moves).timings[2]
    assert evicted.ttft_s == pytest.approx(0.7)
    with_l1 = EngineLimits(cache_tokens=1000, l1_tokens=10_000)
    loaded = simulate(requests, colocated(cost, limits=with_l1), moves).timings[2]
    assert loaded.ttft_s == pytest.approx((700 - 592) * 0.001 + 592 * 1e-5)


def test_a_shared_l2_serves_a_prefix_computed_on_another_worker_after_its_fetch() -> None:
    cost = step_cost(prefill=(0.0, 0.001, 0.0))
    moves = KVMoves(1000, 0.0, 1e12, LoadCost(2e-6, 0.0, 1e-4))
    roundrobin = dict(strategy=RoutingStrategy.ROUNDROBIN)
    plain = simulate(two_turns(), colocated(cost, n=2, **roundrobin), moves).timings[1]
    shared = simulate(two_turns(), colocated(cost, n=2, l2_tokens=1 << 20, **roundrobin), moves).timings[1]
    assert plain.ttft_s == pytest.approx(0.7)
    assert shared.ttft_s == pytest.approx(592 * 1e-4 + 592 * 2e-6 + (700 - 592) * 0.001)


def test_the_load_guard_spreads_one_hot_prefix() -> None:
    """prefixaware keeps a group on its worker until that worker has badly more in flight than the other."""
    cost = step_cost(prefill=(0.0, 0.001, 0.0), decode=(0.01, 0.0, 0.0))
    requests = [TraceRequest(i * 0.001, 600, 200, "hot", 500) for i in range(20)]
    result = simulate(requests, colocated(cost, n=2, strategy=RoutingStrategy.PREFIXAWARE), FREE_MOVES)
    assert all(share > 0.3 for share in result.utilization.values())


def test_the_simulation_is_deterministic() -> None:
    rng = random.Random(1)
    requests, at_s = [], 0.0
    for i in range(300):
        at_s += rng.expovariate(2.0)
        requests.append(TraceRequest(at_s, rng.randint(50, 3000), rng.randint(1, 100), f"g{i % 7}", 40))
    cost = step_cost(prefill=(0.01, 0.0005, 1e-8), decode=(0.01, 0.002, 1e-6))
    workers = (SimulatedWorker(Role.PREFILL, cost), *[SimulatedWorker(Role.DECODE, cost)] * 2)
    topology = Topology(workers, RoutingStrategy.KVAWARE, 1024)
    moves = KVMoves(23040, 0.001, 1e9, LoadCost(1e-5, 1e-5, 1e-5))
    first, second = simulate(requests, topology, moves), simulate(requests, topology, moves)
    assert first == second
    assert all(len(t.token_times_s) == r.output_tokens for t, r in zip(first.timings, requests, strict=True))


def test_goodput_counts_requests_within_both_limits() -> None:
    cost = step_cost(prefill=(0.0, 0.001, 0.0), decode=(0.05, 0.0, 0.0))
    requests = [TraceRequest(0.0, 100, 3), TraceRequest(10.0, 2000, 3)]  # TTFT 0.1 s and 2 s
    result = simulate(requests, colocated(cost, limits=EngineLimits(max_num_batched_tokens=4096)), FREE_MOVES)
    assert summarize(result, Slo(ttft_s=1.0, itl_s=1.0)).slo_attainment == 0.5
    assert summarize(result, Slo(ttft_s=5.0, itl_s=0.04)).slo_attainment == 0.0
    assert summarize(result, Slo(ttft_s=5.0, itl_s=0.0501)).slo_attainment == 1.0


def test_a_topology_mixing_colocated_and_disaggregated_workers_is_refused() -> None:
    cost = step_cost()
    with pytest.raises(ValueError, match="colocated workers, or prefill and decode ones"):
        mixed = Topology((SimulatedWorker(Role.COLOCATED, cost), SimulatedWorker(Role.DECODE, cost)))
        simulate([TraceRequest(0.0, 10, 1)], mixed, FREE_MOVES)
    with pytest.raises(ValueError, match="needs at least one decode worker"):
        simulate([TraceRequest(0.0, 10, 1)], Topology((SimulatedWorker(Role.PREFILL, cost),)), FREE_MOVES)


@pytest.mark.parametrize(
    ("strategy", "num_prefills"), [(RoutingStrategy.PREFIXAWARE, 1), (RoutingStrategy.ROUNDROBIN, 2)]
)
def test_a_follow_up_the_decode_worker_mostly_holds_goes_straight_to_it(
    strategy: RoutingStrategy, num_prefills: int
) -> None:
    """The router disaggregates on the tokens the decode worker is not believed to hold, not the whole prompt."""
    cost = step_cost(prefill=(0.1, 0.001, 0.0), decode=(0.01, 0.0, 0.0))
    topology = Topology((SimulatedWorker(Role.PREFILL, cost), SimulatedWorker(Role.DECODE, cost)), strategy, 512)
    result = simulate(two_turns(), topology, FREE_MOVES)
    prefill_busy_s = result.utilization["prefill-0"] * result.duration_s
    # the second prefill finds the first prompt in the prefill worker's own cache
    assert prefill_busy_s == pytest.approx(0.1 + 0.6 + (num_prefills - 1) * (0.1 + (700 - 592) * 0.001))

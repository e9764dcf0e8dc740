"""The step-time target (``policy.scheduling``): the engine's step cost measured as a line, each step's budget
from it, and the real scheduler on a scripted mix whose steps cost a known line of their tokens."""

from __future__ import annotations

import random

import pytest

from splitserve.config import SchedulerConfig
from splitserve.engine.block_pool import BlockPool
from splitserve.engine.kv_cache_manager import KVCacheManager
from splitserve.engine.request import Request
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import Scheduler
from splitserve.policy.scheduling import COLD_STEP_FACTOR, MIN_PREFILL_CHUNK, StepRate, StepTokens, step_budget
from tests.support.scheduling import account_step

FIXED_S, PER_TOKEN_S = 0.012, 0.0008  # a CPU's step: 12 ms, then 0.8 ms a token


def step_s(num_tokens: int) -> float:
    return FIXED_S + PER_TOKEN_S * num_tokens


def test_the_rate_finds_the_line_through_small_and_large_steps() -> None:
    rate = StepRate()
    assert rate.tokens_within(0.05) is None  # nothing measured
    for n in (1, 4, 8, 300, 512, 2, 700):
        rate.observe(n, step_s(n))
    fixed_s, per_token = rate.line() or (0.0, 0.0)
    assert per_token == pytest.approx(PER_TOKEN_S, rel=1e-6)
    assert fixed_s == pytest.approx(FIXED_S, rel=1e-6)
    assert rate.tokens_within(0.05) == int((0.05 - FIXED_S) / PER_TOKEN_S)
    assert rate.step_tokens(0.05) == StepTokens(int((0.05 - FIXED_S) / PER_TOKEN_S), int((0.2 - FIXED_S) / PER_TOKEN_S))


def test_without_small_steps_the_line_goes_through_zero() -> None:
    rate = StepRate()
    rate.observe(500, 0.5)
    assert rate.line() == (0.0, 0.001)
    assert rate.tokens_within(0.0001) == 1  # at least one token


def test_the_budget_of_each_kind_of_step() -> None:
    steps = StepTokens(short=50, cold=200)
    # nothing measured or no target: the whole budget, no cap
    assert step_budget(1024, None, num_decodes=3, head_uncached=40) == (1024, None)
    # nothing short waits: up to 4 targets
    assert step_budget(1024, steps, num_decodes=3, head_uncached=None) == (200, None)
    assert step_budget(1024, steps, num_decodes=3, head_uncached=500) == (200, None)
    assert step_budget(150, steps, num_decodes=3, head_uncached=None) == (150, None)
    # a short request waits: one target, the running prompts get what it leaves
    assert step_budget(1024, steps, num_decodes=3, head_uncached=20) == (50, 27)
    # a short request longer than the target: it and the least chunk
    assert step_budget(1024, steps, num_decodes=3, head_uncached=100) == (119, MIN_PREFILL_CHUNK)
    # many decodes: they always fit, with the least chunk beside them
    assert step_budget(1024, StepTokens(10, 40), num_decodes=64, head_uncached=None) == (64 + MIN_PREFILL_CHUNK, None)


def test_a_step_whose_fixed_cost_nears_the_target_still_carries_an_efficient_chunk() -> None:
    """A slow CPU or a large model: one step costs 0.3 s before any token, more than 4 targets of 0.05 s. Prompt
    chunks then take enough tokens that the fixed cost is at most a fifth of the step, not one token a step."""
    rate = StepRate()
    for n in (1, 2, 512, 600):
        rate.observe(n, 0.3 + 0.001 * n)
    steps = rate.step_tokens(0.05)
    assert steps is not None and steps.short == 1
    assert steps.cold == 1200  # 0.3 s fixed: 4 x 0.3 s of tokens at 1 ms each


def test_a_scripted_mix_keeps_its_steps_under_the_target() -> None:
    """Long cold prompts, short requests arriving now and then, and the decodes they leave behind: the scheduler
    learns the step line from the steps' times (a small step and a large one), then every step that admits a
    waiting short request costs at most the target (or the short request and the least chunk, where that is
    more), and every other at most 4 targets. Every request finishes."""
    target_s = 0.05
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048, step_time_target=target_s)
    scheduler = Scheduler(config, KVCacheManager(BlockPool(8192, enable_caching=False), 16), 8192)
    rng = random.Random(3)
    requests: list[Request] = []

    def arrive(name: str, num_tokens: int, max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = Request(name, [rng.randrange(1, 1000) for _ in range(num_tokens)], params, float(len(requests)))
        requests.append(request)
        scheduler.add(request)

    for i in range(3):
        arrive(f"cold{i}", 3000, 4)
    num_checked_short = num_checked_cold = 0
    for step in range(2000):
        if step % 7 == 3 and step < 400:
            arrive(f"short{step}", rng.randrange(10, 60), 8)
        if step % 90 == 0 and step < 400:
            arrive(f"cold-late{step}", 2500, 4)
        rate = scheduler.step_rate
        learned = rate.small is not None and rate.large is not None
        waiting_short = [r for r in scheduler.waiting if r.num_tokens <= 60]
        out = scheduler.schedule()
        if out.is_empty:
            assert not scheduler.num_unfinished
            break
        seconds = step_s(out.num_batched_tokens)
        if learned:
            num_decodes = sum(s.num_new_tokens == 1 for s in out.scheduled)
            if waiting_short:
                longest = max(r.num_tokens for r in waiting_short)
                bound = max(target_s, step_s(num_decodes + longest + MIN_PREFILL_CHUNK))
                num_checked_short += 1
            else:
                bound = max(COLD_STEP_FACTOR * target_s, step_s(num_decodes + MIN_PREFILL_CHUNK))
                num_checked_cold += 1
            assert seconds <= bound + 1e-9, f"step {step}: {out.num_batched_tokens} tokens"
        account_step(scheduler, out)
        scheduler.observe_step(out.num_batched_tokens, seconds)
    assert not scheduler.num_unfinished
    assert all(r.is_finished for r in requests)
    assert num_checked_short > 20 and num_checked_cold > 20

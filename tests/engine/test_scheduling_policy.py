"""Scheduling that lets cache hits through: ``lpm`` admits the request with the fewest tokens left to compute first (the
oldest first once one waited past ``max_wait_s``), and while a short request waits, the step aims at the step-time
target (the running prompts share what the short request leaves of it), so that a cached follow-up gets its first
token within one short step beside a cold prompt. The answers stay the same (greedy)."""

from __future__ import annotations

import time

import torch

from splitserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SchedulingPolicy
from splitserve.engine.engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams
from splitserve.model.decoder import DecoderForCausalLM
from splitserve.policy.scheduling import StepRate
from tests.support.engine import random_prompts

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
PROMPTS = random_prompts(2, 900, 900, seed=7)
COLD, CHAT = PROMPTS["r0"], PROMPTS["r1"][:400]
FOLLOW_UP = CHAT + PROMPTS["r1"][400:440]  # the same conversation, one turn on: 400 of 440 tokens cached


class ScriptedRate(StepRate):
    """A step cost of 1 ms per token, whatever the steps really take (so that budgets do not follow the test
    machine's speed)."""

    def __init__(self) -> None:
        super().__init__(large=(100.0, 0.1))

    def observe(self, num_tokens: int, seconds: float) -> None:
        pass


def engine_with(model: DecoderForCausalLM, **scheduler: object) -> LLMEngine:
    """At 1 ms per token the default target (50 ms) is 50 tokens: a step with prompt chunks takes up to 200 tokens,
    a step admitting a short request 50 (or the short request and 16 tokens of the running prompts)."""
    config = EngineConfig(
        model=ModelConfig(model="test", max_model_len=1024),
        cache=CacheConfig(block_size=16, num_gpu_blocks_override=400),
        scheduler=SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 256, **scheduler}),  # type: ignore[arg-type]
    )
    engine = LLMEngine(config, model, None, "test", torch.device("cpu"))
    engine.scheduler.step_rate = ScriptedRate()
    return engine


def steps_to_first_token(engine: LLMEngine) -> tuple[int, dict[str, list[int]]]:
    """Warm the chat's prefix, start the cold prompt, then send the follow-up: the engine steps until the
    follow-up's first token, then to the end. Returns those steps and every request's tokens."""
    tokens: dict[str, list[int]] = {"chat": [], "cold": [], "follow-up": []}
    engine.add_request("chat", CHAT, GREEDY)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    engine.add_request("cold", COLD, GREEDY)
    for out in engine.step():  # the cold prompt's first chunk
        tokens[out.request_id] += out.new_token_ids
    engine.add_request("follow-up", FOLLOW_UP, GREEDY)
    num_steps = 0
    while not tokens["follow-up"]:
        num_steps += 1
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return num_steps, tokens


def test_a_cached_follow_up_gets_its_first_token_in_one_step_beside_a_cold_prompt(
    tiny_model: DecoderForCausalLM,
) -> None:
    with_target, tokens = steps_to_first_token(engine_with(tiny_model))
    without, reference = steps_to_first_token(engine_with(tiny_model, policy=SchedulingPolicy.FCFS, step_time_target=0))
    assert with_target == 1  # 16 tokens of the cold prompt and the follow-up's 40 new ones, in one step
    assert without >= 3  # behind the cold prompt's remaining 256-token chunks (900 tokens in all)
    assert tokens == reference


def test_a_step_with_prompt_chunks_takes_at_most_four_targets(tiny_model: DecoderForCausalLM) -> None:
    engine = engine_with(tiny_model, max_num_batched_tokens=1024)
    engine.add_request("cold", COLD, GREEDY)
    assert engine.scheduler.schedule().num_batched_tokens == 200  # 4 x 50 ms at 1 ms per token


def test_before_any_step_is_measured_a_prompt_takes_the_whole_budget(tiny_model: DecoderForCausalLM) -> None:
    engine = engine_with(tiny_model, max_num_batched_tokens=1024)
    engine.scheduler.step_rate = StepRate()
    engine.add_request("cold", COLD, GREEDY)
    assert engine.scheduler.schedule().num_batched_tokens == 900


def admission_order(model: DecoderForCausalLM, **scheduler: object) -> list[str]:
    """Which of a cold prompt (arrived first) and a cached follow-up is admitted first, one at a time."""
    engine = engine_with(model, max_num_seqs=1, **scheduler)
    engine.add_request("chat", CHAT, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("cold", COLD[:300], GREEDY)
    engine.add_request("follow-up", FOLLOW_UP, GREEDY)
    order: list[str] = []
    while engine.has_unfinished_requests():
        engine.step()
        order += [r.request_id for r in engine.scheduler.running if r.request_id not in order]
    return order


def test_lpm_admits_the_fewest_uncached_tokens_first(tiny_model: DecoderForCausalLM) -> None:
    assert admission_order(tiny_model) == ["follow-up", "cold"]
    assert admission_order(tiny_model, policy=SchedulingPolicy.FCFS) == ["cold", "follow-up"]


def test_past_the_max_wait_the_oldest_goes_first(tiny_model: DecoderForCausalLM) -> None:
    assert admission_order(tiny_model, max_wait_s=0.0) == ["cold", "follow-up"]


def test_without_chunked_prefill_a_long_prompt_still_runs_whole(tiny_model: DecoderForCausalLM) -> None:
    engine = engine_with(tiny_model, max_num_batched_tokens=1024, enable_chunked_prefill=False)
    engine.add_request("cold", COLD, GREEDY)  # 900 tokens, past the 200 of 4 targets
    assert engine.scheduler.schedule().num_batched_tokens == 900


def test_the_backlog_counts_waiting_requests_whole_and_a_prefilling_one_by_what_it_has_left(
    tiny_model: DecoderForCausalLM,
) -> None:
    """What admission reads (``policy.admission``): a prompt being prefilled is running, and only its chunks still
    to compute are queued tokens; a request not yet started waits, whole; the cost per token is the measured one."""
    engine = engine_with(tiny_model, max_num_seqs=1)  # one seat; a step with prompt chunks takes 200 tokens
    engine.add_request("cold", COLD, GREEDY)
    engine.add_request("chat", CHAT, GREEDY)
    before = engine.backlog()
    assert (before.num_waiting, before.num_in_flight, before.prefill_tokens) == (2, 2, 900 + 400)
    engine.step()  # the cold prompt's first chunk
    after = engine.get_stats().backlog
    assert (after.num_waiting, after.num_in_flight, after.prefill_tokens) == (1, 2, 900 - 200 + 400)
    assert after.seconds_per_token == 1e-3 and after.oldest_waiting_since is not None


def test_a_preempted_request_waits_from_its_preemption_and_recomputes_its_output_too(
    tiny_model: DecoderForCausalLM,
) -> None:
    """Its queue age restarts (a long-running request sent back does not read as a 30 s old queue), and what it
    has left to compute is its prompt and the tokens it generated."""
    engine = engine_with(tiny_model)
    engine.add_request("chat", CHAT, SamplingParams(max_tokens=8, temperature=0.0))
    while not engine.requests["chat"].num_output_tokens:
        engine.step()
    engine.step()
    request = engine.requests["chat"]
    request.arrival_time = request.waiting_since = 0.0  # as if it had arrived long ago
    before = time.monotonic()
    engine.scheduler.running.remove(request)
    engine.scheduler._preempt(request)
    backlog = engine.backlog()
    assert backlog.oldest_waiting_since is not None and backlog.oldest_waiting_since >= before
    assert backlog.prefill_tokens == 400 + request.num_output_tokens

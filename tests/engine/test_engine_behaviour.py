"""Stopping rules, aborts and input validation of the engine."""

from __future__ import annotations

import pytest

from splitserve.engine.outputs import FinishReason
from splitserve.engine.sampling_params import SamplingParams
from tests.engine.conftest import EngineFactory, random_prompts, run_to_completion, tokens_of


def test_max_tokens_gives_length(make_engine: EngineFactory) -> None:
    outs = run_to_completion(make_engine(), random_prompts(1, 20, 20), SamplingParams(max_tokens=5, temperature=0))
    (out,) = outs.values()
    assert len(tokens_of(out)) == 5 and out[-1].finished and out[-1].finish_reason == FinishReason.LENGTH
    assert out[-1].num_prompt_tokens == 20 and out[-1].num_output_tokens == 5


def test_stop_token_ids_and_min_tokens(make_engine: EngineFactory) -> None:
    prompt = random_prompts(1, 30, 30)
    free_run = tokens_of(run_to_completion(make_engine(), prompt, SamplingParams(max_tokens=10, temperature=0))["r0"])
    stop_at = free_run[3]
    first = free_run.index(stop_at)
    params = SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(stop_at,))
    out = run_to_completion(make_engine(), prompt, params)["r0"]
    assert tokens_of(out) == free_run[: first + 1]
    assert out[-1].finish_reason == FinishReason.STOP and out[-1].stop_reason == stop_at
    # below min_tokens the stop token cannot even be sampled
    params = SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(stop_at,), min_tokens=10)
    out = run_to_completion(make_engine(), prompt, params)["r0"]
    assert len(tokens_of(out)) == 10 and stop_at not in tokens_of(out)


def test_abort_frees_blocks(make_engine: EngineFactory) -> None:
    engine = make_engine()
    engine.add_request("a", list(range(100)), SamplingParams(max_tokens=50, temperature=0))
    engine.add_request("b", list(range(50)), SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    engine.step()
    assert engine.pool.num_free_blocks < engine.pool.num_blocks
    engine.abort_request("a")
    engine.abort_request("b")
    engine.abort_request("unknown")
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_invalid_requests_raise_and_queue_nothing(make_engine: EngineFactory) -> None:
    engine = make_engine()
    params = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", [], params)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 512\)"):
        engine.add_request("a", [1, 512], params)
    with pytest.raises(ValueError, match="maximum context length is 1024 tokens"):
        engine.add_request("a", [1] * 1000, SamplingParams(max_tokens=100))
    engine.add_request("a", [1, 2], params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [1, 2], params)
    assert engine.get_stats().num_waiting == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": ("",)}, "stop strings"),
    ],
)
def test_sampling_params_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)

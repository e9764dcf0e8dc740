"""Stopping rules, aborts and input validation of the engine."""

from __future__ import annotations

import pytest
import torch

from splitserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from splitserve.engine.connector import KVLoad, LoadedTokens
from splitserve.engine.engine import LLMEngine
from splitserve.engine.outputs import FinishReason, RequestOutput
from splitserve.engine.request import Request
from splitserve.engine.sampling_params import SamplingParams
from splitserve.model.decoder import DecoderForCausalLM
from tests.support.engine import EngineFactory, random_prompts, run_to_completion, tokens_of


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


def test_one_token_prefill_chunk_samples_nothing(make_engine: EngineFactory) -> None:
    """With one budget token left, a prompt gets a one-token chunk: attention-wise a decode, but no sample."""
    prompts = {"a": list(range(1, 8)), "b": list(range(100, 120))}
    engine = make_engine(max_num_batched_tokens=8)
    engine.add_request("a", prompts["a"], SamplingParams(max_tokens=4, temperature=0))
    engine.add_request("b", prompts["b"], SamplingParams(max_tokens=4, temperature=0))
    first = engine.step()  # a: 7 prompt tokens, b: 1 of 20
    assert [o.request_id for o in first] == ["a"]
    assert engine.requests["b"].num_output_tokens == 0 and engine.requests["b"].num_computed_tokens == 1
    together = {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in _drain(engine, first).items()}
    for rid, prompt in prompts.items():
        alone = run_to_completion(make_engine(), {rid: prompt}, SamplingParams(max_tokens=4, temperature=0))
        assert together[rid] == tokens_of(alone[rid])


def _drain(engine: LLMEngine, first: list[RequestOutput]) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {"a": [], "b": []}
    for out in first:
        outputs[out.request_id].append(out)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def test_prefix_lookups_counted_once_per_request(make_engine: EngineFactory) -> None:
    """A request waiting for free blocks is looked up every step but counted once."""
    engine = make_engine(num_blocks=8, max_model_len=128)  # 128 tokens of KV
    params = SamplingParams(max_tokens=40, temperature=0)
    engine.add_request("a", list(range(1, 81)), params)  # 5 blocks now, 8 at the end
    engine.add_request("b", list(range(200, 260)), params)  # 4 blocks: waits until a is done
    num_steps_b_waited = 0
    while engine.has_unfinished_requests():
        engine.step()
        num_steps_b_waited += engine.get_stats().num_waiting
    stats = engine.get_stats()
    assert num_steps_b_waited > 10 and stats.num_preemptions == 0
    assert stats.prefix_cache_queries == 80 + 60


@pytest.mark.parametrize("length", [150, 160], ids=["partial-last-block", "whole-blocks"])
def test_the_same_prompt_arriving_n_times_at_once_is_computed_once(make_engine: EngineFactory, length: int) -> None:
    """Sequences admitted together whose next block the first is computing wait one step for it, then start from
    the prefix cache together (the last block copied): n sequences of one request cost one prompt."""
    engine = make_engine()
    prompt = random_prompts(1, length, length, seed=4)["r0"]
    params = SamplingParams(max_tokens=4, temperature=0)
    for rid in ("a", "b", "c", "d"):
        engine.add_request(rid, prompt, params)
    engine.step()
    assert engine.iteration_tokens.total == length and engine.get_stats().num_waiting == 3
    engine.step()  # the three others at once, each computing its last prompt token
    assert engine.get_stats().num_waiting == 0
    cached = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            cached.setdefault(out.request_id, out.num_cached_tokens)
    assert cached == {"a": 0, "b": length - 1, "c": length - 1, "d": length - 1}
    assert engine.iteration_tokens.total == length + 3 * 1 + 4 * 3  # the others' last prompt token, 3 decodes each


def test_stop_token_ids_outside_vocabulary_are_refused(make_engine: EngineFactory) -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match="stop_token_ids must be below the vocabulary size 512"):
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4, min_tokens=1, stop_token_ids=(512,)))
    assert not engine.has_unfinished_requests()


class FetchingConnector:
    """A connector whose answer for request "slow" is pending until ``ready`` (as while L2 is read)."""

    def __init__(self) -> None:
        self.ready = False
        self.finished: list[str] = []

    def register_kv_cache(self, kv_cache: object, block_size: int) -> None:
        pass

    def num_external_tokens(self, request: Request, num_cached: int) -> int | None:
        return None if request.request_id == "slow" and not self.ready else 0

    def lookup_tokens(self, request: Request, num_cached: int) -> tuple[tuple[str, int], ...]:
        return ()

    def update_state_after_alloc(self, request: Request, num_cached: int, num_external: int) -> None:
        pass

    def load_kv(self, load: KVLoad) -> LoadedTokens:
        return LoadedTokens()

    def save_completed_chunks(self, request: Request, block_ids: list[int]) -> None:
        pass

    def take_transfer_result(self, request_id: str) -> None:
        return None

    def request_finished(self, request: Request) -> None:
        self.finished.append(request.request_id)

    def stats(self) -> None:
        return None

    def close(self) -> None:
        pass


def test_a_request_whose_kv_is_still_fetched_lets_the_ones_behind_it_run(tiny_model: DecoderForCausalLM) -> None:
    connector = FetchingConnector()
    config = EngineConfig(
        model=ModelConfig(model="test", max_model_len=256),
        cache=CacheConfig(block_size=16, num_gpu_blocks_override=64),
        scheduler=SchedulerConfig(8, 256, True),
    )
    engine = LLMEngine(config, tiny_model, None, "test", torch.device("cpu"), [connector])
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("slow", list(range(1, 40)), params)
    engine.add_request("fast", list(range(50, 60)), params)
    outputs = [o for _ in range(3) for o in engine.step()]
    assert {o.request_id for o in outputs} == {"fast"} and outputs[-1].finished
    assert [r.request_id for r in engine.scheduler.waiting] == ["slow"]  # still first in line
    connector.ready = True
    outputs = [o for _ in range(3) for o in engine.step()]
    assert [o.request_id for o in outputs] == ["slow"] * 3 and outputs[-1].finished

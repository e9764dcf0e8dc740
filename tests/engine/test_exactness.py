"""The same tokens on every path, on the real SmolLM2-135M-Instruct with the defaults a worker starts with
(``--dtype auto``, ``--quantization auto``: the GGUF's quantized blocks): 200 greedy tokens of several prompts
cold, from the prefix cache, recomputed after eviction, chunked, beside eight other streams, with one thread
and two, and resumed from a prefix of the answer (what stream migration and a preemption replay). Seeded
sampling too. The paths through processes (L1/L2, disaggregation, a killed worker) are in ``tests/e2e``.

A path that computes a token's K/V another way changes the answer a few dozen tokens in (the prefix-cache hit
did, before every step ran through the one native forward step): hence outputs this long.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from splitserve.config import KVCacheDtype
from splitserve.engine.engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams
from tests.support.engine import build_engine, run_to_completion, tokens_of
from tests.support.real_model import RealChats as Real
from tests.support.real_model import smollm2_chats

pytestmark = pytest.mark.slow

NUM_TOKENS = 200
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True)
QUESTIONS = {
    "lighthouse": "Write a long story about a lighthouse keeper.",
    "france": "What is the capital of France? Answer in one sentence.",
    "bread": "I want to bake my first loaf of bread at home. Give me a simple recipe with quantities and timings.",
}


@pytest.fixture(scope="module")
def real() -> Iterator[Real]:
    with smollm2_chats(QUESTIONS, lambda chats, prompt: answer(engine(chats), prompt)) as chats:
        yield chats


def engine(real: Real, **kwargs: Any) -> LLMEngine:
    options = {"num_blocks": 600, "max_model_len": 2048, "max_num_seqs": 16, **kwargs}
    return build_engine(real.model, real.tokenizer, **options)


def answer(eng: LLMEngine, prompt: list[int], params: SamplingParams = GREEDY, request_id: str = "r") -> list[int]:
    return tokens_of(run_to_completion(eng, {request_id: prompt}, params)[request_id])


def test_the_answers_are_real_text(real: Real) -> None:
    assert all(len(tokens) == NUM_TOKENS for tokens in real.answers.values())
    assert "Paris" in real.tokenizer.decode(real.answers["france"])
    assert real.model._forward_step is not None  # every step runs the native forward step


def test_a_repeated_request_answers_from_the_prefix_cache_as_it_did_cold(real: Real) -> None:
    eng = engine(real)
    for name, prompt in real.prompts.items():
        first = run_to_completion(eng, {f"{name}-1": prompt}, GREEDY)[f"{name}-1"]
        again = run_to_completion(eng, {f"{name}-2": prompt}, GREEDY)[f"{name}-2"]
        assert again[0].num_cached_tokens == len(prompt) - 1  # every prompt token but the last from the cache
        assert tokens_of(first) == tokens_of(again) == real.answers[name], name


def test_a_prompt_recomputed_after_eviction_answers_the_same(real: Real) -> None:
    # 30 blocks of 16 hold one request at a time: each new prompt evicts the last one's blocks
    eng = engine(real, num_blocks=30, max_model_len=480)
    for name, prompt in [*real.prompts.items(), *real.prompts.items()][1:]:  # the first one's blocks are gone too
        assert answer(eng, prompt) == real.answers[name], name


def test_chunked_prefill_and_eight_streams_beside_change_nothing(real: Real) -> None:
    distractors = {f"d{i}": real.prompts[name][: 20 + 7 * i] for i, name in enumerate(list(real.prompts) * 3)}
    batch = {**{f"p-{name}": p for name, p in real.prompts.items()}, **dict(list(distractors.items())[:8])}
    outputs = run_to_completion(engine(real, max_num_batched_tokens=16, step_time_target=0), batch, GREEDY)
    for name in real.prompts:
        assert tokens_of(outputs[f"p-{name}"]) == real.answers[name], name


def test_one_thread_answers_as_two_do(real: Real) -> None:
    torch.set_num_threads(1)
    try:
        for name, prompt in real.prompts.items():
            assert answer(engine(real), prompt) == real.answers[name], name
    finally:
        torch.set_num_threads(2)


def test_a_resumed_answer_continues_as_the_uninterrupted_one(real: Real) -> None:
    """What migration sends another worker: the prompt and the tokens so far, recomputed as one prompt."""
    for name, prompt in real.prompts.items():
        for cut in (1, 150) if name == "lighthouse" else (57,):
            rest = SamplingParams(max_tokens=NUM_TOKENS - cut, temperature=0.0, ignore_eos=True)
            resumed = answer(engine(real), prompt + real.answers[name][:cut], rest)
            assert real.answers[name][:cut] + resumed == real.answers[name], (name, cut)


def test_seeded_sampling_is_the_same_cold_cached_beside_others_and_resumed(real: Real) -> None:
    prompt = real.prompts["lighthouse"]
    cold = answer(engine(real), prompt, SEEDED)
    eng = engine(real)
    answer(eng, prompt, SEEDED, "warm-up")
    assert answer(eng, prompt, SEEDED, "cached") == cold
    beside = run_to_completion(engine(real), {"p": prompt, "q": real.prompts["bread"]}, SEEDED)
    assert tokens_of(beside["p"]) == cold
    rest = SamplingParams(max_tokens=NUM_TOKENS - 80, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True)
    assert cold[:80] + answer(engine(real), prompt + cold[:80], rest) == cold
    greedy = real.answers["lighthouse"]
    assert cold != greedy  # it did sample


def test_an_int8_kv_cache_answers_the_same_cold_cached_chunked_beside_others_and_resumed(real: Real) -> None:
    """``--kv-cache-dtype int8``: every path reads the same stored bytes, so the answers agree with each other (not
    with the bfloat16 cache's: ``benchmarks/kv_packed.py`` measures how far they agree). fp8 rows differ from int8's
    in the widening only: ``test_batch_invariance.py`` and ``test_kv_packed.py`` run them through the forward step."""
    packed = KVCacheDtype.INT8
    cold = {name: answer(engine(real, kv_cache_dtype=packed), prompt) for name, prompt in real.prompts.items()}
    assert "Paris" in real.tokenizer.decode(cold["france"])
    eng = engine(real, kv_cache_dtype=packed)
    for name, prompt in real.prompts.items():
        assert answer(eng, prompt, request_id=f"{name}-1") == cold[name], name
        again = run_to_completion(eng, {f"{name}-2": prompt}, GREEDY)[f"{name}-2"]
        assert again[0].num_cached_tokens == len(prompt) - 1 and tokens_of(again) == cold[name], name
    distractors = {f"d{i}": real.prompts["bread"][: 20 + 9 * i] for i in range(6)}
    chunked = engine(real, kv_cache_dtype=packed, max_num_batched_tokens=16, step_time_target=0)
    outputs = run_to_completion(chunked, {**{f"p-{n}": p for n, p in real.prompts.items()}, **distractors}, GREEDY)
    for name in real.prompts:
        assert tokens_of(outputs[f"p-{name}"]) == cold[name], name
    rest = SamplingParams(max_tokens=NUM_TOKENS - 90, temperature=0.0, ignore_eos=True)
    story, prompt = cold["lighthouse"], real.prompts["lighthouse"]
    assert story[:90] + answer(engine(real, kv_cache_dtype=packed), prompt + story[:90], rest) == story

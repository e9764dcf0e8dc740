"""Penalties, logit bias, min-p and log-probabilities in the engine, on the tiny random-weight Llama in float32:
each against a plain loop over the paged model that applies vLLM's formula itself, and the same whether the
prompt is chunked, cached, preempted or decoded beside other requests."""

from __future__ import annotations

import math

import torch

from splitserve.config import SpeculativeConfig
from splitserve.engine.outputs import RequestOutput, TokenLogprobs
from splitserve.engine.sampler import draw
from splitserve.engine.sampling_params import SamplingParams
from splitserve.model.decoder import DecoderForCausalLM
from tests.support.engine import EngineFactory, random_prompts, run_to_completion, tokens_of
from tests.support.paged import PagedRunner

PROMPTS = random_prompts(3, 20, 70, seed=5)
NUM_TOKENS = 40


def penalized(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    """vLLM's order, written out: the bias, repetition over prompt and output, then frequency and presence."""
    row = logits.clone()
    for token, bias in params.logit_bias:
        row[token] += bias
    for token in set(prompt + output):
        value = row[token]
        row[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token in set(output):
        row[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return row


def reference(
    model: DecoderForCausalLM, prompt: list[int], params: SamplingParams
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens under the penalties, and the raw log-softmax at each position (prompt's included)."""
    runner = PagedRunner(model, len(prompt) + params.max_tokens)
    with torch.inference_mode():
        logits = runner.prefill(prompt)
        rows = list(torch.log_softmax(logits.float(), dim=-1))
        output: list[int] = []
        last = logits[-1]
        while len(output) < params.max_tokens:
            output.append(int(penalized(last.float(), prompt, output, params).argmax()))
            last = runner.decode(output[-1])
            rows.append(torch.log_softmax(last.float(), dim=-1))
    return output, rows


def logprobs_of(outputs: list[RequestOutput]) -> list[TokenLogprobs]:
    return [entry for o in outputs for entry in o.new_logprobs or []]


def assert_entry(entry: TokenLogprobs | None, row: torch.Tensor, token: int, k: int) -> None:
    assert entry is not None and entry.token_id == token
    assert math.isclose(entry.logprob, float(row[token]), abs_tol=1e-5)
    assert entry.rank == int((row >= row[token]).sum())
    values, ids = torch.topk(row, k)
    assert [t for t, _ in entry.top] == ids.tolist()
    assert all(math.isclose(a, float(b), abs_tol=1e-5) for (_, a), b in zip(entry.top, values, strict=True))


def test_penalties_and_bias_pick_the_tokens_the_formula_picks(
    make_engine: EngineFactory, tiny_model: DecoderForCausalLM
) -> None:
    params = SamplingParams(
        max_tokens=NUM_TOKENS, temperature=0.0, presence_penalty=0.5, frequency_penalty=0.7,
        repetition_penalty=1.3, logit_bias=((7, 3.0),),
    )  # fmt: skip
    outputs = run_to_completion(make_engine(), PROMPTS, params)
    for name, prompt in PROMPTS.items():
        want, _ = reference(tiny_model, prompt, params)
        assert tokens_of(outputs[name]) == want, name
    plain = run_to_completion(make_engine(), PROMPTS, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0))
    assert any(tokens_of(plain[n]) != tokens_of(outputs[n]) for n in PROMPTS)  # the penalties did change them


def test_the_same_penalized_tokens_in_small_chunks_with_drafts_and_after_preemption(make_engine: EngineFactory) -> None:
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, frequency_penalty=0.4, repetition_penalty=1.2)
    alone = {n: tokens_of(run_to_completion(make_engine(), {n: p}, params)[n]) for n, p in PROMPTS.items()}
    engines = {
        "chunks": make_engine(max_num_batched_tokens=8),
        "drafts": make_engine(speculative=SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1)),
        "preempted": make_engine(num_blocks=12, max_model_len=192),  # three prompts of up to 110 tokens in 192 slots
    }
    for path, engine in engines.items():
        together = run_to_completion(engine, PROMPTS, params)
        assert {n: tokens_of(o) for n, o in together.items()} == alone, path
    assert engines["preempted"].scheduler.num_preemptions > 0


def test_a_large_bias_forces_a_token_and_a_negative_one_bans_it(make_engine: EngineFactory) -> None:
    prompt = {"r": PROMPTS["r0"]}
    forced = run_to_completion(
        make_engine(), prompt, SamplingParams(max_tokens=8, temperature=0.9, logit_bias=((42, 100.0),))
    )
    assert tokens_of(forced["r"]) == [42] * 8
    greedy = tokens_of(run_to_completion(make_engine(), prompt, SamplingParams(max_tokens=8, temperature=0.0))["r"])
    banned = SamplingParams(max_tokens=8, temperature=0.0, logit_bias=((greedy[0], -100.0),))
    assert tokens_of(run_to_completion(make_engine(), prompt, banned)["r"])[0] != greedy[0]


def test_min_p_of_one_keeps_only_the_most_likely_token(make_engine: EngineFactory) -> None:
    greedy = run_to_completion(make_engine(), PROMPTS, SamplingParams(max_tokens=16, temperature=0.0))
    min_p = run_to_completion(make_engine(), PROMPTS, SamplingParams(max_tokens=16, temperature=1.5, min_p=1.0))
    assert {n: tokens_of(o) for n, o in min_p.items()} == {n: tokens_of(o) for n, o in greedy.items()}


def test_logprobs_are_the_raw_log_softmax_of_each_token_with_its_rank_and_top_k(
    make_engine: EngineFactory, tiny_model: DecoderForCausalLM
) -> None:
    params = SamplingParams(
        max_tokens=NUM_TOKENS, temperature=0.0, repetition_penalty=1.5, logprobs=5, prompt_logprobs=3
    )
    engine = make_engine(max_num_batched_tokens=16)  # prompts in chunks: prompt positions gathered per chunk
    outputs = run_to_completion(engine, PROMPTS, params)
    for name, prompt in PROMPTS.items():
        want, rows = reference(tiny_model, prompt, params)
        got = tokens_of(outputs[name])
        assert got == want, name
        entries = logprobs_of(outputs[name])
        assert len(entries) == len(got)
        for i, (entry, token) in enumerate(zip(entries, got, strict=True)):
            assert_entry(entry, rows[len(prompt) - 1 + i], token, 5)  # raw: before the penalty
        prompt_entries = outputs[name][0].prompt_logprobs
        assert prompt_entries is not None and len(prompt_entries) == len(prompt) and prompt_entries[0] is None
        for p in range(1, len(prompt)):
            assert_entry(prompt_entries[p], rows[p - 1], prompt[p], 3)
        assert all(o.prompt_logprobs is None for o in outputs[name][1:])


def test_prompt_logprobs_are_computed_whole_even_when_the_prefix_is_cached(make_engine: EngineFactory) -> None:
    engine = make_engine()
    prompt = {"r": PROMPTS["r1"]}
    run_to_completion(engine, prompt, SamplingParams(max_tokens=4, temperature=0.0))  # now cached
    asked = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=0)
    again = run_to_completion(engine, {"s": PROMPTS["r1"]}, asked)["s"]
    cold = run_to_completion(make_engine(), {"s": PROMPTS["r1"]}, asked)["s"]
    assert again[0].num_cached_tokens == 0
    assert again[0].prompt_logprobs == cold[0].prompt_logprobs
    assert again[0].prompt_logprobs is not None and all(e is None or not e.top for e in again[0].prompt_logprobs)


def test_a_draw_follows_the_distribution_and_never_picks_an_impossible_token() -> None:
    generator = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0])
    counts = torch.zeros(5)
    for _ in range(20_000):
        counts[draw(probs, generator)] += 1
    assert counts[1] == counts[4] == 0
    assert torch.allclose(counts / 20_000, probs, atol=0.015)
    seeded = [draw(probs, torch.Generator().manual_seed(7)) for _ in range(3)]
    assert len(set(seeded)) == 1  # a generator seeded the same draws the same token

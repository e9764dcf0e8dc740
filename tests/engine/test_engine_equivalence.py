"""Greedy output does not depend on batching, prefix-cache hits, chunked prefill or preemption."""

from __future__ import annotations

from splitserve.engine.outputs import RequestOutput
from splitserve.engine.sampling_params import SamplingParams
from tests.support.engine import EngineFactory, random_prompts, run_to_completion, tokens_of


def alone(make_engine: EngineFactory, prompts: dict[str, list[int]], **kw: object) -> dict[str, list[int]]:
    result = {}
    for rid, prompt in prompts.items():
        engine = make_engine(**kw)
        result[rid] = tokens_of(run_to_completion(engine, {rid: prompt})[rid])
    return result


def test_batch_of_eight_mixed_lengths_matches_alone(make_engine: EngineFactory) -> None:
    prompts = random_prompts(8, 3, 150)
    expected = alone(make_engine, prompts)
    together = run_to_completion(make_engine(), prompts)
    assert {rid: tokens_of(o) for rid, o in together.items()} == expected
    assert all(len(t) == 24 for t in expected.values())


def test_prefix_cache_hit_gives_same_output(make_engine: EngineFactory) -> None:
    prompt = random_prompts(1, 100, 100)["r0"]
    engine = make_engine()
    cold = tokens_of(run_to_completion(engine, {"a": prompt})["a"])
    warm_outputs = run_to_completion(engine, {"b": prompt})["b"]
    assert tokens_of(warm_outputs) == cold
    # six full blocks, and three of the four tokens of the tail block "a" left; the last token is computed
    assert warm_outputs[0].num_cached_tokens == 99
    stats = engine.get_stats()
    assert stats.prefix_cache_hits == 99 and stats.prefix_cache_queries == 200
    # a longer prompt sharing the prefix reuses its full blocks, not the tail (its last block differs)
    longer = run_to_completion(engine, {"c": [*prompt, 7, 8, 9]})["c"]
    assert longer[0].num_cached_tokens == 96


def test_cached_prompt_on_a_block_boundary_copies_its_last_block(make_engine: EngineFactory) -> None:
    prompt = random_prompts(1, 96, 96, seed=5)["r0"]
    engine = make_engine()
    cold = tokens_of(run_to_completion(engine, {"a": prompt})["a"])
    warm = run_to_completion(engine, {"b": prompt})["b"]
    assert tokens_of(warm) == cold
    assert warm[0].num_cached_tokens == 95


def test_cached_tail_while_its_owner_still_decodes(make_engine: EngineFactory) -> None:
    """The second request copies the first's tail block while the first keeps writing into it."""
    prompt = random_prompts(1, 70, 70, seed=6)["r0"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    cold = tokens_of(run_to_completion(make_engine(), {"a": prompt}, params)["a"])
    engine = make_engine()
    engine.add_request("a", prompt, params)
    outputs: dict[str, list[RequestOutput]] = {"a": [], "b": []}
    for _ in range(3):  # a computes its prompt and decodes into its tail block
        for o in engine.step():
            outputs[o.request_id].append(o)
    engine.add_request("b", prompt, params)
    while engine.has_unfinished_requests():
        for o in engine.step():
            outputs[o.request_id].append(o)
    assert tokens_of(outputs["a"]) == tokens_of(outputs["b"]) == cold
    assert outputs["b"][0].num_cached_tokens == 69


def test_chunked_prefill_on_and_off_agree(make_engine: EngineFactory) -> None:
    prompts = random_prompts(4, 60, 200, seed=2)
    chunked = run_to_completion(make_engine(max_num_batched_tokens=32), prompts)
    whole = run_to_completion(make_engine(max_num_batched_tokens=32, chunked=False), prompts)
    assert {r: tokens_of(o) for r, o in chunked.items()} == {r: tokens_of(o) for r, o in whole.items()}


def test_preemption_by_recompute_gives_same_output(make_engine: EngineFactory) -> None:
    prompts = random_prompts(6, 40, 90, seed=3)
    params = SamplingParams(max_tokens=60, temperature=0.0)
    roomy = run_to_completion(make_engine(), prompts, params)
    engine = make_engine(num_blocks=28, prefix_caching=False, max_model_len=256)
    tight = run_to_completion(engine, prompts, params)
    assert engine.get_stats().num_preemptions > 0
    assert {r: tokens_of(o) for r, o in tight.items()} == {r: tokens_of(o) for r, o in roomy.items()}
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_seeded_sampling_is_independent_of_batch(make_engine: EngineFactory) -> None:
    prompts = random_prompts(5, 10, 80, seed=4)
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, top_k=50, seed=1234)
    together = run_to_completion(make_engine(), prompts, params)
    engine = make_engine()
    single = run_to_completion(engine, {"r2": prompts["r2"]}, params)
    assert tokens_of(single["r2"]) == tokens_of(together["r2"])


def test_seeded_request_resumed_from_its_output_draws_the_same_tokens(make_engine: EngineFactory) -> None:
    """A seeded token depends on the seed and its position only, so a request resumed elsewhere with its
    output so far appended to the prompt (a router's stream migration) goes on as if never cut."""
    prompt = random_prompts(1, 30, 30, seed=5)["r0"]
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=99)
    whole = tokens_of(run_to_completion(make_engine(), {"a": prompt}, params)["a"])
    rest = SamplingParams(max_tokens=12, temperature=1.0, seed=99)
    resumed = tokens_of(run_to_completion(make_engine(), {"b": prompt + whole[:8]}, rest)["b"])
    assert resumed == whole[8:]
    other_seed = SamplingParams(max_tokens=20, temperature=1.0, seed=100)
    assert tokens_of(run_to_completion(make_engine(), {"c": prompt}, other_seed)["c"]) != whole

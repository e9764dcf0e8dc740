"""Speculative decoding by prompt lookup gives the tokens decoding one at a time gives, on the real SmolLM2 with a
worker's defaults (the GGUF's blocks in the native forward step): 200 greedy tokens alone and beside other
streams, seeded sampling, stops and ``max_tokens``. Each verification step computes the last token and its
drafts as one chunk; every row of it is computed as it would be alone (``docs/exactness.md``), so the drafts
change the speed, never the answer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from splitserve.config import SpeculativeConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.outputs import FinishReason
from splitserve.engine.sampling_params import SamplingParams
from tests.support.engine import build_engine, run_to_completion, tokens_of
from tests.support.real_model import RealChats as Real
from tests.support.real_model import smollm2_chats

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=200, temperature=0.8, top_p=0.95, seed=77, ignore_eos=True)
SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=4, prompt_lookup_min=2)
TEXT = (
    "The lighthouse stood on a rock at the mouth of the bay. Every evening the keeper climbed its ninety-two "
    "steps, trimmed the wick, polished the lens and lit the lamp. Ships that passed in the night saw its beam "
    "sweep the water every ten seconds, and knew the rocks were near."
)
QUESTIONS = {
    "repeat": f"{TEXT}\n\nRepeat the text above word for word, twice.",
    "edit": f"{TEXT}\n\nRewrite the text above, replacing 'keeper' with 'warden'.",
    "story": "Write a long story about a lighthouse keeper.",
}


@pytest.fixture(scope="module")
def real() -> Iterator[Real]:
    with smollm2_chats(QUESTIONS, lambda chats, prompt: answer(engine(chats), prompt)) as chats:
        yield chats


def engine(real: Real, **kwargs: Any) -> LLMEngine:
    return build_engine(real.model, real.tokenizer, **{"num_blocks": 400, "max_model_len": 2048, **kwargs})


def answer(eng: LLMEngine, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    return tokens_of(run_to_completion(eng, {"r": prompt}, params)["r"])


def test_greedy_answers_are_the_same_with_drafts_and_most_drafts_are_kept_on_a_copying_task(real: Real) -> None:
    for name, prompt in real.prompts.items():
        eng = engine(real, speculative=SPEC)
        assert answer(eng, prompt) == real.answers[name], name
        stats = eng.proposer.stats if eng.proposer is not None else None
        assert stats is not None and stats.num_drafts > 0, name
        if name == "repeat":  # the answer's first 60 tokens copy the prompt: lookups find them
            assert stats.num_accepted_tokens > 0.5 * stats.num_draft_tokens, stats
            assert stats.num_accepted_tokens >= 30, stats  # measured: 56 of 84


def test_beside_other_streams_and_with_a_small_step_budget_the_answers_are_the_same(real: Real) -> None:
    # a budget of 4 tokens: three streams' decodes leave room for one draft, or none, and prompts go in chunks
    eng = engine(real, speculative=SPEC, max_num_batched_tokens=4, chunked=True)
    outputs = run_to_completion(eng, dict(real.prompts), GREEDY)
    assert {k: tokens_of(v) for k, v in outputs.items()} == real.answers
    assert eng.proposer is not None and eng.proposer.stats.num_drafts > 0


def test_past_the_batch_size_limit_nothing_is_drafted(real: Real) -> None:
    # no prefix caching: two prompts share the text's blocks, and with it the second would wait a step for the
    # first's, a step in which two run and may draft
    eng = engine(real, speculative=SpeculativeConfig(disable_by_batch_size=2), prefix_caching=False)
    outputs = run_to_completion(eng, dict(real.prompts), GREEDY)
    assert {k: tokens_of(v) for k, v in outputs.items()} == real.answers
    assert eng.proposer is not None and eng.proposer.stats.num_drafts == 0  # three ran together to the end


def test_seeded_sampling_draws_the_same_tokens_with_drafts(real: Real) -> None:
    prompt = real.prompts["repeat"]
    assert answer(engine(real, speculative=SPEC), prompt, SEEDED) == answer(engine(real), prompt, SEEDED)


def test_stops_and_max_tokens_end_where_they_do_without_drafts(real: Real) -> None:
    prompt = real.prompts["repeat"]
    plain = real.answers["repeat"]
    for max_tokens in (1, 3, 37):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        out = run_to_completion(engine(real, speculative=SPEC), {"r": prompt}, params)["r"]
        assert tokens_of(out) == plain[:max_tokens]
        assert out[-1].finish_reason == FinishReason.LENGTH and out[-1].num_output_tokens == max_tokens
    stop_id = plain[20]  # a token id the answer reaches 20 tokens in: it ends there, the stop token included
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id])
    for spec in (None, SPEC):
        out = run_to_completion(engine(real, speculative=spec), {"r": prompt}, params)["r"]
        assert tokens_of(out) == plain[: plain.index(stop_id) + 1]
        assert out[-1].finish_reason == FinishReason.STOP and out[-1].stop_reason == stop_id
    text = real.tokenizer.decode(plain[:60])
    stop_str = text[len(text) // 2 :][:12]  # a string from the middle of the answer
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True, stop=[stop_str])
    texts = []
    for spec in (None, SPEC):
        out = run_to_completion(engine(real, speculative=spec), {"r": prompt}, params)["r"]
        texts.append(("".join(o.new_text for o in out), out[-1].finish_reason))
    assert texts[0] == texts[1] and texts[0][1] == FinishReason.STOP

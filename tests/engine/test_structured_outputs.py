"""Structured outputs on the real SmolLM2 with a worker's defaults: every constrained answer follows its JSON schema,
choice or regex; the grammar ends the output when it is complete, or ``max_tokens`` does (``length``); a request
resumed with part of its answer in its prompt (a migrated stream) carries on in the grammar and gives the
uninterrupted answer's tokens; a constrained request decodes beside unconstrained ones as it does alone."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator

import jsonschema
import pytest

from splitserve.engine.engine import LLMEngine
from splitserve.engine.outputs import FinishReason
from splitserve.engine.sampling_params import SamplingParams, StructuredKind, StructuredOutput
from splitserve.engine.structured import GrammarError
from tests.support.engine import build_engine, run_to_completion, tokens_of
from tests.support.real_model import RealChats as Real
from tests.support.real_model import smollm2_chats

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer"},
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "pets": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"kind": {"type": "string", "maxLength": 12}}, "required": ["kind"],
            "additionalProperties": False,
        }},
    },
    "required": ["name", "age", "city", "pets"],
    "additionalProperties": False,
}  # fmt: skip
JSON_SPEC = StructuredOutput(StructuredKind.JSON, json.dumps(SCHEMA))
QUESTIONS = {"person": "Describe a person and their pets as JSON.", "story": "Tell a short story about a cat."}


@pytest.fixture(scope="module")
def real() -> Iterator[Real]:
    with smollm2_chats(QUESTIONS, lambda chats, prompt: []) as chats:
        yield chats


def engine(real: Real) -> LLMEngine:
    return build_engine(real.model, real.tokenizer, num_blocks=400, max_model_len=2048)


def answer(eng: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[str, list[int], FinishReason | None]:
    outputs = run_to_completion(eng, {"r": prompt}, params)["r"]
    return "".join(o.new_text for o in outputs), tokens_of(outputs), outputs[-1].finish_reason


def test_json_schema_answers_validate_greedy_and_sampled(real: Real) -> None:
    eng = engine(real)
    for seed in (None, 1, 2, 3):
        params = SamplingParams(
            max_tokens=200, temperature=0.0 if seed is None else 0.9, seed=seed, structured=JSON_SPEC
        )
        text, _, reason = answer(eng, real.prompts["person"], params)
        assert reason == FinishReason.STOP, text  # the grammar ended it, complete
        jsonschema.validate(json.loads(text), SCHEMA)


def test_choice_and_regex_answers_are_in_their_language(real: Real) -> None:
    eng = engine(real)
    choice = StructuredOutput(StructuredKind.CHOICE, json.dumps(["sunny", "rainy", "snowy"]))
    text, _, _ = answer(eng, real.prompts["story"], SamplingParams(max_tokens=20, temperature=0.0, structured=choice))
    assert text in ("sunny", "rainy", "snowy")
    regex = StructuredOutput(StructuredKind.REGEX, r"[A-Z][a-z]{2,8} is [0-9]{1,2} years old\.")
    text, _, _ = answer(eng, real.prompts["story"], SamplingParams(max_tokens=40, temperature=0.0, structured=regex))
    assert re.fullmatch(r"[A-Z][a-z]{2,8} is [0-9]{1,2} years old\.", text), text


def test_a_grammar_cut_short_by_max_tokens_ends_with_length_and_what_was_made(real: Real) -> None:
    text, tokens, reason = answer(
        engine(real), real.prompts["person"], SamplingParams(max_tokens=6, temperature=0.0, structured=JSON_SPEC)
    )
    assert reason == FinishReason.LENGTH and len(tokens) == 6 and text.startswith('{"name":"')


def test_a_resumed_request_carries_on_in_its_grammar_with_the_uninterrupted_tokens(real: Real) -> None:
    eng = engine(real)
    prompt = real.prompts["person"]
    params = SamplingParams(max_tokens=200, temperature=0.9, seed=7, structured=JSON_SPEC)
    _, whole, _ = answer(eng, prompt, params)
    cut = len(whole) // 2
    resumed = dataclasses.replace(params, max_tokens=200 - cut, resumed_prompt_tokens=len(prompt))
    _, rest, _ = answer(engine(real), prompt + whole[:cut], resumed)
    assert whole[:cut] + rest == whole


def test_constrained_and_free_requests_together_give_their_answers_alone(real: Real) -> None:
    constrained = SamplingParams(max_tokens=120, temperature=0.0, structured=JSON_SPEC)
    free = SamplingParams(max_tokens=60, temperature=0.0)
    alone = [answer(engine(real), real.prompts["person"], constrained)[1],
             answer(engine(real), real.prompts["story"], free)[1]]  # fmt: skip
    eng = engine(real)
    eng.add_request("json", real.prompts["person"], constrained)
    eng.add_request("free", real.prompts["story"], free)
    got: dict[str, list[int]] = {"json": [], "free": []}
    while eng.has_unfinished_requests():
        for out in eng.step():
            got[out.request_id].extend(out.new_token_ids)
    assert [got["json"], got["free"]] == alone


def test_an_invalid_spec_is_refused_before_it_runs(real: Real) -> None:
    eng = engine(real)
    for spec in (StructuredOutput(StructuredKind.JSON, '{"type": "objekt"}'),
                 StructuredOutput(StructuredKind.REGEX, "a(b"),
                 StructuredOutput(StructuredKind.GRAMMAR, "start: ( nothing")):  # fmt: skip
        with pytest.raises(GrammarError):
            eng.check_structured(spec)

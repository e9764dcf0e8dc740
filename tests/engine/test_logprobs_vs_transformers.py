"""Log-probabilities against transformers on the real SmolLM2 weights in float32 (``--quantization none``): each
output token's, its rank and its top 5, and each prompt token's, equal transformers' ``log_softmax`` over the same
tokens within 1e-4."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from splitserve.engine.outputs import TokenLogprobs
from splitserve.engine.sampling_params import SamplingParams
from splitserve.model.decoder import DecoderForCausalLM
from splitserve.model.loader import load_gguf
from splitserve.model.reference import transformers_model
from splitserve.model.source import resolve_model
from splitserve.model.tokenizer import load_tokenizer
from tests.support.engine import build_engine, run_to_completion, tokens_of
from tests.support.real_model import torch_threads

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")]

TOLERANCE = 1e-4
TOP = 5


@pytest.fixture(scope="module")
def logprobs() -> Iterator[tuple[list[int], list[TokenLogprobs], list[TokenLogprobs | None], torch.Tensor]]:
    """The engine's greedy answer with its logprobs, and transformers' log-softmax over prompt + answer."""
    with torch_threads(2):
        cfg, state = load_gguf(resolve_model("smollm2").path)
        ours = DecoderForCausalLM(cfg).float().eval()
        ours.load_hf_state_dict(state)
        tokenizer = load_tokenizer("smollm2")
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Name three rivers of Europe."}])
        params = SamplingParams(max_tokens=32, temperature=0.0, logprobs=TOP, prompt_logprobs=TOP, ignore_eos=True)
        engine = build_engine(ours, tokenizer, num_blocks=64, max_model_len=512, max_num_batched_tokens=16)
        outputs = run_to_completion(engine, {"r": prompt}, params)["r"]
        answer = tokens_of(outputs)
        hf = transformers_model(cfg, state)
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + answer])).logits[0].float()
        rows = torch.log_softmax(logits, dim=-1)
        entries = [e for o in outputs for e in o.new_logprobs or []]
        prompt_entries = outputs[0].prompt_logprobs or []
        yield prompt + answer, entries, prompt_entries, rows


def check(entry: TokenLogprobs | None, row: torch.Tensor, token: int) -> None:
    assert entry is not None and entry.token_id == token
    assert abs(entry.logprob - float(row[token])) < TOLERANCE
    values, ids = torch.topk(row, TOP)
    got_ids = [t for t, _ in entry.top]
    assert len(got_ids) == TOP
    for (token_id, value), want in zip(entry.top, values.tolist(), strict=True):
        assert abs(value - want) < TOLERANCE
        assert abs(float(row[token_id]) - value) < TOLERANCE  # the id is one with that logprob (ties may swap)
    assert set(got_ids[:2]) == set(ids[:2].tolist()) or abs(float(values[1] - values[2])) < TOLERANCE


def test_output_logprobs_equal_transformers(logprobs: tuple) -> None:  # type: ignore[type-arg]
    tokens, entries, prompt_entries, rows = logprobs
    num_prompt = len(prompt_entries)
    assert len(entries) == len(tokens) - num_prompt == 32
    for i, entry in enumerate(entries):
        check(entry, rows[num_prompt - 1 + i], tokens[num_prompt + i])
        assert entry.rank == 1  # greedy: the most likely token (raw logits, no penalty)


def test_prompt_logprobs_equal_transformers(logprobs: tuple) -> None:  # type: ignore[type-arg]
    tokens, _, prompt_entries, rows = logprobs
    assert prompt_entries[0] is None
    for p in range(1, len(prompt_entries)):
        check(prompt_entries[p], rows[p - 1], tokens[p])

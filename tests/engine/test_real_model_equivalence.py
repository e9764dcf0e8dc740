"""Acceptance on the real SmolLM2-135M-Instruct in float32: greedy output is token-for-token the same alone
and in a batch, with and without a prefix-cache hit, with chunked prefill on and off, and after preemption.

``test_engine_equivalence.py`` checks the same on a tiny random model; this checks it with real chat prompts
(30..400 tokens) where logits have real near-ties. The model is loaded once per module; each scenario builds
a fresh ``LLMEngine`` around it. One thread, as in ``test_model_vs_transformers.py``.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from splitserve.config import SchedulingPolicy
from splitserve.engine.engine import LLMEngine
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.sampling_params import SamplingParams
from splitserve.model.decoder import DecoderForCausalLM
from splitserve.model.kernels import detect_cpu, kernels_for
from splitserve.model.quant import load_gguf_quantized
from splitserve.model.registry import load_model
from splitserve.model.source import resolve_model
from splitserve.model.tokenizer import Tokenizer, load_tokenizer
from tests.support.engine import build_engine, run_to_completion, tokens_of

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
BLOCK_SIZE = 16

LONG_SYSTEM = (
    "You are the customer support assistant of Northwind Outfitters, a small company that sells hiking, "
    "camping and climbing equipment online and in three shops. Follow these rules in every answer. "
    "Be friendly, brief and concrete; prefer short paragraphs or a few bullet points over long essays. "
    "Never invent prices, stock levels or delivery dates: if the customer asks for them, explain that you "
    "cannot see live data and point them to the order page or to the shop staff. Our return policy: unused "
    "items can be returned within 60 days with the receipt; used items only when they are faulty; sleeping "
    "bags and underwear cannot be returned once unpacked for hygiene reasons. Shipping is free above 50 "
    "euros inside the European Union and costs 6 euros below that; parcels usually leave the warehouse the "
    "next working day. Repairs: we repair tents, backpacks and jackets in our own workshop, and the first "
    "repair within two years is free. When a customer asks about safety, for example avalanche equipment, "
    "ropes, harnesses or helmets, always recommend a course with a certified guide and remind them to check "
    "the equipment before every use. If a question has nothing to do with outdoor equipment, answer it "
    "politely anyway, but keep the answer short. Sign every answer with 'The Northwind team'."
)
TUTOR_SYSTEM = (
    "You are a patient mathematics tutor for secondary school students. Explain each step, use small "
    "numbers in examples, and end with one short exercise the student can try alone."
)
CONVERSATIONS: dict[str, list[dict[str, str]]] = {
    "france": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    "tent": [
        {"role": "system", "content": LONG_SYSTEM},
        {"role": "user", "content": "My tent pole broke on the second trip. Can you fix it, and what does it cost?"},
    ],
    "poem": [{"role": "user", "content": "Write a short poem about the sea and the wind."}],
    "fractions": [
        {"role": "system", "content": TUTOR_SYSTEM},
        {"role": "user", "content": "How do I add 1/3 and 1/4?"},
    ],
    "sleeping_bag": [
        {"role": "system", "content": LONG_SYSTEM},
        {"role": "user", "content": "I unpacked a sleeping bag but never slept in it. Can I still return it?"},
    ],
    "python": [{"role": "user", "content": "Explain what a Python list comprehension is, with an example."}],
    "avalanche": [
        {"role": "system", "content": LONG_SYSTEM},
        {"role": "user", "content": "Which avalanche transceiver should I buy for my first ski tour this winter?"},
        {"role": "assistant", "content": "A three-antenna transceiver is the usual choice for beginners."},
        {"role": "user", "content": "And what else do I need besides the transceiver?"},
        {"role": "assistant", "content": "A probe and a shovel, and the training to use all three together."},
        {"role": "user", "content": "Where can I get that training, and how long does a beginner course take?"},
    ],
    "bread": [
        {
            "role": "user",
            "content": "I want to bake my first loaf of bread at home. I have flour, water, salt and dry "
            "yeast, a normal oven and no bread tin. Give me a simple recipe with quantities and timings.",
        }
    ],
}


@dataclass
class Real:
    model: DecoderForCausalLM
    tokenizer: Tokenizer
    prompts: dict[str, list[int]]
    alone: dict[str, list[int]]  # each prompt's greedy output on a fresh engine of its own


@pytest.fixture(scope="module")
def real() -> Iterator[Real]:
    # One thread: on a small shared machine two OpenMP threads that lose a core make decoding far slower.
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        source = resolve_model("smollm2")
        model = load_model(source, torch.float32, torch.device("cpu"))
        tokenizer = load_tokenizer(source)
        prompts = {name: tokenizer.apply_chat_template(messages) for name, messages in CONVERSATIONS.items()}
        setup = Real(model, tokenizer, prompts, {})
        setup.alone = {rid: tokens_of(run(make_engine(setup), {rid: p})[rid]) for rid, p in prompts.items()}
        yield setup
    finally:
        torch.set_num_threads(num_threads)


def make_engine(real: Real, **kwargs: Any) -> LLMEngine:
    return build_engine(real.model, real.tokenizer, block_size=BLOCK_SIZE, max_num_seqs=8, **kwargs)


def run(engine: LLMEngine, prompts: dict[str, list[int]]) -> dict[str, list[RequestOutput]]:
    start = time.perf_counter()
    outputs = run_to_completion(engine, prompts, GREEDY)
    print(f"{len(prompts)} request(s) in {time.perf_counter() - start:.1f} s")
    return outputs


def token_lists(outputs: dict[str, list[RequestOutput]]) -> dict[str, list[int]]:
    return {rid: tokens_of(outs) for rid, outs in outputs.items()}


def test_prompts_are_real_and_of_mixed_lengths(real: Real) -> None:
    lengths = sorted(len(p) for p in real.prompts.values())
    assert lengths[0] < 50 and lengths[-1] > 300, lengths
    assert all(len(tokens) == MAX_TOKENS for tokens in real.alone.values())
    assert "Paris" in real.tokenizer.decode(real.alone["france"])


def test_batch_of_eight_mixed_lengths_matches_alone(real: Real) -> None:
    engine = make_engine(real)
    together = token_lists(run(engine, real.prompts))
    assert together == real.alone
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_amx_tiles_decode_as_the_vnni_kernel_does(real: Real) -> None:
    """A batch of 8 decodes its quantized matmuls on AMX-INT8 tiles (5 rows and more) in the ``amx`` build, and
    on 512-bit VNNI tiles in the ``avx512`` one: the same integers and the same float sums, so the same tokens."""
    levels = {level.name: level for level in detect_cpu().levels}
    if "amx" not in levels:
        pytest.skip("this CPU has no AMX")
    blocks = load_gguf_quantized(resolve_model("smollm2").path, real.model.config)
    outputs = {}
    for name in ("avx512", "amx"):
        kernels = kernels_for(levels[name])
        assert kernels is not None
        model = copy.deepcopy(real.model)
        assert model.load_quantized_weights(blocks, kernels) > 0
        outputs[name] = token_lists(run(build_engine(model, real.tokenizer, max_num_seqs=8), real.prompts))
    assert outputs["amx"] == outputs["avx512"]
    assert "Paris" in real.tokenizer.decode(outputs["amx"]["france"])


def test_prefix_cache_hit_gives_same_output(real: Real) -> None:
    engine = make_engine(real)
    tent = real.prompts["tent"]
    cold = run(engine, {"cold": tent})["cold"]
    assert cold[0].num_cached_tokens == 0
    warm = run(engine, {"warm": tent})["warm"]
    # the full blocks, and the tail block "cold" left: only the last token is computed
    assert warm[0].num_cached_tokens == len(tent) - 1
    assert tokens_of(warm) == tokens_of(cold) == real.alone["tent"]
    # another question under the same long system message reuses its blocks
    shared = shared_prefix_len(tent, real.prompts["sleeping_bag"])
    other = run(engine, {"other": real.prompts["sleeping_bag"]})["other"]
    assert other[0].num_cached_tokens == shared // BLOCK_SIZE * BLOCK_SIZE >= 256
    assert tokens_of(other) == real.alone["sleeping_bag"]


def test_chunked_prefill_on_and_off_agree(real: Real) -> None:
    chunked_engine = make_engine(real, max_num_batched_tokens=64)
    chunked = token_lists(run(chunked_engine, real.prompts))
    whole_engine = make_engine(real, max_num_batched_tokens=64, chunked=False)
    whole = token_lists(run(whole_engine, real.prompts))
    assert chunked == whole == real.alone


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_preemption_by_recompute_gives_same_output(real: Real, prefix_caching: bool) -> None:
    # 30 blocks hold 480 tokens: room for the longest request (under 450 tokens) but not for all eight. In
    # arrival order and whole-budget chunks, the long prompts run out of blocks together and preempt
    engine = make_engine(
        real, num_blocks=30, prefix_caching=prefix_caching, max_model_len=480,
        policy=SchedulingPolicy.FCFS, step_time_target=0,
    )  # fmt: skip
    tight = token_lists(run(engine, real.prompts))
    stats = engine.get_stats()
    print(f"preemptions: {stats.num_preemptions}")
    assert stats.num_preemptions > 0
    assert tight == real.alone
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def shared_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n

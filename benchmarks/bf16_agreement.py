"""Greedy-token agreement of bfloat16 and of the quantized decode path with float32, 20 chat prompts x 64 steps.

Runs on the same (dequantized GGUF) SmolLM2-135M-Instruct weights, all greedy with EOS ignored:
ours-fp32 and ours-bf16 go through ``LLMEngine`` (all 20 prompts in one batch, as served); hf-fp32 and
hf-bf16 go through ``transformers.LlamaForCausalLM.generate``, one prompt at a time. The quantized runs decode
from the GGUF's own blocks: ours-bf16-int4 with PyTorch's int4 kernel, ours-bf16-gguf with the native
kernels (one prompt at a time, today's default on a bf16 CPU), and ours-fp32-gguf-<isa> in float32 (one
batch) with each instruction-set build this CPU runs. The first 12 tokens each run answers to "What is the
capital of France?" are printed. For each pair it
reports the fraction of the 20 x 64 tokens that agree position by position, the number of prompts whose 64
tokens are all identical, and the mean step of the first divergence (over the prompts that diverge).

For every first divergence of ours-bf16 from ours-fp32 it also reports the logits the engines sampled from
at that point (recorded by a wrapper around the engine's sampler, so they are exactly what each engine saw):
the float32 margin between the top two tokens, where that margin ranks among the top-2 margins of every
ours-fp32 position, and the bfloat16 margin by which the other token won, which shows whether the flip
happened on a near-tie.

    .venv/bin/python benchmarks/bf16_agreement.py [--threads 1] [--steps 64]

Results go to ``benchmarks/results/bf16_agreement.json``; a markdown table is printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from common import REPO, machine_description
from serving_vs_peers import load_hf_model

from splitserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.request import Request
from splitserve.engine.sampler import Sampler
from splitserve.engine.sampling_params import SamplingParams
from splitserve.model.decoder import DecoderForCausalLM
from splitserve.model.kernels import detect_cpu, kernels_for
from splitserve.model.quant import load_gguf_quantized
from splitserve.model.registry import apply_quantization, load_model
from splitserve.model.source import resolve_model
from splitserve.model.tokenizer import Tokenizer, load_tokenizer

SUPPORT_SYSTEM = (
    "You are the support assistant of a small online bookshop. Be brief and polite. Orders ship within two "
    "working days; returns are accepted within 30 days with the receipt; e-books cannot be returned once "
    "downloaded. Never invent order numbers or delivery dates."
)
TUTOR_SYSTEM = "You are a patient physics tutor. Explain step by step with everyday examples."
QUESTIONS: list[tuple[str | None, str]] = [
    (None, "What is the capital of France?"),
    (None, "Write a short poem about the sea and the wind."),
    (None, "Explain what a Python list comprehension is, with an example."),
    (None, "Give me three tips for sleeping better."),
    (None, "What is the difference between weather and climate?"),
    (None, "Translate 'Good morning, how are you?' into Spanish and German."),
    (None, "Write a haiku about autumn leaves."),
    (None, "How many legs does a spider have, and how many does an insect have?"),
    (None, "Summarize the plot of Romeo and Juliet in two sentences."),
    (None, "I have flour, water, salt and yeast. Give me a simple bread recipe with quantities."),
    (None, "Why is the sky blue? Answer for a ten-year-old."),
    (None, "List five healthy snacks that need no cooking."),
    (None, "Write a polite email asking my landlord to fix a leaking tap."),
    (None, "What does HTTP status code 404 mean?"),
    (SUPPORT_SYSTEM, "I ordered a book last week and it has not arrived. What can I do?"),
    (SUPPORT_SYSTEM, "Can I return an e-book that I bought by mistake?"),
    (TUTOR_SYSTEM, "Why do heavy and light objects fall at the same speed?"),
    (TUTOR_SYSTEM, "What is the difference between mass and weight?"),
    (None, "Write a Python function that checks whether a number is prime."),
    (None, "Tell me a fun fact about octopuses."),
]
PAIRS = [
    ("ours-fp32", "hf-fp32"),
    ("ours-bf16", "ours-fp32"),
    ("hf-bf16", "hf-fp32"),
    ("ours-bf16", "hf-bf16"),
    ("ours-bf16-int4", "ours-fp32"),
    ("ours-bf16-int4", "ours-bf16"),
    ("ours-bf16-gguf", "ours-fp32"),
    ("ours-bf16-gguf", "ours-bf16"),
]


@dataclass(slots=True)
class PairStats:
    pair: str
    token_agreement: float  # fraction of positions (over all prompts and steps) with the same token
    num_identical_prompts: int
    mean_first_divergence_step: float | None  # over diverging prompts only; None when none diverges
    num_diverging_prompts: int


@dataclass(slots=True)
class Divergence:
    prompt_index: int
    step: int  # 0-based output position of the first differing token
    fp32_token: str
    bf16_token: str
    fp32_top2_margin: float  # ours-fp32 logits: top-1 minus top-2 at the divergence point
    fp32_margin_to_bf16_choice: float | None  # ours-fp32 logits: its choice minus bf16's (None: not in top-k)
    bf16_margin_to_bf16_choice: float | None  # ours-bf16 logits: its choice minus fp32's (None: not in top-k)
    margin_percentile: float  # share of all ours-fp32 positions whose top-2 margin is smaller, in %


def chat_prompts(tokenizer: Tokenizer) -> list[list[int]]:
    prompts = []
    for system, question in QUESTIONS:
        messages = [{"role": "system", "content": system}] if system else []
        prompts.append(tokenizer.apply_chat_template([*messages, {"role": "user", "content": question}]))
    return prompts


TopK = list[tuple[list[float], list[int]]]  # per output step: the top-k logits and their token ids


class RecordingSampler(Sampler):
    """The engine's sampler, also keeping each request's top-``k`` logits at every step it samples."""

    def __init__(self, k: int = 8) -> None:
        super().__init__()
        self.k = k
        self.top: dict[str, TopK] = defaultdict(list)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        values, indices = logits.float().topk(self.k, dim=-1)  # [N, k]
        for request, v, i in zip(requests, values.tolist(), indices.tolist(), strict=True):
            self.top[request.request_id].append((v, i))
        return super().__call__(logits, requests)


def run_ours(
    model: DecoderForCausalLM, tokenizer: Tokenizer, prompts: list[list[int]], steps: int, max_num_seqs: int = 0
) -> tuple[list[list[int]], list[TopK]]:
    """The prompts through a fresh ``LLMEngine`` (one batch unless ``max_num_seqs`` limits it); tokens, top-k."""
    config = EngineConfig(
        model=ModelConfig(model="smollm2", device="cpu", max_model_len=1024),
        cache=CacheConfig(num_gpu_blocks_override=len(prompts) * 1024 // 16),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs or len(prompts), max_num_batched_tokens=2048),
    )
    engine = LLMEngine(config, model, tokenizer, "smollm2", torch.device("cpu"))
    recorder = RecordingSampler()
    engine.runner.sampler = recorder
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outputs: list[list[int]] = [[] for _ in prompts]
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[int(out.request_id)].extend(out.new_token_ids)
    return outputs, [recorder.top[str(i)] for i in range(len(prompts))]


@torch.inference_mode()
def run_hf(dtype_name: str, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """``generate`` one prompt at a time, greedy, never stopping at EOS (like ``ignore_eos``)."""
    model, _ = load_hf_model(dtype_name)
    model.generation_config.eos_token_id = None  # min_new_tokens would mask EOS instead of ignoring it
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        sequences = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False, pad_token_id=0
        )
        out = sequences[0, len(prompt) :].tolist()
        assert len(out) == steps, f"generate stopped after {len(out)} tokens"
        outputs.append(out)
    return outputs


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def compare(name: str, a: list[list[int]], b: list[list[int]]) -> PairStats:
    num_same = sum(x == y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))
    num_total = sum(len(r) for r in a)
    steps = [s for ra, rb in zip(a, b, strict=True) if (s := first_divergence(ra, rb)) is not None]
    return PairStats(
        pair=name,
        token_agreement=num_same / num_total,
        num_identical_prompts=len(a) - len(steps),
        mean_first_divergence_step=statistics.mean(steps) if steps else None,
        num_diverging_prompts=len(steps),
    )


def top2_margin(top: TopK, step: int) -> float:
    values = top[step][0]
    return values[0] - values[1]


def margin_between(top: TopK, step: int, winner: int, loser: int) -> float | None:
    """Logit of ``winner`` minus logit of ``loser`` at ``step``; None if either is outside the top-k."""
    values, ids = top[step]
    if winner not in ids or loser not in ids:
        return None
    return values[ids.index(winner)] - values[ids.index(loser)]


def divergences(
    tokenizer: Tokenizer, runs: dict[str, list[list[int]]], tops: dict[str, list[TopK]]
) -> tuple[list[Divergence], list[float]]:
    """First divergences of ours-bf16 from ours-fp32, and the fp32 top-2 margin at every ours-fp32 step."""
    all_margins = [top2_margin(top, step) for top in tops["ours-fp32"] for step in range(len(top))]
    found = []
    for i, (a, b) in enumerate(zip(runs["ours-fp32"], runs["ours-bf16"], strict=True)):
        step = first_divergence(a, b)
        if step is None:
            continue
        top32, top16 = tops["ours-fp32"][i], tops["ours-bf16"][i]
        margin = top2_margin(top32, step)
        found.append(
            Divergence(
                prompt_index=i,
                step=step,
                fp32_token=tokenizer.convert_ids_to_tokens([a[step]])[0],
                bf16_token=tokenizer.convert_ids_to_tokens([b[step]])[0],
                fp32_top2_margin=margin,
                fp32_margin_to_bf16_choice=margin_between(top32, step, a[step], b[step]),
                bf16_margin_to_bf16_choice=margin_between(top16, step, b[step], a[step]),
                margin_percentile=100.0 * sum(m < margin for m in all_margins) / len(all_margins),
            )
        )
    return found, all_margins


def timed(label: str, fn: Any, *args: Any) -> Any:
    start = time.perf_counter()
    result = fn(*args)
    print(f"{label}: {time.perf_counter() - start:.1f} s", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "bf16_agreement.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    source = resolve_model("smollm2")
    tokenizer = load_tokenizer(source)
    prompts = chat_prompts(tokenizer)
    fp32 = load_model(source, torch.float32, torch.device("cpu"))
    bf16 = load_model(source, torch.bfloat16, torch.device("cpu"))
    runs: dict[str, list[list[int]]] = {}
    tops: dict[str, list[TopK]] = {}
    runs["ours-fp32"], tops["ours-fp32"] = timed("ours-fp32", run_ours, fp32, tokenizer, prompts, args.steps)
    runs["ours-bf16"], tops["ours-bf16"] = timed("ours-bf16", run_ours, bf16, tokenizer, prompts, args.steps)
    # the default serving configuration: decode steps of a single sequence read the GGUF's 4-bit weights
    int4 = load_model(source, torch.bfloat16, torch.device("cpu"))
    apply_quantization(int4, source, "int4")
    runs["ours-bf16-int4"], tops["ours-bf16-int4"] = timed(
        "ours-bf16-int4", run_ours, int4, tokenizer, prompts, args.steps, 1
    )
    # today's default: decode steps from the GGUF's quantized blocks in the native kernels (one sequence at a
    # time, so every decode step takes them; bf16 above 16 rows); and the same in float32 for every
    # instruction-set build this CPU runs, as on a CPU without native bfloat16
    quantized = load_model(source, torch.bfloat16, torch.device("cpu"))
    apply_quantization(quantized, source, "gguf")
    runs["ours-bf16-gguf"], tops["ours-bf16-gguf"] = timed(
        "ours-bf16-gguf", run_ours, quantized, tokenizer, prompts, args.steps, 1
    )
    blocks = load_gguf_quantized(source.path, fp32.config)
    for level in detect_cpu().levels:
        model, kernels = load_model(source, torch.float32, torch.device("cpu")), kernels_for(level)
        if kernels is None:
            continue
        model.load_quantized_weights(blocks, kernels)
        name = f"ours-fp32-gguf-{level.name}"
        runs[name], tops[name] = timed(name, run_ours, model, tokenizer, prompts, args.steps)
        PAIRS.append((name, "ours-fp32"))
    runs["hf-fp32"] = timed("hf-fp32", run_hf, "float32", prompts, args.steps)
    runs["hf-bf16"] = timed("hf-bf16", run_hf, "bfloat16", prompts, args.steps)
    pairs = [compare(f"{a} vs {b}", runs[a], runs[b]) for a, b in PAIRS]
    found, all_margins = divergences(tokenizer, runs, tops)
    results = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_description(),
        "threads": args.threads,
        "num_prompts": len(prompts),
        "steps": args.steps,
        "prompt_lengths": [len(p) for p in prompts],
        "pairs": [asdict(p) for p in pairs],
        "ours_bf16_divergences": [asdict(d) for d in found],
        "fp32_top2_margin_quantiles": margin_quantiles(all_margins),
        "tokens": runs,
        "capital_of_france": {name: tokenizer.decode(tokens[0][:12]) for name, tokens in runs.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print_tables(pairs, found, results["fp32_top2_margin_quantiles"])
    for name, text in results["capital_of_france"].items():
        print(f"{name}: {text!r}")


def margin_quantiles(margins: list[float]) -> dict[str, float]:
    ordered = sorted(margins)
    return {f"p{q}": ordered[min(len(ordered) - 1, len(ordered) * q // 100)] for q in (1, 5, 10, 50)}


def print_tables(pairs: list[PairStats], found: list[Divergence], quantiles: dict[str, float]) -> None:
    print("\n| pair | tokens agreeing | identical prompts | mean first divergence step |")
    print("|---|---|---|---|")
    for p in pairs:
        num_prompts = p.num_identical_prompts + p.num_diverging_prompts
        mean = "-" if p.mean_first_divergence_step is None else f"{p.mean_first_divergence_step:.1f}"
        print(
            f"| {p.pair} | {100 * p.token_agreement:.1f}% | {p.num_identical_prompts}/{num_prompts} | "
            f"{mean} (n={p.num_diverging_prompts}) |"
        )
    print("\nours-bf16 vs ours-fp32, first divergences (float32 logits at the divergence point):\n")
    print(
        "| prompt | step | fp32 token | bf16 token | fp32 top-2 margin | percentile among all fp32 margins "
        "| bf16 margin for its choice |"
    )
    print("|---|---|---|---|---|---|---|")
    for d in found:
        print(
            f"| {d.prompt_index} | {d.step} | {d.fp32_token!r} | {d.bf16_token!r} | {d.fp32_top2_margin:.4f} | "
            f"{d.margin_percentile:.1f} | {fmt(d.bf16_margin_to_bf16_choice)} |"
        )
    summary = ", ".join(f"{k} {v:.3f}" for k, v in quantiles.items())
    print(f"\nfloat32 top-2 margin over all ours-fp32 positions: {summary}")


def fmt(margin: float | None) -> str:
    return "not in top-k" if margin is None else f"{margin:.4f}"


if __name__ == "__main__":
    main()

"""The packed KV caches (``--kv-cache-dtype int8`` and ``fp8``) against the model's own dtype, one run,
SmolLM2-135M-Instruct with a worker's defaults (the GGUF's blocks through the native forward step, bfloat16 where
the CPU has it):

- **bytes**: KV bytes per token, and the record of a 2,500-token prompt;
- **PD push**: that record pushed to a real receiver over loopback (``pd.sender.push``, open), each format in
  turn, median of ``--repeats``;
- **greedy agreement**: 20 chat prompts (``bf16_agreement.py``'s) x ``--steps`` greedy tokens in one batch, each
  packed format against the default cache; beside it, the default cache against a float32 one
  (``ModelRunner(kv_dtype=...)``), the spread that a cache's rounding alone already causes;
- **engine speed**: one stream and 16 streams decoding (tokens per second of the decode steps), and a cold
  2,500-token prefill, each format in turn, medians.

    .venv/bin/python benchmarks/kv_packed.py [--steps 128] [--repeats 5] [--skip-agreement]

Results go to ``benchmarks/results/kv_packed.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bf16_agreement import chat_prompts, compare
from common import REPO, write_result
from tests.support.engine import random_prompts, run_to_completion, tokens_of
from tests.support.real_model import smollm2_defaults

from splitserve.config import CacheConfig, EngineConfig, KVCacheDtype, ModelConfig, SchedulerConfig
from splitserve.engine import model_runner
from splitserve.engine.engine import LLMEngine, kv_bytes_per_token, kv_cache_layout
from splitserve.engine.sampling_params import SamplingParams
from splitserve.kvcache import serde
from splitserve.model.decoder import DecoderForCausalLM
from splitserve.pd.buffer import PDBuffer
from splitserve.pd.receiver import KVReceiver
from splitserve.pd.sender import push

FORMATS = ("auto", "int8", "fp8")
LONG = 2500


def make_engine(model: DecoderForCausalLM, dtype: str, max_num_seqs: int = 32) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model="smollm2", max_model_len=4096),
        cache=CacheConfig(kv_cache_memory="512MiB", kv_cache_dtype=KVCacheDtype(dtype)),
        scheduler=SchedulerConfig(max_num_seqs, 2048, True, verify_sample_rate=0.0),
    )
    return LLMEngine(config, model, None, "smollm2", torch.device("cpu"))


def answers(engine: LLMEngine, prompts: list[list[int]], steps: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    outputs = run_to_completion(engine, {f"p{i}": p for i, p in enumerate(prompts)}, params)
    return [tokens_of(outputs[f"p{i}"]) for i in range(len(prompts))]


def agreement(model: DecoderForCausalLM, prompts: list[list[int]], steps: int) -> dict[str, Any]:
    default = answers(make_engine(model, "auto"), prompts, steps)
    packed = {name: answers(make_engine(model, name), prompts, steps) for name in FORMATS[1:]}
    original = model_runner.ModelRunner.__init__

    def float32_cache(self: model_runner.ModelRunner, *args: Any, **kwargs: Any) -> None:
        original(self, *args[:5], kv_dtype=torch.float32)

    model_runner.ModelRunner.__init__ = float32_cache  # type: ignore[method-assign]
    try:
        float32 = answers(make_engine(model, "auto"), prompts, steps)
    finally:
        model_runner.ModelRunner.__init__ = original  # type: ignore[method-assign]
    result = {"default_vs_float32": asdict(compare("default vs float32", default, float32))}
    for name, tokens in packed.items():
        result[f"{name}_vs_default"] = asdict(compare(f"{name} vs default", tokens, default))
        result[f"first_divergence_{name}"] = [first_divergence(x, y) for x, y in zip(tokens, default, strict=True)]
    return result


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def decode_rate(engine: LLMEngine, prompts: dict[str, list[int]], steps: int) -> float:
    """Tokens per second of the decode steps alone (prefill first, then timed)."""
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    while any(r.num_output_tokens < 1 for r in engine.requests.values()):
        engine.step()
    began, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - began)


def cold_prefill_s(engine: LLMEngine, prompt: list[int]) -> float:
    began = time.perf_counter()
    run_to_completion(engine, {f"cold-{time.monotonic_ns()}": prompt}, SamplingParams(max_tokens=1))
    return time.perf_counter() - began


def speed(model: DecoderForCausalLM, repeats: int) -> dict[str, dict[str, float]]:
    one = random_prompts(1, 64, 64, seed=1)
    sixteen = random_prompts(16, 256, 256, seed=2)
    samples: dict[str, dict[str, list[float]]] = {d: {"one_stream": [], "c16": [], "cold_2500_s": []} for d in FORMATS}
    for i in range(repeats):
        for dtype in FORMATS:  # in turn, so drifts of a shared machine fall on both
            engine = make_engine(model, dtype)
            samples[dtype]["one_stream"].append(decode_rate(engine, one, 64))
            samples[dtype]["c16"].append(decode_rate(engine, sixteen, 128))
            long = random_prompts(1, LONG, LONG, seed=100 + i)["r0"]
            samples[dtype]["cold_2500_s"].append(cold_prefill_s(engine, long))
            engine.close()
    return {d: {k: statistics.median(v) for k, v in s.items()} | {"all": s} for d, s in samples.items()}  # type: ignore[misc]


def push_ms(model: DecoderForCausalLM, repeats: int) -> dict[str, Any]:
    """A 2,500-token prompt's KV, as each format stores it, pushed to a receiver."""
    result: dict[str, Any] = {}
    records = {}
    for dtype in FORMATS:
        engine = make_engine(model, dtype)
        prompt = random_prompts(1, LONG, LONG, seed=7)["r0"]
        run_to_completion(engine, {"p": prompt}, SamplingParams(max_tokens=1))
        ids = [b.block_id for b in engine.pool.blocks][: -(-LONG // 16)]
        slots = torch.tensor([ids[p // 16] * 16 + p % 16 for p in range(LONG)])
        kv = engine.runner.kv_cache.index_select(2, slots)
        layout = kv_cache_layout(model, 16, dtype)
        records[dtype] = (layout, serde.encode(kv, LONG, layout))
        engine.close()
    times: dict[str, list[float]] = {d: [] for d in FORMATS}
    receivers = {d: KVReceiver(PDBuffer(len(records[d][1]) * 2), records[d][0]) for d in FORMATS}
    for receiver in receivers.values():
        receiver.start()
    try:
        for i in range(repeats + 1):  # the first round warms up
            for dtype in FORMATS:
                layout, record = records[dtype]
                out = push(receivers[dtype].addr, f"{dtype}-{i}", record, LONG, 0, layout, 10, None)
                if not out.ok:
                    raise SystemExit(f"push failed: {out.reason}")
                receivers[dtype].buffer.claim(f"{dtype}-{i}")
                receivers[dtype].buffer.release(f"{dtype}-{i}")
                if i:
                    times[dtype].append(out.elapsed_s * 1000)
    finally:
        for receiver in receivers.values():
            receiver.close()
    for dtype in FORMATS:
        result[dtype] = {
            "record_mb": round(len(records[dtype][1]) / 1e6, 2),
            "median_ms": statistics.median(times[dtype]),
            "all_ms": [round(t, 1) for t in times[dtype]],
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-agreement", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "kv_packed.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = smollm2_defaults()
    results: dict[str, Any] = {
        "model_dtype": str(model.dtype),
        "bytes_per_token": {d: kv_bytes_per_token(model, d) for d in FORMATS},
    }
    results["push"] = push_ms(model, args.repeats)
    print(results)
    if not args.skip_agreement:
        results["agreement"] = agreement(model, chat_prompts(tokenizer), args.steps)
        print(results["agreement"])
    results["speed"] = speed(model, args.repeats)
    for dtype in FORMATS:
        s = results["speed"][dtype]
        print(f"{dtype}: one stream {s['one_stream']:.1f} tok/s, 16 streams {s['c16']:.1f} tok/s, "
              f"cold {LONG} {s['cold_2500_s'] * 1000:.0f} ms")  # fmt: skip
    write_result(args.out, "kv_packed", args, results)


if __name__ == "__main__":
    main()

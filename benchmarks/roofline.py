"""Decode against memory bandwidth, prefill against peak arithmetic, and where a single-stream decode step goes.

    .venv/bin/python benchmarks/roofline.py [--threads 2] [--model PATH.gguf --skip-profiles]

In this process (no server):
- **Bandwidth:** a STREAM-like triad ``a = b + s * c`` over three 512 MiB float32 arrays, with the engine's
  thread count; the median of 5 passes (bytes read and written / time).
- **Decode roofline:** the bytes one single-stream decode step reads (every packed weight, the output head,
  the KV of its context) divided by that bandwidth, against the measured median step of the default engine
  (``LLMEngine.step()``: scheduler, forward, logits, sampler, detokenizer).
- **Prefill against peak:** a cold 2,500-token prefill, its FLOPs (2 x matmul parameters x tokens, plus
  causal attention) per second against the CPU's stated peak for the instruction set the matmuls use.
Then, each in a fresh process, the parts of a single-stream decode step for: the previous default (bf16 with
PyTorch's int4 kernel, one module at a time), the quantized kernels one module at a time
(``SPLITSERVE_FORWARD_STEP=0``), and the one-call native step (today's default). Results go to
``benchmarks/results/roofline.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, time_calls, write_result

PEAK_FLOP_PER_CYCLE = {  # per core: vector FMA units x lanes x 2, or AMX's bf16 tile multiply
    "amx": 1024,
    "avx512": 64,
    "avx2": 32,
    "neon": 16,
}


def triad_gb_s(threads: int) -> float:
    import torch

    torch.set_num_threads(threads)
    n = 128 * 2**20  # 512 MiB per float32 array
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    times = []
    for _ in range(5):
        began = time.perf_counter()
        torch.add(b, c, alpha=1.5, out=a)
        times.append(time.perf_counter() - began)
    return 3 * n * 4 / statistics.median(times) / 1e9


def engine(threads: int, quantization: str = "auto", dtype: str = "auto") -> Any:
    from splitserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from splitserve.worker.build import build_engine

    model = ModelConfig(model=MODEL[0], max_model_len=4096, num_threads=threads, quantization=quantization, dtype=dtype)
    config = EngineConfig(
        model=model,
        cache=CacheConfig(kv_cache_memory="1GiB", enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
    )
    return build_engine(config)


# The model measured: the packaged SmolLM2 GGUF, or the file --model names
MODEL: list[str] = ["smollm2"]


def prefill_isa(isa_class: str, dtype: str) -> str:
    """The instruction set prefill matmuls run on: AMX tiles for bfloat16 on AMX CPUs, else the vector width
    PyTorch runs (``ATEN_CPU_CAPABILITY`` may hold it below the CPU's, as ``serving_vs_peers.py --isa avx2``)."""
    import torch

    if isa_class == "amx" and dtype == "torch.bfloat16":
        return "amx"
    capability = torch.backends.cpu.get_cpu_capability()
    if isa_class.startswith(("amx", "avx512")) and capability.startswith("AVX512"):
        return "avx512"
    return "avx2" if capability == "AVX2" else "neon"


def cpu_mhz() -> float:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return max((float(line.split(":")[1]) for line in lines if line.startswith("cpu MHz")), default=0.0)


def decode_bytes(eng: Any, context: int) -> int:
    """Bytes one decode step of one sequence reads: packed weights, the head, norms, its context's KV."""
    model = eng.runner.model
    total = 0
    for module in model.modules():
        quant = getattr(module, "quant", None)
        total += quant.nbytes if quant is not None else 0
    if model._quant_head is not None:
        total += model._quant_head[0].nbytes
    cfg = model.config
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim
    kv_per_token *= eng.runner.kv_cache.element_size()
    norms = (2 * cfg.num_hidden_layers + 1) * cfg.hidden_size * 4
    return total + norms + context * kv_per_token


def prompt(num_tokens: int, rng: random.Random = random.Random(0)) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(num_tokens)]


def run_one(eng: Any, request_id: str, num_prompt: int, max_tokens: int) -> list[float]:
    """Serve one request to the end; returns each step's seconds."""
    from splitserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    eng.add_request(request_id, prompt(num_prompt), params)
    times = []
    while eng.has_unfinished_requests():
        began = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - began)
    return times


def measure(threads: int, dtype: str) -> dict[str, Any]:
    from splitserve.model.kernels import detect_cpu, native

    eng = engine(threads, dtype=dtype)
    results: dict[str, Any] = {"triad_gb_s": triad_gb_s(threads)}
    run_one(eng, "warm", 64, 4)
    began = time.perf_counter()
    run_one(eng, "cold", 2500, 1)
    prefill_s = time.perf_counter() - began
    cfg = eng.runner.model.config
    linear_params = sum(p.numel() for n, p in eng.runner.model.named_parameters() if n.endswith("proj.weight"))
    # QK and PV, 2 FLOPs per multiply-add each, over the causal half of the 2,500 x 2,500 scores
    attention_flops = 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * 2500 * 2500
    prefill_flops = 2 * linear_params * 2500 + attention_flops
    isa = prefill_isa(detect_cpu().isa_class, str(eng.runner.dtype))
    mhz = cpu_mhz()
    peak = threads * mhz * 1e6 * PEAK_FLOP_PER_CYCLE[isa]
    results |= {
        "prefill_2500_s": prefill_s,
        "prefill_tok_s": 2500 / prefill_s,
        "prefill_gflop_s": prefill_flops / prefill_s / 1e9,
        "peak_gflop_s": peak / 1e9,
        "peak_basis": f"{threads} cores x {mhz:.0f} MHz x {PEAK_FLOP_PER_CYCLE[isa]} FLOP/cycle ({isa})",
        "prefill_share_of_peak": prefill_flops / prefill_s / peak if peak else None,
        "kernel_isa": native().level.name if native() else "none",
    }
    step_s = statistics.median(run_one(eng, "one", 64, 200)[5:])
    step_bytes = decode_bytes(eng, 64 + 100)
    results |= {
        "decode_step_ms": step_s * 1000,
        "decode_bytes": step_bytes,
        "decode_roofline_ms": step_bytes / (results["triad_gb_s"] * 1e9) * 1000,
        "decode_share_of_roofline": step_bytes / (results["triad_gb_s"] * 1e9) / step_s,
    }
    return results


def profile(threads: int, quantization: str, dtype: str) -> dict[str, float]:
    """Per-part times of a single-stream decode step (ms), by wrapping the functions that do each part."""
    import torch

    from splitserve.engine.sampling_params import SamplingParams
    from splitserve.model import decoder

    eng = engine(threads, quantization, dtype)
    spent: dict[str, float] = {}

    def timed(owner: Any, name: str, part: str) -> None:
        time_calls(owner, name, part, spent)

    model = eng.runner.model
    timed(decoder.Linear, "forward", "matmuls (120 linear layers)")
    timed(decoder, "paged_attention", "attention")
    timed(decoder, "add_rms_norm", "add + RMSNorm")
    timed(model, "forward", "forward")
    if model._forward_step is not None:
        timed(model, "_forward_step", "native forward step (every layer, one call)")
    timed(model, "compute_logits", "output head + top-32 refinement")
    timed(eng.runner, "sampler", "sampler")
    timed(eng.runner, "prepare", "step inputs (runner)")
    timed(eng.scheduler, "schedule", "scheduler")
    eng.add_request("one", prompt(64), SamplingParams(max_tokens=130, temperature=0.0, ignore_eos=True))
    for _ in range(10):
        eng.step()
    spent.clear()
    num_steps, began = 0, time.perf_counter()
    with torch.inference_mode():
        while eng.has_unfinished_requests():
            eng.step()
            num_steps += 1
    total = time.perf_counter() - began
    parts = {k: v / num_steps * 1000 for k, v in spent.items()}
    inside = sum(v for k, v in parts.items() if k in ("matmuls (120 linear layers)", "attention", "add + RMSNorm"))
    parts["the rest of forward (rotary, KV write, embedding, op dispatch)"] = (
        parts.pop("forward") - inside - parts.get("native decode step (every layer, one call)", 0.0)
    )
    parts["engine step in all"] = total / num_steps * 1000
    named = sum(v for k, v in parts.items() if k != "engine step in all")
    parts["the rest of the step (outputs, detokenizer)"] = parts["engine step in all"] - named
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto", help="float32 for the AVX2 class (see serving_vs_peers.py --isa)")
    parser.add_argument("--model", default="smollm2", help="a GGUF file (benchmarks/sized_checkpoint.py makes some)")
    parser.add_argument("--skip-profiles", action="store_true", help="only the roofline, not the per-part profiles")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "roofline.json")
    args = parser.parse_args()
    MODEL[0] = args.model
    if args.child:
        quantization, _, step = args.child.partition(":")
        if step == "0":
            os.environ["SPLITSERVE_FORWARD_STEP"] = "0"
        print(json.dumps(profile(args.threads, quantization, args.dtype)))
        return
    results: dict[str, Any] = {"roofline": measure(args.threads, args.dtype), "profiles": {}}
    print(json.dumps(results["roofline"], indent=2), flush=True)
    for label, child in (
        ()
        if args.skip_profiles
        else (
            ("before: bf16 + PyTorch int4, module by module", "int4:0"),
            ("quantized kernels, module by module", "auto:0"),
            ("quantized kernels, one-call decode step (default)", "auto:1"),
        )
    ):
        if child.startswith("int4") and args.dtype not in ("auto", "bfloat16"):
            continue  # PyTorch's int4 kernel was the bfloat16 path
        cmd = [sys.executable, __file__, "--threads", str(args.threads), "--dtype", args.dtype, "--model", args.model]
        cmd += ["--child", child]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results["profiles"][label] = json.loads(out.strip().splitlines()[-1])
        print(label, results["profiles"][label], flush=True)
    write_result(args.out, "roofline", args, results)


if __name__ == "__main__":
    main()

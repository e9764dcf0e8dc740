"""Where a cold prefill's time goes, with and without the native bfloat16 prefill kernels (no server, no HTTP).

    .venv/bin/python benchmarks/prefill_parts.py [--threads 2] [--prompt-tokens 2500] [--repeats 5]

The float path (``--quantization none``): the default, the GGUF's blocks, runs every step in the one native
forward step, which these part timers cannot see into. One 2,500-token prompt (prefix caching off, the default
chunks of 1,024 tokens, ``max_tokens`` 1) in the
default dtype, each configuration in a fresh process:
- ``native``: the default: attention on AMX tiles where the CPU has them (``csrc/amx/attention.c``),
  SiLU x up and the rotary embedding in one native pass each (``csrc/elementwise.c``);
- ``pytorch``: those three declined, so PyTorch's SDPA and elementwise ops run (the engine of before).

Parts are timed by wrapping the functions that do them: the 120 linear layers, prefill attention, SiLU x up
(the MLP less its two matmuls), the rotary, add + RMSNorm; the rest is the step's other work. Medians over
``--repeats`` prefills after two warm-ups. Results go to ``benchmarks/results/prefill_parts.json``.
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

CONFIGS = ("native", "pytorch")


def measure(config: str, threads: int, prompt_tokens: int, repeats: int) -> dict[str, float]:
    from splitserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from splitserve.engine.sampling_params import SamplingParams
    from splitserve.model import attention, decoder, kernels
    from splitserve.worker.build import build_engine

    if config == "pytorch":
        kernels.NativeKernels.prefill_attention = lambda *args, **kwargs: None  # type: ignore[method-assign]
        kernels.NativeKernels.silu_mul = lambda *args, **kwargs: None  # type: ignore[method-assign]
        kernels.NativeKernels.rotary = lambda *args, **kwargs: False  # type: ignore[method-assign]
    eng = build_engine(
        EngineConfig(
            model=ModelConfig(model="smollm2", max_model_len=4096, num_threads=threads, quantization="none"),
            cache=CacheConfig(kv_cache_memory="1GiB", enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024),
        )
    )
    spent: dict[str, float] = {}
    for part, (owner, name) in {
        "matmuls": (decoder.Linear, "forward"),
        "mlp": (decoder.MLP, "forward"),
        "attention": (attention, "_prefill_attention"),
        "rotary": (decoder, "apply_rotary"),
        "add + RMSNorm": (decoder, "add_rms_norm"),
    }.items():
        time_calls(owner, name, part, spent)
    for layer in eng.runner.model.layers:  # the MLP's own matmuls, also counted in "matmuls" (the class's wrapper)
        time_calls(layer.mlp.gate_up_proj, "forward", "mlp matmuls", spent)
        time_calls(layer.mlp.down_proj, "forward", "mlp matmuls", spent)
    rng = random.Random(0)
    runs: list[dict[str, float]] = []
    for i in range(repeats + 2):
        prompt = [rng.randrange(1000, 40000) for _ in range(prompt_tokens)]
        eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        spent.clear()
        began = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        total = time.perf_counter() - began
        if i >= 2:
            parts = {k: v * 1000 for k, v in spent.items()}
            parts["SiLU x up"] = parts.pop("mlp") - parts.pop("mlp matmuls")
            named = sum(parts.values())
            runs.append(parts | {"rest of the step": total * 1000 - named, "total": total * 1000})
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=2500)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "prefill_parts.json")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.threads, args.prompt_tokens, args.repeats)))
        return
    results: dict[str, Any] = {}
    for config in CONFIGS:
        command = [sys.executable, __file__, "--child", config, "--threads", str(args.threads)]
        command += ["--prompt-tokens", str(args.prompt_tokens), "--repeats", str(args.repeats)]
        done = subprocess.run(command, capture_output=True, text=True, check=True, env=os.environ.copy())
        results[config] = json.loads(done.stdout.strip().splitlines()[-1])
        print(config, {k: round(v, 1) for k, v in results[config].items()})
    write_result(args.out, "prefill_parts", args, results)


if __name__ == "__main__":
    main()

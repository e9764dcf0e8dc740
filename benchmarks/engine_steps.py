"""Engine step times with and without the native CPU kernels, one run (no server, no HTTP).

    .venv/bin/python benchmarks/engine_steps.py [--threads 2]

Each configuration runs in a fresh process (``SPLITSERVE_NATIVE_KERNELS=1`` or ``0``), on SmolLM2-135M in the
default dtype and quantization, prefix caching off so every prompt is computed:
- a cold 2,500-token prefill (one request, ``max_tokens`` 1);
- the prefill of 16 prompts of 256 tokens (4,096 tokens, 4 steps of 1,024);
- the median decode step of 16 sequences at ~270 tokens of context;
- the median decode step of 8 short sequences (~80 tokens) with and without one 2,500-token sequence
  decoding beside them (the decode worker's situation while long prompts arrive).
Results go to ``benchmarks/results/engine_steps.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, write_result


def measure(threads: int) -> dict[str, float]:
    from splitserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from splitserve.engine.sampling_params import SamplingParams
    from splitserve.worker.build import build_engine

    config = EngineConfig(
        model=ModelConfig(model="smollm2", max_model_len=4096, num_threads=threads),
        cache=CacheConfig(kv_cache_memory="1GiB", enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024),
    )
    engine = build_engine(config)
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(n)]

    def median_step_ms(num_steps: int = 20) -> float:
        times = []
        for _ in range(num_steps):
            began = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - began) * 1000)
        return sorted(times)[num_steps // 2]

    endless = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    results: dict[str, float] = {}
    engine.add_request("warm", prompt(64), SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("cold", prompt(2500), SamplingParams(max_tokens=1, ignore_eos=True))
    began = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    results["prefill_2500_ms"] = (time.perf_counter() - began) * 1000
    for i in range(16):
        engine.add_request(f"b{i}", prompt(256), endless)
    began = time.perf_counter()
    for _ in range(5):  # 4 prefill steps of 1,024 tokens, then the first decode
        engine.step()
    results["prefill_16x256_ms"] = (time.perf_counter() - began) * 1000
    results["decode_16_ms"] = median_step_ms()
    for i in range(16):
        engine.abort_request(f"b{i}")
    for i in range(8):
        engine.add_request(f"s{i}", prompt(64), endless)
    engine.add_request("long", prompt(2500), endless)
    for _ in range(8):
        engine.step()
    results["decode_8_plus_long_ms"] = median_step_ms()
    engine.abort_request("long")
    results["decode_8_ms"] = median_step_ms()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "engine_steps.json")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.threads)))
        return
    results: dict[str, Any] = {}
    for native in ("1", "0"):
        env = {**os.environ, "SPLITSERVE_NATIVE_KERNELS": native}
        cmd = [sys.executable, __file__, "--child", "--threads", str(args.threads)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        results["native" if native == "1" else "pytorch"] = json.loads(out.strip().splitlines()[-1])
        print(native, results, flush=True)
    print("\n| measure | native kernels | PyTorch paths | ratio |\n|---|---|---|---|")
    for key, value in results["native"].items():
        other = results["pytorch"][key]
        print(f"| {key} | {value:.1f} | {other:.1f} | {other / value:.2f}x |")
    write_result(args.out, "engine_steps", args, results)


if __name__ == "__main__":
    main()

"""A cache hit's time to first token on an idle worker, and with cold prompts running beside it, one run.

    .venv/bin/python benchmarks/hit_beside_cold.py [--targets 0.05,0] [--threads 1]

Per ``--step-time-target`` value, a fresh ``splitserve worker`` (SmolLM2-135M, default dtype, ``--num-threads``):
- a document of ``--doc-words`` words is sent once, so the engine's prefix cache holds it;
- **idle**: ``--num-hits`` requests of that document and a new question of ``--question-words`` words each, one
  at a time (each computes only its question), streamed, ``max_tokens`` 4: their TTFT;
- **beside cold prompts**: ``--cold-streams`` clients each send cold prompts of ``--cold-words`` new words
  (``max_tokens`` 1) back to back, and meanwhile the same kind of hits go out one at a time, ``--gap-s`` apart
  (uniform in 0.5x to 1.5x, seeded), so they arrive at any point of the cold prompts' steps: their TTFT.
The ratio busy ÷ idle (medians) is what the step-time target bounds.

``--c16-repeats N``: then, what the target costs in throughput: ``serving_vs_peers.py``'s c16 load (64 requests of
256 in / 128 out, 16 at a time) on a worker with every core, N times per target, the targets alternating; the
output tokens/s of each run. Results go to ``benchmarks/results/hit_beside_cold.json``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from splitserve.bench.datasets import random_text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, SPLITSERVE, bench_serve, free_port, start_server, stop_server, write_result
from serving_vs_peers import CONCURRENT


def ttft_s(client: httpx.Client, url: str, prompt: str, max_tokens: int) -> float:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    began = time.perf_counter()
    first = None
    with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - began
    assert first is not None, "no token streamed"
    return first


def run_target(target: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    port = free_port()
    cmd = [*SPLITSERVE, "worker", "--port", str(port), "--num-threads", str(args.threads), "--max-model-len", "8192",
           "--step-time-target", target]  # fmt: skip
    worker = start_server(cmd, port, log_dir / f"hit-beside-cold-{target}.log")
    url = f"http://127.0.0.1:{port}"
    rng = random.Random(args.seed)
    document = random_text(rng, args.doc_words) + "\n\n"
    stop = threading.Event()
    try:
        with httpx.Client() as client:
            ttft_s(client, url, document + random_text(rng, 8), 1)  # the document, cached
            for _ in range(2):  # warm-up, and the engine's step line
                ttft_s(client, url, random_text(rng, args.cold_words), 1)
                ttft_s(client, url, document + random_text(rng, args.question_words), 4)
            idle = [ttft_s(client, url, document + random_text(rng, args.question_words), 4)
                    for _ in range(args.num_hits)]  # fmt: skip

            def cold_loop(seed: int) -> None:
                cold_rng = random.Random(seed)
                with httpx.Client() as cold_client:
                    while not stop.is_set():
                        ttft_s(cold_client, url, random_text(cold_rng, args.cold_words), 1)

            threads = [threading.Thread(target=cold_loop, args=(args.seed + 100 + i,), daemon=True)
                       for i in range(args.cold_streams)]  # fmt: skip
            for thread in threads:
                thread.start()
            time.sleep(args.gap_s)
            busy = []
            for _ in range(args.num_hits):
                busy.append(ttft_s(client, url, document + random_text(rng, args.question_words), 4))
                time.sleep(args.gap_s * rng.uniform(0.5, 1.5))
            stop.set()
            for thread in threads:
                thread.join()
    finally:
        stop.set()
        stop_server(worker)
    idle_ms, busy_ms = statistics.median(idle) * 1000, statistics.median(busy) * 1000
    return {
        "step_time_target": float(target),
        "idle_hit_ttft_ms": sorted(round(t * 1000, 1) for t in idle),
        "busy_hit_ttft_ms": sorted(round(t * 1000, 1) for t in busy),
        "idle_p50_ms": idle_ms,
        "busy_p50_ms": busy_ms,
        "busy_max_ms": max(busy) * 1000,
        "busy_over_idle_p50": busy_ms / idle_ms,
    }


def c16_output_tok_s(target: str, log_dir: Path) -> float:
    port = free_port()
    cmd = [*SPLITSERVE, "worker", "--port", str(port), "--max-model-len", "4096", "--step-time-target", target]
    worker = start_server(cmd, port, log_dir / f"c16-target-{target}.log")
    try:
        summary = bench_serve(f"http://127.0.0.1:{port}", "smollm2", f"c16-target-{target}", CONCURRENT)["summary"]
        return float(summary["output_throughput"])
    finally:
        stop_server(worker)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default="0.05,0", help="--step-time-target values, one worker each")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--doc-words", type=int, default=1600)
    parser.add_argument("--question-words", type=int, default=60)
    parser.add_argument("--cold-words", type=int, default=2000)
    parser.add_argument("--cold-streams", type=int, default=2)
    parser.add_argument("--num-hits", type=int, default=12)
    parser.add_argument("--gap-s", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--c16-repeats", type=int, default=0)
    parser.add_argument("--skip-hits", action="store_true", help="only the c16 runs")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "hit_beside_cold.json")
    args = parser.parse_args()
    log_dir = REPO / "benchmarks" / "results" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    targets = args.targets.split(",")
    for target in targets if not args.skip_hits else ():
        rows.append(run_target(target, args, log_dir))
        row = rows[-1]
        print(f"target {target} s: idle hit p50 {row['idle_p50_ms']:.0f} ms, beside cold prompts p50 "
              f"{row['busy_p50_ms']:.0f} ms (max {row['busy_max_ms']:.0f}): {row['busy_over_idle_p50']:.2f}x",
              flush=True)  # fmt: skip
    c16: dict[str, list[float]] = {target: [] for target in targets}
    for _ in range(args.c16_repeats):
        for target in targets:
            c16[target].append(c16_output_tok_s(target, log_dir))
            print(f"c16, target {target} s: {c16[target][-1]:.1f} output tokens/s", flush=True)
    if args.c16_repeats:
        rows.append({"c16_output_tok_s": c16, "c16_median": {t: statistics.median(v) for t, v in c16.items()}})
        print("c16 medians:", rows[-1]["c16_median"], flush=True)
    write_result(args.out, "hit_beside_cold", args, rows)


if __name__ == "__main__":
    main()

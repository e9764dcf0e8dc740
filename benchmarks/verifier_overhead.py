"""What ``--verify-sample-rate`` costs: 16 streams of a shared-prefix workload (every request after a group's
first is a prefix-cache hit, so every one is a candidate for the check), one worker per rate, in turn.

    .venv/bin/python benchmarks/verifier_overhead.py [--rates 0 0.001 0.05] [--rounds 2] [--num-prompts 192]

Each rate runs in a fresh worker (both cores), ``--rounds`` times in alternation, and the output tokens/s of
``splitserve bench serve`` (16 in flight, 4 prefixes of 512 words, 32-word suffixes, 64 tokens out) is kept per
run, with the worker's ``splitserve:exactness_checks_total`` and ``..._mismatches_total``. A check runs only
when no client request waits, so under a saturating load it runs in the gaps, and at the end. Results go to
``benchmarks/results/verifier_overhead.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, SPLITSERVE, bench_serve, free_port, start_server, stop_server, write_result

from splitserve.metrics import sum_samples

WORKLOAD = [
    "--dataset", "shared-prefix", "--shared-prefix-groups", "4", "--shared-prefix-len", "512",
    "--shared-suffix-len", "32", "--max-concurrency", "16", "--request-rate", "inf", "--random-output-len", "64",
]  # fmt: skip


def run(rate: float, num_prompts: int, log_dir: Path) -> dict[str, Any]:
    port = free_port()
    cmd = [*SPLITSERVE, "worker", "--model", "smollm2", "--port", str(port), "--max-model-len", "2048",
           "--max-num-seqs", "16", "--verify-sample-rate", str(rate)]  # fmt: skip
    proc = start_server(cmd, port, log_dir / f"worker-{rate}.log")
    try:
        url = f"http://127.0.0.1:{port}"
        bench_serve(url, "smollm2", "warm-up", [*WORKLOAD, "--num-prompts", "16"])
        result = bench_serve(url, "smollm2", f"rate {rate}", [*WORKLOAD, "--num-prompts", str(num_prompts)])
        text = httpx.get(f"{url}/metrics", timeout=10).text
        return {
            "rate": rate,
            "output_tokens_per_s": result["summary"]["output_throughput"],
            "exactness_checks": sum_samples(text, "splitserve:exactness_checks_total"),
            "exactness_mismatches": sum_samples(text, "splitserve:exactness_mismatches_total"),
        }
    finally:
        stop_server(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.001, 0.05])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=192)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "verifier_overhead.json")
    args = parser.parse_args()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for rate in args.rates:
                runs.append(run(rate, args.num_prompts, Path(tmp)))
                print(runs[-1], flush=True)
    summary = {}
    for rate in args.rates:
        mine = [r["output_tokens_per_s"] for r in runs if r["rate"] == rate]
        summary[str(rate)] = {"median_output_tokens_per_s": statistics.median(mine), "runs": mine}
    base = summary[str(args.rates[0])]["median_output_tokens_per_s"]
    for rate in args.rates:
        entry = summary[str(rate)]
        entry["vs_first_rate"] = entry["median_output_tokens_per_s"] / base
        print(f"rate {rate}: {entry['median_output_tokens_per_s']:.1f} tok/s ({entry['vs_first_rate']:.3f}x)")
    write_result(args.out, "verifier_overhead", args, {"runs": runs, "summary": summary})


if __name__ == "__main__":
    main()

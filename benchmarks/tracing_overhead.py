"""What tracing costs: 16 streams through the router to one worker, with tracing off and on, in one run.

    .venv/bin/python benchmarks/tracing_overhead.py [--rounds 3]

Two endpoints (a worker on both cores behind ``splitserve router``), started one after the other: one without
``--otlp-traces-endpoint``, one with it on the router and the worker, exporting to an OTLP/HTTP receiver in this
process (``tests/support/otlp.py``, which decodes every span as a collector would). Each round runs
``splitserve bench serve`` with serving_vs_peers.py's 16-stream load (256 prompt tokens, 128 output tokens, 64
prompts) against each, alternating which goes first. Reported: output tok/s per round and the median ratio on/off.
Results go to ``benchmarks/results/tracing_overhead_<cpu class>.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import REPO, SPLITSERVE, bench_serve, free_port, start_server, stop_server, write_result
from serving_vs_peers import CONCURRENT
from tests.support.otlp import OTLPReceiver

from splitserve.model.kernels import detect_cpu

RESULTS = REPO / "benchmarks" / "results"
LOGS = RESULTS / "logs"
MODEL = "smollm2"


class Endpoint:
    def __init__(self, label: str, traced: list[str]) -> None:
        worker_port, router_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{router_port}"
        self.worker = start_server([*SPLITSERVE, "worker", "--model", MODEL, "--port", str(worker_port), *traced],
                                   worker_port, LOGS / f"tracing-{label}-worker.log")  # fmt: skip
        self.router = start_server([*SPLITSERVE, "router", "--port", str(router_port), "--backend",
                                    f"http://127.0.0.1:{worker_port}", *traced], router_port,
                                   LOGS / f"tracing-{label}-router.log")  # fmt: skip

    def stop(self) -> None:
        stop_server(self.router)
        stop_server(self.worker)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    LOGS.mkdir(parents=True, exist_ok=True)
    out = args.out or RESULTS / f"tracing_overhead_{detect_cpu().isa_class}.json"
    rates: dict[str, list[float]] = {"off": [], "on": []}
    with OTLPReceiver() as receiver:
        endpoints = {"off": Endpoint("off", []), "on": Endpoint("on", ["--otlp-traces-endpoint", receiver.url])}
        try:
            for round_index in range(args.rounds):
                order = ["off", "on"] if round_index % 2 == 0 else ["on", "off"]
                for label in order:
                    summary = bench_serve(endpoints[label].url, MODEL, f"tracing-{label}", CONCURRENT)["summary"]
                    rates[label].append(summary["output_throughput"])
                    print(f"round {round_index + 1} {label}: {rates[label][-1]:.1f} tok/s", flush=True)
        finally:
            for endpoint in endpoints.values():
                endpoint.stop()
        num_spans = len(receiver.spans)
    ratios = [on / off for on, off in zip(rates["on"], rates["off"], strict=True)]
    results: dict[str, Any] = {
        "output_tok_s": rates,
        "median_off": statistics.median(rates["off"]),
        "median_on": statistics.median(rates["on"]),
        "ratios_on_over_off": [round(r, 4) for r in ratios],
        "median_ratio": round(statistics.median(ratios), 4),
        "spans_received": num_spans,
    }
    print(results)
    write_result(out, "tracing_overhead", args, results)


if __name__ == "__main__":
    main()

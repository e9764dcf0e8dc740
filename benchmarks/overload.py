"""Open-loop overload of one worker behind the router: does it shed load, stay reachable and lose nothing?

    .venv/bin/python benchmarks/overload.py [--factor 3] [--duration 120] [--worker-arg=--max-queue-delay=30]

One worker (both cores, default settings unless ``--worker-arg``) behind ``splitserve router``. First its capacity
for the request shape (120 random words, 32 output tokens, streamed): a closed loop of ``--concurrency`` clients
for ``--capacity-seconds``. Then Poisson arrivals at ``--factor`` times that rate for ``--duration`` seconds,
open loop, while ``/health`` of the router and of the worker is probed every 0.25 s (``tests/support/overload.py``).
Reported: every request's outcome (200, 429, or anything else), the slowest health answer of each, the router's
retries by reason (a ``connect`` retry is a worker that did not accept a connection in time), and after the load:
whether the worker's queue emptied and five requests in a row were served. Results go to
``benchmarks/results/overload_<cpu class>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import REPO, SPLITSERVE, free_port, start_server, stop_server, write_result
from tests.support.overload import closed_loop_rate, overload, recovered

from splitserve.model.kernels import detect_cpu

RESULTS = REPO / "benchmarks" / "results"
LOGS = RESULTS / "logs"
MODEL = "smollm2"


def retries_by_reason(router: str) -> dict[str, float]:
    """The router's ``splitserve:router_retries_total``, by reason."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{router}/metrics", timeout=10.0).text.splitlines():
        if line.startswith("splitserve:router_retries_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--factor", type=float, default=3.0)
    parser.add_argument("--duration", type=float, default=120.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--capacity-seconds", type=float, default=30.0)
    parser.add_argument("--worker-arg", action="append", default=[], help="an extra worker flag (repeatable)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    LOGS.mkdir(parents=True, exist_ok=True)
    out = args.out or RESULTS / f"overload_{detect_cpu().isa_class}.json"
    worker_port, router_port = free_port(), free_port()
    worker_url, router_url = f"http://127.0.0.1:{worker_port}", f"http://127.0.0.1:{router_port}"
    extra = [part for arg in args.worker_arg for part in arg.split("=", 1)]
    worker = start_server([*SPLITSERVE, "worker", "--model", MODEL, "--port", str(worker_port), *extra], worker_port,
                          LOGS / "overload-worker.log")  # fmt: skip
    router = start_server([*SPLITSERVE, "router", "--port", str(router_port), "--backend", worker_url,
                           "--health-interval", "1"], router_port, LOGS / "overload-router.log")  # fmt: skip
    try:
        capacity = asyncio.run(closed_loop_rate(router_url, MODEL, args.concurrency, args.capacity_seconds))
        print(f"capacity: {capacity:.2f} requests/s ({args.concurrency} clients, closed loop)", flush=True)
        rate = args.factor * capacity
        report = asyncio.run(overload(router_url, MODEL, rate, args.duration, [router_url, worker_url]))
        retries = retries_by_reason(router_url)
        after = recovered(router_url, worker_url, MODEL)
    finally:
        stop_server(router)
        stop_server(worker)
    results = {"capacity_per_s": round(capacity, 3), "factor": args.factor, **report.to_json(),
               "router_retries": retries, **after}  # fmt: skip
    print(results)
    write_result(out, "overload", args, results)


if __name__ == "__main__":
    main()

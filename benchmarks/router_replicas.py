"""Two kvaware routers behind one TCP balancer against one router: the hit rate, a router SIGKILLed mid-load, and how
fast a restarted router knows the workers' caches again.

    .venv/bin/python benchmarks/router_replicas.py

Four workers (SmolLM2, one thread each, engine prefix cache, no tiers) and kvaware routers that pull the workers' KV
events themselves (``router/events.py``): each replica builds its own index from each worker's snapshot, then its
events, so replicas share no state and need none to agree on where a prefix is. The balancer is the one ``splitserve
up`` puts in front of ``spec.router.replicas`` (``splitserve.deploy.balancer``, a process of its own): each
connection to the next router that accepts it, as a Kubernetes Service does. The load is ``splitserve bench serve
--dataset multiround`` (chat users whose history grows), each side on fresh workers (empty caches) with the same
workload, for each of ``--seeds``:

1. one router;
2. two routers behind the balancer;
3. (last seed, the same workers, the next seed's workload) two routers behind the balancer, one SIGKILLed
   ``--kill-after`` seconds in: the requests in flight on it at that moment (its
   ``splitserve:router_requests_in_flight``) against the requests that failed;
4. the killed router restarted on its port: seconds until its KV index (the workers' blocks, ``index="kv"``)
   holds as many entries as the survivor's.

The hit rate is the workers' ``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`` over a phase.
Results go to ``benchmarks/results/router_replicas_<cpu class>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import REPO, SPLITSERVE, bench_serve, free_port, metric, start_server, stop_server, write_result

from splitserve.model.kernels import detect_cpu

RESULTS = REPO / "benchmarks" / "results"
LOGS = RESULTS / "logs"
MODEL = "smollm2"


def hit_counters(workers: list[str]) -> tuple[float, float]:
    hits = sum(metric(u, "vllm:prefix_cache_hits_total") for u in workers)
    return hits, sum(metric(u, "vllm:prefix_cache_queries_total") for u in workers)


def hit_rate(before: tuple[float, float], after: tuple[float, float]) -> float:
    """Prompt tokens found cached over prompt tokens looked up, between two :func:`hit_counters`."""
    queries = after[1] - before[1]
    return round((after[0] - before[0]) / queries, 4) if queries > 0 else 0.0


def bench_args(args: argparse.Namespace, seed: int) -> list[str]:
    return ["--endpoint", "chat", "--dataset", "multiround", "--num-users", str(args.num_users),
            "--num-rounds", str(args.num_rounds), "--shared-prefix-len", "50", "--random-input-len", "60",
            "--random-output-len", "32", "--user-history-len", str(args.history_words),
            "--request-rate", str(args.request_rate), "--seed", str(seed)]  # fmt: skip


def hit_rate_of(url: str, workers: list[str], args: argparse.Namespace, seed: int, label: str) -> dict[str, Any]:
    before = hit_counters(workers)
    summary = bench_serve(url, MODEL, label, bench_args(args, seed))["summary"]
    after = hit_counters(workers)
    return {"hit_rate": hit_rate(before, after),
            "num_ok": summary["num_completed"], "num_failed": summary["num_failed"],
            "ttft_p50_ms": summary["ttft"]["p50_ms"]}  # fmt: skip


class Router:
    def __init__(self, workers: list[str], port: int, name: str) -> None:
        self.port, self.name, self.workers = port, name, workers
        self.url = f"http://127.0.0.1:{port}"
        self.process = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        backends = [arg for w in self.workers for arg in ("--backend", w)]
        command = [*SPLITSERVE, "router", "--port", str(self.port), "--admin-port", str(free_port()),
                   "--routing-strategy", "kvaware", "--health-interval", "0.5", *backends]  # fmt: skip
        return start_server(command, self.port, LOGS / f"replicas-{self.name}-{time.monotonic_ns()}.log")

    def restart(self) -> None:
        self.process = self._start()

    def index_entries(self) -> float:
        try:
            return metric(self.url, "splitserve:router_index_entries", index="kv")  # the workers' blocks only
        except httpx.HTTPError:
            return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--num-users", type=int, default=16)
    parser.add_argument("--num-rounds", type=int, default=8)
    parser.add_argument("--history-words", type=int, default=400, help="each user's own document opening the chat")
    parser.add_argument("--request-rate", type=float, default=4.0)
    parser.add_argument("--kill-after", type=float, default=15.0, help="phase 3: seconds into the load")
    parser.add_argument("--seeds", type=lambda text: [int(x) for x in text.split(",")], default=[1, 2])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    LOGS.mkdir(parents=True, exist_ok=True)
    out = args.out or RESULTS / f"router_replicas_{detect_cpu().isa_class}.json"
    results: dict[str, Any] = {"one_router": [], "two_routers": []}
    for seed in args.seeds:  # each side on fresh workers (empty caches), the same workload
        for label in ("one_router", "two_routers"):
            with Fleet(args.num_workers) as fleet:
                routers = [Router(fleet.urls, free_port(), "a"), Router(fleet.urls, free_port(), "b")]
                try:
                    if label == "one_router":
                        results[label].append(hit_rate_of(routers[0].url, fleet.urls, args, seed, label))
                        continue
                    with Balancer([r.port for r in routers]) as front:
                        results[label].append(hit_rate_of(front.url, fleet.urls, args, seed, label))
                        if seed == args.seeds[-1]:
                            results["kill"] = kill_one(front.url, routers, fleet.urls, args)
                            results["restart"] = restart(routers)
                finally:
                    for router in routers:
                        stop_server(router.process)
    ratios = [
        round(two["hit_rate"] / one["hit_rate"], 4)
        for one, two in zip(results["one_router"], results["two_routers"], strict=True)
        if one["hit_rate"]
    ]
    results["hit_rate_two_over_one"] = ratios
    print(json.dumps(results, indent=1))
    write_result(out, "router_replicas", args, results)


class Balancer:
    """``python -m splitserve.deploy.balancer`` in front of local ``ports``, stopped on exit."""

    def __init__(self, ports: list[int]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        targets = [a for port in ports for a in ("--target", f"127.0.0.1:{port}")]
        command = [sys.executable, "-m", "splitserve.deploy.balancer", "--port", str(self.port), *targets]
        log = (LOGS / f"replicas-balancer-{self.port}.log").open("wb")
        self.process = subprocess.Popen(command, stderr=log, start_new_session=True)  # stop_server kills its group
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.process.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(f"{self.url}/health", timeout=5)
                return
            time.sleep(0.2)
        raise RuntimeError(f"the balancer did not start (log: {LOGS})")

    def __enter__(self) -> Balancer:
        return self

    def __exit__(self, *exc: object) -> None:
        stop_server(self.process)


class Fleet:
    """``num`` fresh workers (one thread each, 256 MiB of KV), stopped on exit."""

    def __init__(self, num: int) -> None:
        self.ports = [free_port() for _ in range(num)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.processes: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Fleet:
        for i, port in enumerate(self.ports):
            command = [*SPLITSERVE, "worker", "--model", MODEL, "--port", str(port), "--num-threads", "1",
                       "--max-model-len", "4096", "--kv-cache-memory", "256MiB"]  # fmt: skip
            self.processes.append(start_server(command, port, LOGS / f"replicas-worker{i}.log"))
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self.processes:
            stop_server(process)


def kill_one(url: str, routers: list[Router], workers: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The load through the balancer; router a SIGKILLed ``--kill-after`` seconds in."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "result.json"
        command = [*SPLITSERVE, "bench", "serve", "--url", url, "--model", MODEL, "--label", "kill", "--no-progress",
                   "--json", str(report), *bench_args(args, args.seeds[-1] + 1)]  # fmt: skip
        before = hit_counters(workers)
        load = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        time.sleep(args.kill_after)
        in_flight = metric(routers[0].url, "splitserve:router_requests_in_flight")
        routers[0].process.send_signal(signal.SIGKILL)
        routers[0].process.wait()
        killed_at = time.monotonic()
        load.wait()
        document = json.loads(report.read_text())
        after = hit_counters(workers)
    summary = document["summary"]
    failed = [r for r in document["requests"] if not r["success"]]
    return {
        "in_flight_on_killed_router": in_flight,
        "num_ok": summary["num_completed"],
        "num_failed": summary["num_failed"],
        "failed_errors": sorted({str(r.get("error", ""))[:120] for r in failed}),
        "seconds_of_load_after_kill": round(time.monotonic() - killed_at, 1),
        "hit_rate": hit_rate(before, after),
    }


def restart(routers: list[Router]) -> dict[str, Any]:
    """Router a back on its port: seconds until its index holds as many entries as the survivor's (95 %)."""
    began = time.monotonic()
    routers[0].restart()
    up_s = time.monotonic() - began
    target = routers[1].index_entries()
    while time.monotonic() - began < 120 and routers[0].index_entries() < 0.95 * target:
        time.sleep(0.1)
    return {"healthy_after_s": round(up_s, 2), "index_caught_up_after_s": round(time.monotonic() - began, 2),
            "survivor_index_entries": target, "restarted_index_entries": routers[0].index_entries()}  # fmt: skip


if __name__ == "__main__":
    main()

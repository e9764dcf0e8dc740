"""Autoscaling under a load that steps up and back down: does the TTFT SLO hold after each step, how long does it
take to settle, what replica-seconds does it use against a fleet fixed at the maximum, and is any request lost?

    .venv/bin/python benchmarks/autoscaling.py [--rates 1,6,1] [--phase-s 60] [--slo-s 2.0]

``splitserve up`` runs ``examples/autoscaling.yaml`` (colocated SmolLM2 workers with one core each, between 1 and
``--max-replicas``, kvaware) with its autoscaling section's targets (``--slo-s`` as ``targetTtftSeconds``), then an
open-loop load: Poisson arrivals at each of ``--rates`` requests/s for ``--phase-s`` seconds, every request a
streamed chat completion of a distinct prompt (a ``--prompt-words`` text; ``--max-tokens`` answer). Meanwhile the
replica count (the supervisor's ``state.json``, ready pods) is read every half second. Reported per phase: TTFT
p50/p99, the p99 of each ``--window-s`` window, the settling time (from the step to the start of the first
window from which every window of the phase keeps p99 within the SLO), replica-seconds (ready workers over time)
against ``--max-replicas`` x the run's duration, and the requests that did not get a 200 with a whole answer.
``--fixed`` runs the same load with the autoscaling section removed and ``--max-replicas`` workers throughout,
for comparison. Results go to ``benchmarks/results/autoscaling_<cpu class>.json``.

``--dpd`` runs ``examples/dpd.yaml`` instead (one core per pod, prompts from ``--threshold`` tokens through
prefill): decode scaled by ``--target-concurrency`` requests in flight per pod, between 1 and ``--max-replicas``,
and prefill following it by ``--decode-ratio`` (``decodeRatio``); replica-seconds then count every worker pod,
against a fleet fixed at both maxima.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from common import REPO, SPLITSERVE, free_port, write_result

from splitserve.bench.metrics import percentile
from splitserve.model.kernels import detect_cpu

WORDS = [
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "his", "her",
    "an", "were", "are", "which", "this", "be", "or", "had",
]  # fmt: skip


def resource(args: argparse.Namespace, fixed: bool) -> dict[str, Any]:
    if args.dpd:
        return dpd_resource(args, fixed)
    data: dict[str, Any] = yaml.safe_load((REPO / "examples" / "autoscaling.yaml").read_text())
    scaling = data["spec"]["autoscaling"]
    scaling["colocated"].update(maxReplicas=args.max_replicas, targetTtftSeconds=args.slo_s)
    scaling["scaleDownStabilizationSeconds"] = args.scale_down_s
    if fixed:
        del data["spec"]["autoscaling"]
        data["spec"]["replicas"] = args.max_replicas
    return data


def max_prefill(args: argparse.Namespace) -> int:
    return math.ceil(args.max_replicas * args.decode_ratio - 1e-9)


def max_workers(args: argparse.Namespace) -> int:
    """The fleet fixed at the maximum: every worker pod."""
    return args.max_replicas + (max_prefill(args) if args.dpd else 0)


def dpd_resource(args: argparse.Namespace, fixed: bool) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((REPO / "examples" / "dpd.yaml").read_text())
    pd = data["spec"]["pdSpec"]
    pd["routingThreshold"] = args.threshold
    if fixed:
        pd["prefillSpec"]["replicas"], pd["decodingSpec"]["replicas"] = max_prefill(args), args.max_replicas
        return data
    data["spec"]["autoscaling"] = {
        "decode": {"minReplicas": 1, "maxReplicas": args.max_replicas, "targetConcurrency": args.target_concurrency},
        "prefill": {"minReplicas": 1, "maxReplicas": max_prefill(args), "decodeRatio": args.decode_ratio},
        "intervalSeconds": 2, "scaleDownStabilizationSeconds": args.scale_down_s,
    }  # fmt: skip
    return data


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + ". Summarise the text above."


async def one_request(client: httpx.AsyncClient, text: str, max_tokens: int) -> tuple[float | None, bool]:
    """(TTFT in seconds or None, whether a whole answer came back with a 200)."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "stream": True, "temperature": 0}  # fmt: skip
    began, ttft = time.monotonic(), None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as answer:
            if answer.status_code != 200:
                return None, False
            done = False
            async for line in answer.aiter_lines():
                if ttft is None and line.startswith("data: {") and _has_text(line):
                    ttft = time.monotonic() - began  # the first text: a chat's first chunk may be its role alone
                done = done or line == "data: [DONE]"
            return ttft, done
    except httpx.HTTPError:
        return ttft, False


def _has_text(line: str) -> bool:
    choices = json.loads(line.removeprefix("data: ")).get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


async def load(url: str, args: argparse.Namespace, started: float) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    records: list[dict[str, Any]] = []
    tasks = []
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=400)) as client:

        async def timed(phase: int, sent: float, text: str) -> None:
            ttft, ok = await one_request(client, text, args.max_tokens)
            records.append({"phase": phase, "sent_s": sent - started, "ttft_s": ttft, "ok": ok})

        for phase, rate in enumerate(args.rates):
            end = time.monotonic() + args.phase_s
            while (now := time.monotonic()) < end:
                tasks.append(asyncio.create_task(timed(phase, now, prompt(rng, args.prompt_words))))
                await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return records


def ready_workers(home: Path, name: str) -> int:
    return sum(ready_by_role(home, name).values())


def ready_by_role(home: Path, name: str) -> dict[str, int]:
    try:
        state = json.loads((home / "endpoints" / name / "state.json").read_text())
    except (OSError, ValueError):
        return {}
    counts: dict[str, int] = {}
    for pod in state["pods"]:
        if pod["role"] in ("colocated", "prefill", "decode") and pod["ready"]:
            counts[pod["role"]] = counts.get(pod["role"], 0) + 1
    return counts


def run(args: argparse.Namespace, fixed: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        data = resource(args, fixed)
        path = home / "endpoint.yaml"
        path.write_text(yaml.safe_dump(data))
        port = free_port()
        log = REPO / "benchmarks" / "results" / "logs" / f"autoscaling-{'fixed' if fixed else 'scaled'}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "SPLITSERVE_HOME": str(home)}
        up = subprocess.Popen([*SPLITSERVE, "up", "-f", str(path), "--port", str(port)], env=env,
                              stdout=log.open("wb"), stderr=subprocess.STDOUT)  # fmt: skip
        name = data["metadata"]["name"]
        try:
            deadline = time.monotonic() + 300
            want = max_workers(args) if fixed else 2 if args.dpd else 1
            while ready_workers(home, name) < want or not _healthy(port):
                if time.monotonic() > deadline or up.poll() is not None:
                    raise RuntimeError(f"the endpoint did not start (log: {log})")
                time.sleep(0.5)
            started = time.monotonic()
            samples: list[tuple[float, int]] = []
            roles: list[tuple[float, dict[str, int]]] = []
            loop = asyncio.new_event_loop()
            task = loop.create_task(load(f"http://127.0.0.1:{port}", args, started))
            while not task.done():
                counts = ready_by_role(home, name)
                samples.append((time.monotonic() - started, sum(counts.values())))
                roles.append((round(time.monotonic() - started, 1), counts))
                loop.run_until_complete(asyncio.wait([task], timeout=0.5))
            records = task.result()
            loop.close()
        finally:
            up.send_signal(2)
            up.wait(120)
    summary = summarize(records, samples, args)
    if args.dpd:  # each role's count whenever it changed
        summary["roles_timeline"] = [r for i, r in enumerate(roles) if i == 0 or r[1] != roles[i - 1][1]]
    return summary


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def summarize(records: list[dict[str, Any]], samples: list[tuple[float, int]], args: argparse.Namespace) -> dict:
    duration = samples[-1][0] if samples else 0.0
    replica_s = sum((t1 - t0) * n for (t0, n), (t1, _) in itertools.pairwise(samples))
    phases = []
    for phase, rate in enumerate(args.rates):
        mine = [r for r in records if r["phase"] == phase]
        ttfts = [r["ttft_s"] for r in mine if r["ttft_s"] is not None]
        start = phase * args.phase_s
        windows = []
        for w in range(int(args.phase_s // args.window_s)):
            lo = start + w * args.window_s
            inside = [r["ttft_s"] for r in mine if lo <= r["sent_s"] < lo + args.window_s and r["ttft_s"] is not None]
            windows.append(round(percentile(inside, 99), 3) if inside else None)
        settled = next((i for i in range(len(windows)) if all(p is None or p <= args.slo_s for p in windows[i:])), None)
        replicas = [n for t, n in samples if start <= t < start + args.phase_s]
        phases.append({
            "rate": rate, "requests": len(mine), "lost": sum(not r["ok"] for r in mine),
            "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
            "ttft_p99_s": round(percentile(ttfts, 99), 3) if ttfts else None,
            "window_p99_s": windows,
            "settled_after_s": None if settled is None else settled * args.window_s,
            "replicas_min_max": [min(replicas), max(replicas)] if replicas else None,
        })  # fmt: skip
    return {"phases": phases, "duration_s": round(duration, 1), "replica_seconds": round(replica_s, 1),
            "fixed_at_max_replica_seconds": round(max_workers(args) * duration, 1),
            "replica_timeline": [(round(t, 1), n) for t, n in samples[:: max(1, len(samples) // 200)]],
            "lost": sum(not r["ok"] for r in records), "requests": len(records)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=lambda t: [float(x) for x in t.split(",")], default=[1.0, 6.0, 1.0])
    parser.add_argument("--phase-s", type=float, default=60.0)
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--slo-s", type=float, default=2.0, help="the TTFT p99 to hold (targetTtftSeconds)")
    parser.add_argument("--max-replicas", type=int, default=2)
    parser.add_argument("--scale-down-s", type=float, default=30.0, help="scaleDownStabilizationSeconds")
    parser.add_argument("--prompt-words", type=int, default=120)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fixed", action="store_true", help="also run a fleet fixed at --max-replicas")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--dpd", action="store_true", help="examples/dpd.yaml: decode scaled, prefill by ratio")
    parser.add_argument("--target-concurrency", type=float, default=4.0, help="--dpd: decode's targetConcurrency")
    parser.add_argument("--decode-ratio", type=float, default=0.5, help="--dpd: prefill's decodeRatio")
    parser.add_argument("--threshold", type=int, default=256, help="--dpd: routingThreshold (prompt tokens)")
    args = parser.parse_args()
    out = args.out or REPO / "benchmarks" / "results" / f"autoscaling_{detect_cpu().isa_class}.json"
    results = {"autoscaled": run(args, fixed=False)}
    if args.fixed:
        results["fixed"] = run(args, fixed=True)
    print(json.dumps({k: {**v, "replica_timeline": "..."} for k, v in results.items()}, indent=1))
    write_result(out, "autoscaling", args, results)


if __name__ == "__main__":
    main()

"""Soak: an endpoint under steady load for a long time while its processes are killed; does it lose anything?

The endpoint is what a user runs: ``splitserve up`` over a resource with two colocated workers (one core
each), L1 and a shared Redis L2 (the supervisor starts its own redis-server) and a roundrobin router. The load
is mixed chat streams (60% short prompts, 30% medium, 10% long over a shared preamble), sent open-loop
(Poisson arrivals) at ``--load`` (0.7) times the capacity measured first in a closed loop. Meanwhile a worker
is SIGKILLed every ``--kill-every`` seconds (alternately; the supervisor restarts it) and Redis once, at
``--redis-restart-at``.

It reports requests lost (anything but a complete 200 stream: target 0), errors by kind, TTFT and ITL p99
per minute, and each pod process's RSS over time with its slope (MB/hour over the second half of the
process's life, once its caches have filled; target: flat), as JSON and a plot.

    .venv/bin/python benchmarks/soak.py                      # 30 minutes
    .venv/bin/python benchmarks/soak.py --duration 180 --kill-every 60 --redis-restart-at 90   # a short check
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, SPLITSERVE, free_port, write_result

RESOURCE = """\
apiVersion: splitserve.io/v1alpha1
kind: InferenceEndpointConfig
metadata:
  name: soak
spec:
  modelName: smollm2
  modelSourceConfig:
    modelSourceType: local
    modelLocation: smollm2
  replicas: 2
  kvCacheSpec:
    enableL1Cache: true
    enableL2Cache: true
    l2CacheSpec:
      l2CacheBackend: redis
  intelligentRoutingSpec:
    enabled: true
    routingStrategy: roundrobin
  worker:
    args: ["--max-num-seqs", "16", "--max-model-len", "2048"]
    resources:
      limits:
        cpu: "1"
"""
WORDS = [
    "river", "stone", "lantern", "harbor", "meadow", "copper", "violet", "engine", "garden", "signal",
    "summer", "thunder", "orchard", "ladder", "marble", "compass", "shadow", "feather", "canyon", "velvet",
]  # fmt: skip
PREAMBLE = "You are a careful assistant. Facts: " + " ".join(
    f"item {i} is {WORDS[i % len(WORDS)]} and {WORDS[(i * 7) % len(WORDS)]}." for i in range(120)
)
SETTLED_AFTER = 0.5  # an RSS slope is taken over the second half of a process's life (caches fill first)
MIN_SLOPE_S = 240.0  # ...of at least this many seconds


@dataclass
class Outcome:
    start_s: float
    kind: str  # short, medium, long
    status: str = "pending"  # ok, http_<code>, stream_error, incomplete, <exception name>
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)


def messages(rng: random.Random) -> tuple[str, list[dict[str, str]], int]:
    draw = rng.random()
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 20)))
    if draw < 0.6:
        return "short", [{"role": "user", "content": f"Write a line about {words}."}], 32
    if draw < 0.9:
        body = " ".join(rng.choice(WORDS) for _ in range(rng.randint(150, 300)))
        return "medium", [{"role": "user", "content": f"Summarize: {body}"}], 48
    question = f"Which items are {rng.choice(WORDS)}? ({words})"
    return "long", [{"role": "system", "content": PREAMBLE}, {"role": "user", "content": question}], 48


async def one_request(session: aiohttp.ClientSession, url: str, rng: random.Random, t0: float) -> Outcome:
    kind, chat, max_tokens = messages(rng)
    outcome = Outcome(time.perf_counter() - t0, kind)
    body = {"model": "smollm2", "messages": chat, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    began = time.perf_counter()
    last = None
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            if response.status != 200:
                outcome.status = f"http_{response.status}"
                await response.read()
                return outcome
            done = False
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                if b'"error"' in data and "error" in json.loads(data):
                    outcome.status = "stream_error"
                    return outcome
                now = time.perf_counter()
                if b'"content"' in data:
                    if outcome.ttft_s is None:
                        outcome.ttft_s = now - began
                    elif last is not None:
                        outcome.itls_s.append(now - last)
                    last = now
            outcome.status = "ok" if done else "incomplete"
    except (aiohttp.ClientError, TimeoutError) as exc:
        outcome.status = type(exc).__name__
    return outcome


async def closed_loop(url: str, concurrency: int, seconds: float) -> float:
    """Completed requests per second with ``concurrency`` clients sending back to back."""
    rng = random.Random(1)
    finished = 0
    stop_at = time.perf_counter() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def client() -> None:
            nonlocal finished
            while time.perf_counter() < stop_at:
                if (await one_request(session, url, rng, 0.0)).status == "ok":
                    finished += 1

        began = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return finished / (time.perf_counter() - began)


def pods(home: Path) -> list[dict[str, Any]]:
    try:
        state: dict[str, Any] = json.loads((home / "endpoints" / "soak" / "state.json").read_text())
    except (OSError, ValueError):
        return []
    return list(state.get("pods", []))


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def chaos(home: Path, args: argparse.Namespace, t0: float, events: list[dict[str, Any]]) -> None:
    """SIGKILL a worker every ``kill_every`` seconds (alternately), and Redis once."""
    next_kill, redis_done, turn = args.kill_every, False, 0
    while time.perf_counter() - t0 < args.duration:
        now = time.perf_counter() - t0
        if not redis_done and now >= args.redis_restart_at:
            for pod in pods(home):
                if pod["role"] == "redis" and pod["pid"]:
                    os.kill(pod["pid"], signal.SIGKILL)
                    events.append({"t_s": now, "event": "kill redis", "pod": pod["name"]})
            redis_done = True
        if now >= next_kill:
            workers = sorted((p for p in pods(home) if p["role"] == "colocated"), key=lambda p: p["name"])
            if workers and workers[turn % len(workers)]["pid"]:
                victim = workers[turn % len(workers)]
                os.kill(victim["pid"], signal.SIGKILL)
                events.append({"t_s": now, "event": "kill worker", "pod": victim["name"]})
            turn += 1
            next_kill += args.kill_every
        await asyncio.sleep(0.5)


async def sample_rss(home: Path, duration_s: float, t0: float, samples: list[dict[str, Any]]) -> None:
    while time.perf_counter() - t0 < duration_s:
        for pod in pods(home):
            if pod["pid"] and (rss := rss_mb(pod["pid"])) is not None:
                samples.append({"t_s": time.perf_counter() - t0, "pod": pod["name"], "role": pod["role"],
                                "pid": pod["pid"], "rss_mb": rss})  # fmt: skip
        await asyncio.sleep(10)


async def open_loop(url: str, rate: float, home: Path, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(7)
    outcomes: list[Outcome] = []
    events: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900), connector=connector) as session:
        background = [
            asyncio.create_task(chaos(home, args, t0, events)),
            asyncio.create_task(sample_rss(home, args.duration, t0, samples)),
        ]
        tasks = []
        next_s = 0.0
        while next_s < args.duration:
            delay = next_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one_request(session, url, random.Random(rng.random()), t0)))
            next_s += rng.expovariate(rate)
        outcomes = list(await asyncio.gather(*tasks))
        await asyncio.gather(*background)
    return {"outcomes": outcomes, "events": events, "rss": samples}


def p99(values: list[float]) -> float | None:
    return statistics.quantiles(values, n=100)[98] if len(values) >= 20 else (max(values) if values else None)


def summarize(run: dict[str, Any], rate: float, capacity: float) -> dict[str, Any]:
    outcomes: list[Outcome] = run["outcomes"]
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.status != "ok":
            errors[o.status] = errors.get(o.status, 0) + 1
    minutes = []
    for minute in range(int(max((o.start_s for o in outcomes), default=0) // 60) + 1):
        window = [o for o in outcomes if minute * 60 <= o.start_s < (minute + 1) * 60]
        ttfts = [o.ttft_s for o in window if o.ttft_s is not None]
        itls = [i for o in window for i in o.itls_s]
        minutes.append({"minute": minute, "requests": len(window), "ok": sum(o.status == "ok" for o in window),
                        "ttft_p99_s": p99(ttfts), "itl_p99_s": p99(itls)})  # fmt: skip
    slopes = {}
    by_process: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for s in run["rss"]:
        by_process.setdefault((s["pod"], s["pid"]), []).append((s["t_s"], s["rss_mb"]))
    for (pod, pid), points in by_process.items():
        began, ended = points[0][0], points[-1][0]
        settled = [(t, r) for t, r in points if t >= began + (ended - began) * SETTLED_AFTER]
        if len(settled) >= 6 and settled[-1][0] - settled[0][0] >= MIN_SLOPE_S:
            xs, ys = [t / 3600 for t, _ in settled], [r for _, r in settled]
            slope = statistics.linear_regression(xs, ys).slope
            slopes[f"{pod} (pid {pid})"] = {"mb_per_hour": round(slope, 1), "minutes": round((xs[-1] - xs[0]) * 60, 1),
                                            "lived_minutes": round((ended - began) / 60, 1),
                                            "rss_mb_max": round(max(r for _, r in points), 1),
                                            "rss_mb_last": round(ys[-1], 1)}  # fmt: skip
    all_ttft = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    all_itl = [i for o in outcomes for i in o.itls_s]
    return {
        "capacity_rps": round(capacity, 3),
        "rate_rps": round(rate, 3),
        "requests": len(outcomes),
        "ok": sum(o.status == "ok" for o in outcomes),
        "lost": len(outcomes) - sum(o.status == "ok" for o in outcomes),
        "errors": errors,
        "ttft_p99_s": p99(all_ttft),
        "itl_p99_s": p99(all_itl),
        "by_kind": {k: sum(o.kind == k for o in outcomes) for k in ("short", "medium", "long")},
        "events": run["events"],
        "minutes": minutes,
        "rss_slopes": slopes,  # over the second half of each process's life
        "rss": run["rss"],
    }


def plot(summary: dict[str, Any], rss: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, mem) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    minutes = summary["minutes"]
    xs = [m["minute"] + 0.5 for m in minutes]
    lat.plot(xs, [m["ttft_p99_s"] for m in minutes], marker="o", label="TTFT p99 (s)")
    lat.plot(xs, [m["itl_p99_s"] for m in minutes], marker="s", label="ITL p99 (s)")
    lat.set_yscale("log")
    lat.set_ylabel("seconds (log)")
    lat.set_title(f"soak: {summary['requests']} requests, {summary['lost']} lost, {summary['rate_rps']} req/s "
                  f"({summary['rate_rps'] / summary['capacity_rps']:.0%} of capacity)")  # fmt: skip
    for ax in (lat, mem):
        for event in summary["events"]:
            ax.axvline(event["t_s"] / 60, color="red" if "worker" in event["event"] else "purple", alpha=0.4, lw=1)
    lat.legend()
    by_process: dict[str, list[tuple[float, float]]] = {}
    for s in rss:
        by_process.setdefault(f"{s['role']} {s['pid']}", []).append((s["t_s"] / 60, s["rss_mb"]))
    for name, points in sorted(by_process.items()):
        mem.plot([t for t, _ in points], [r for _, r in points], label=name, lw=1)
    mem.set_ylabel("RSS (MB)")
    mem.set_xlabel("minutes (red: a worker SIGKILLed, purple: Redis SIGKILLed)")
    mem.legend(fontsize=6, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=1800.0)
    parser.add_argument("--kill-every", type=float, default=300.0)
    parser.add_argument("--redis-restart-at", type=float, default=900.0)
    parser.add_argument("--load", type=float, default=0.7, help="share of the measured capacity to send")
    parser.add_argument("--capacity-seconds", type=float, default=90.0)
    parser.add_argument("--capacity-concurrency", type=int, default=8)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "soak.json")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "soak.png")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="soak-"))
    resource = home / "soak.yaml"
    resource.write_text(RESOURCE)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "SPLITSERVE_HOME": str(home)}
    log = (home / "up.log").open("wb")
    up = subprocess.Popen([*SPLITSERVE, "up", "-f", str(resource), "--port", str(port)], stdout=log,
                          stderr=subprocess.STDOUT, env=env)  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while not (pods(home) and all(p["ready"] for p in pods(home))):
            if up.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the endpoint did not come up; see {home / 'up.log'}")
            time.sleep(1)
        print(f"endpoint up: {url}; logs in {home}", flush=True)
        capacity = asyncio.run(closed_loop(url, args.capacity_concurrency, args.capacity_seconds))
        rate = capacity * args.load
        print(f"capacity {capacity:.2f} req/s; sending {rate:.2f} req/s for {args.duration:.0f} s", flush=True)
        run = asyncio.run(open_loop(url, rate, home, args))
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(120)
        log.close()
    summary = summarize(run, rate, capacity)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("minutes", "rss")}, indent=2))
    write_result(args.out, "soak", args, summary)  # per minute, not per request (the file stays small)
    plot(summary, run["rss"], args.plot)


if __name__ == "__main__":
    main()

"""Open-loop overload against a running endpoint: requests arrive at a fixed rate whatever the answers, while the
health of the router and its workers is probed; then :func:`recovered` checks what follows the load. Shared by
``benchmarks/overload.py`` and the overload e2e test.

Each request is a streamed completion of a random-word prompt. What comes back is classed by HTTP status (a
stream that ended with an error event, or a connection that broke, is ``"broken"``; a client-side timeout or
connect error is ``"no answer"``). Probes ``GET /health`` every ``PROBE_PERIOD_S`` on each URL and keep the
slowest answer (a probe without an answer within ``PROBE_TIMEOUT_S`` counts as that long).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from splitserve.metrics import sum_samples

WORDS = [
    "river",
    "stone",
    "cloud",
    "garden",
    "window",
    "paper",
    "silver",
    "forest",
    "candle",
    "morning",
    "letter",
    "harbor",
    "engine",
    "lantern",
    "meadow",
    "thunder",
    "orchard",
    "pocket",
    "mirror",
    "velvet",
    "compass",
    "island",
    "ladder",
    "marble",
    "shadow",
    "violin",
    "canyon",
    "feather",
    "glacier",
]
PROBE_PERIOD_S = 0.25
PROBE_TIMEOUT_S = 5.0


def random_prompt(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


@dataclass
class Outcome:
    """What one request got."""

    status: str  # "200", "429", ..., "broken", "no answer"
    ttft_s: float | None = None
    detail: str = ""


@dataclass
class OverloadReport:
    rate: float
    duration_s: float
    outcomes: list[Outcome] = field(default_factory=list)
    slowest_health_s: dict[str, float] = field(default_factory=dict)
    num_probes: int = 0

    def counts(self) -> dict[str, int]:
        return dict(Counter(o.status for o in self.outcomes))

    def to_json(self) -> dict[str, Any]:
        ttfts = sorted(o.ttft_s for o in self.outcomes if o.ttft_s is not None)
        return {
            "rate_per_s": round(self.rate, 3),
            "duration_s": self.duration_s,
            "num_requests": len(self.outcomes),
            "statuses": self.counts(),
            "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
            "ttft_max_s": round(ttfts[-1], 3) if ttfts else None,
            "slowest_health_s": {url: round(s, 3) for url, s in self.slowest_health_s.items()},
            "num_probes": self.num_probes,
            "not_200_or_429": [o.detail or o.status for o in self.outcomes if o.status not in ("200", "429")][:20],
        }


async def _one(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Outcome:
    began = time.monotonic()
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return Outcome(str(response.status_code), detail=response.text[:200])
            ttft: float | None = None
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if ttft is None:
                    ttft = time.monotonic() - began
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    return Outcome("200", ttft)
                if "error" in json.loads(data):
                    return Outcome("broken", ttft, data[:200])
            return Outcome("broken", ttft, "the stream ended without [DONE]")
    except (httpx.ConnectError, httpx.TimeoutException) as exc:
        return Outcome("no answer", detail=f"{type(exc).__name__}: {exc}")
    except httpx.HTTPError as exc:
        return Outcome("broken", detail=f"{type(exc).__name__}: {exc}")


async def _probe(http: httpx.AsyncClient, urls: list[str], report: OverloadReport, stop: asyncio.Event) -> None:
    async def once(url: str) -> None:
        began = time.monotonic()
        try:
            await http.get(f"{url}/health", timeout=PROBE_TIMEOUT_S)
            took = time.monotonic() - began
        except httpx.HTTPError:
            took = PROBE_TIMEOUT_S
        report.slowest_health_s[url] = max(report.slowest_health_s.get(url, 0.0), took)

    while not stop.is_set():
        await asyncio.gather(*(once(url) for url in urls))
        report.num_probes += 1
        with_timeout = asyncio.ensure_future(stop.wait())
        await asyncio.wait([with_timeout], timeout=PROBE_PERIOD_S)
        with_timeout.cancel()


async def overload(
    url: str,
    model: str,
    rate: float,
    duration_s: float,
    health_urls: list[str],
    *,
    prompt_words: int = 120,
    max_tokens: int = 32,
    seed: int = 0,
    headers: dict[str, str] | None = None,
    request_timeout_s: float = 600.0,
) -> OverloadReport:
    """Send Poisson arrivals at ``rate`` per second for ``duration_s`` to ``url``, probing ``health_urls`` until every
    request has its answer."""
    rng = random.Random(seed)
    report = OverloadReport(rate, duration_s)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(request_timeout_s, connect=10.0)
    async with (
        httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers, trust_env=False) as http,
        httpx.AsyncClient(limits=limits, trust_env=False) as probes,
    ):
        stop = asyncio.Event()
        prober = asyncio.create_task(_probe(probes, health_urls, report, stop))
        tasks: list[asyncio.Task[Outcome]] = []
        began = time.monotonic()
        at = 0.0
        while at < duration_s:
            await asyncio.sleep(max(0.0, began + at - time.monotonic()))
            body = {"model": model, "prompt": random_prompt(rng, prompt_words), "max_tokens": max_tokens,
                    "stream": True, "ignore_eos": True, "temperature": 0.0}  # fmt: skip
            tasks.append(asyncio.create_task(_one(http, url, body)))
            at += rng.expovariate(rate)
        report.outcomes = list(await asyncio.gather(*tasks))
        stop.set()
        await prober
    return report


async def closed_loop_rate(
    url: str,
    model: str,
    concurrency: int,
    duration_s: float,
    *,
    prompt_words: int = 120,
    max_tokens: int = 32,
    headers: dict[str, str] | None = None,
) -> float:
    """Requests per second the endpoint completes with ``concurrency`` clients each sending the next request as
    soon as the last one answered: its capacity for this request shape."""
    rng = random.Random(1)
    done = 0
    deadline = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600.0, limits=limits, headers=headers, trust_env=False) as http:

        async def client() -> None:
            nonlocal done
            while time.monotonic() < deadline:
                body = {"model": model, "prompt": random_prompt(rng, prompt_words), "max_tokens": max_tokens,
                        "stream": True, "ignore_eos": True, "temperature": 0.0}  # fmt: skip
                outcome = await _one(http, url, body)
                if outcome.status != "200":
                    raise RuntimeError(f"a request failed while measuring capacity: {outcome}")
                done += 1

        began = time.monotonic()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return done / (time.monotonic() - began)


def recovered(router: str, worker: str, model: str, num_requests: int = 5, timeout_s: float = 120.0) -> dict[str, Any]:
    """After a load: whether the worker's queue empties within ``timeout_s``, and how many of ``num_requests``
    sent one after another through the router are then served."""

    def left() -> float:
        page = httpx.get(f"{worker}/metrics", timeout=10.0).text
        return sum_samples(page, "vllm:num_requests_running") + sum_samples(page, "vllm:num_requests_waiting")

    deadline = time.monotonic() + timeout_s
    while left() > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8}
    served = sum(
        httpx.post(f"{router}/v1/completions", json=body, timeout=60.0).status_code == 200 for _ in range(num_requests)
    )
    return {"queue_empty": left() == 0, "served_after": served}

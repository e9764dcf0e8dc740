"""``splitserve bench serve``: send a dataset's requests to an endpoint at a rate and summarize them."""

from __future__ import annotations

import asyncio
import math
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

import httpx
from tqdm import tqdm

from splitserve.bench.client import EndpointKind, OpenAIStreamClient, RequestResult
from splitserve.bench.datasets import BenchRequest, DatasetConfig, get_dataset
from splitserve.bench.metrics import summarize
from splitserve.bench.report import BenchReport, format_table, write_json

WARMUP_SEED_OFFSET = 1_000_003
"""Warmup prompts use seed + this, so they do not pre-warm the measured prompts' prefix cache entries."""


@dataclass(frozen=True)
class ServeConfig:
    """Everything one ``bench serve`` run needs; ``validate()`` checks it."""

    url: str
    """Base URL of the OpenAI-compatible server, e.g. ``http://127.0.0.1:8000`` (a ``/v1`` suffix is ok)."""
    model: str
    """Value of the ``model`` field in every request."""
    endpoint: EndpointKind = EndpointKind.COMPLETIONS
    """``completions`` (prompt) or ``chat`` (one user message)."""
    dataset: str = "random"
    """Registered dataset name (see ``datasets.dataset_names()``)."""
    dataset_config: DatasetConfig = field(default_factory=DatasetConfig)
    num_prompts: int = 100
    """Number of measured requests."""
    request_rate: float = math.inf
    """Mean requests per second of a Poisson arrival process; ``inf`` sends everything at once."""
    max_concurrency: int | None = None
    """At most this many requests in flight; ``None`` for no limit."""
    seed: int = 0
    """Seeds the prompts and the arrival times."""
    ignore_eos: bool = True
    """Ask the server to ignore end-of-sequence so every request produces exactly ``max_tokens``."""
    timeout_s: float = 600.0
    """Per-request timeout (connect, read, write and pool each)."""
    warmup: int = 0
    """Requests sent one by one before the measured run; not counted."""
    show_progress: bool = True
    label: str | None = None
    """Free-form tag stored in the JSON result (e.g. ``vllm`` or ``splitserve-kvaware``)."""
    json_path: Path | None = None
    """Where to write the JSON result; ``None`` for none."""
    api_key: str | None = None
    """Sent as ``Authorization: Bearer <key>`` when set."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending values."""
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        if self.num_prompts < 1 or self.warmup < 0:
            raise ValueError(f"need num_prompts >= 1 and warmup >= 0, got {self.num_prompts}, {self.warmup}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf for all at once), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        self.dataset_config.validate()


def arrival_times(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times in seconds after the start: Poisson arrivals at ``request_rate``, or all 0 for inf."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num_requests):
        times.append(now)
        now += rng.expovariate(request_rate)
    return times


async def run_requests(
    client: OpenAIStreamClient,
    requests: Sequence[BenchRequest],
    send_times_s: Sequence[float],
    *,
    max_concurrency: int | None = None,
    progress: tqdm | None = None,
) -> tuple[list[RequestResult], float]:
    """Send ``requests[i]`` at ``send_times_s[i]`` (or later, when ``max_concurrency`` are in flight).

    Returns the results in request order and the run's duration in seconds (first send to last answer).
    """
    gate = asyncio.Semaphore(max_concurrency or len(requests))
    start = client.clock()

    async def send_one(request: BenchRequest, send_at_s: float) -> RequestResult:
        delay_s = send_at_s - (client.clock() - start)
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        async with gate:
            result = await client.send(request, run_start_s=start)
        if progress is not None:
            progress.update(1)
        return result

    results = await asyncio.gather(*map(send_one, requests, send_times_s))
    return list(results), client.clock() - start


async def serve(
    config: ServeConfig, *, transport: httpx.AsyncBaseTransport | None = None, out: TextIO | None = None
) -> BenchReport:
    """Run the benchmark described by ``config``, print its table to ``out`` and write its JSON.

    ``transport`` replaces the network (tests pass ``httpx.MockTransport``). Proxy settings from the
    environment are ignored: a benchmark measures the server, not a proxy. ``out`` defaults to stdout.
    """
    out = out or sys.stdout
    config.validate()
    dataset = get_dataset(config.dataset, config.dataset_config)
    requests = dataset.sample(config.num_prompts, config.seed)
    async with _http_client(config, transport) as http:
        client = OpenAIStreamClient(
            http, base_url=config.url, model=config.model, kind=config.endpoint, ignore_eos=config.ignore_eos
        )
        if config.warmup:
            await _warm_up(client, dataset.sample(config.warmup, config.seed + WARMUP_SEED_OFFSET), out)
        started_at = datetime.now(UTC).isoformat(timespec="seconds")
        send_times_s = arrival_times(len(requests), config.request_rate, config.seed)
        with tqdm(total=len(requests), disable=not config.show_progress, file=sys.stderr) as progress:
            results, duration_s = await run_requests(
                client, requests, send_times_s, max_concurrency=config.max_concurrency, progress=progress
            )
    report = BenchReport(config, summarize(results, duration_s), results, started_at)
    print(format_table(report), file=out)
    if config.json_path is not None:
        write_json(report, config.json_path)
        print(f"wrote {config.json_path}", file=out)
    return report


def _http_client(config: ServeConfig, transport: httpx.AsyncBaseTransport | None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    # Without a concurrency cap every request may hold a connection at once, so the pool must not queue.
    limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=None)
    return httpx.AsyncClient(
        transport=transport,
        timeout=httpx.Timeout(config.timeout_s),
        limits=limits,
        headers=headers,
        trust_env=False,
    )


async def _warm_up(client: OpenAIStreamClient, requests: Sequence[BenchRequest], out: TextIO) -> None:
    num_ok = 0
    for request in requests:
        result = await client.send(request)
        num_ok += result.success
        if not result.success:
            print(f"warmup request failed: {result.error}", file=out)
    print(f"warmup: {num_ok}/{len(requests)} requests succeeded", file=out)

"""``splitserve bench serve``: send a dataset's requests to an endpoint at a rate and summarize them.

Load model: request i arrives at ``send_times_s[i]`` (Poisson at ``request_rate``, in dataset order) and
is sent then, or later: when ``max_concurrency`` requests are in flight it waits for a slot, and when it
belongs to a session it waits until the session's previous request (earlier in the list) has finished, as a
user reads an answer before asking again. A session that waits holds no concurrency slot. So the rate is a
request arrival rate, and for session datasets an upper bound: a slow server lowers the achieved rate.
"""

from __future__ import annotations

import asyncio
import dataclasses
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
from splitserve.bench.datasets import BenchRequest, Dataset, DatasetConfig, dataset_names, get_dataset
from splitserve.bench.metrics import summarize
from splitserve.bench.report import BenchReport, format_table, write_json
from splitserve.settings import REQUIRED, setting

DATASET_PANEL = "Dataset options"
LOAD_PANEL = "Load options"

WARMUP_SEED_OFFSET = 1_000_003
"""Warmup prompts use seed + this, so they do not pre-warm the measured prompts' prefix cache entries."""


@dataclass(frozen=True)
class ServeConfig:
    """Everything one ``bench serve`` run needs; ``validate()`` checks it."""

    url: str = setting(REQUIRED, "Base URL of the server, e.g. http://127.0.0.1:8000 (a /v1 suffix is ok).")
    model: str = setting(REQUIRED, "Model name sent in every request.")
    endpoint: EndpointKind = setting(
        EndpointKind.COMPLETIONS, "completions (prompt) or chat (messages; multiround wants chat)."
    )
    dataset: str = setting("random", f"One of: {', '.join(dataset_names())}.", panel=DATASET_PANEL)
    dataset_config: DatasetConfig = field(default_factory=DatasetConfig)
    num_prompts: int = setting(
        100, "Measured requests (per point in a sweep; default 100; multiround: num-users * num-rounds).",
        option_default=None, option_type=int | None,
    )  # fmt: skip
    # a session's later rounds still wait for its earlier ones
    request_rate: float = setting(
        math.inf, "Poisson request arrivals per second; inf: all due at once (sessions still go round by round).",
        panel=LOAD_PANEL,
    )  # fmt: skip
    # sessions waiting between rounds do not count
    max_concurrency: int | None = setting(None, "At most this many requests in flight.", panel=LOAD_PANEL)
    seed: int = setting(0, "Seed for prompts and arrival times.")
    ignore_eos: bool = setting(True, "Generate exactly max_tokens per request (the server ignores end-of-sequence).")
    timeout_s: float = setting(600.0, "Seconds each connect, read or write of a request may take.")
    # the first `warmup` of the dataset drawn with another seed (cycled past num_prompts), without session ids
    warmup: int = setting(0, "Unmeasured requests sent one by one first.")
    show_progress: bool = setting(
        True, "Hide the progress bar.", flag="no-progress", negatable=False, option_default=False,
        convert=lambda hide: not hide,
    )  # fmt: skip
    label: str | None = setting(None, "Tag stored in the JSON result (vllm, splitserve-kvaware...).")
    json_path: Path | None = setting(None, "Write summary + per-request JSON here.", flag="json")
    api_key: str | None = setting(
        None, "Bearer token, if the server wants one.", env_aliases=("OPENAI_API_KEY",), secret=True
    )

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending values; dataset options first (num_prompts may derive
        from them)."""
        self.dataset_config.validate()
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
    """Send ``requests[i]`` at ``send_times_s[i]`` or later: later while ``max_concurrency`` requests are in
    flight, and, for a request with a ``session_id``, not before the previous request of that session in
    ``requests`` has finished (successfully or not). Sessions run concurrently with each other; a session
    waiting for its previous round holds no concurrency slot.

    Returns the results in request order and the run's duration in seconds (first send to last answer).
    """
    gate = asyncio.Semaphore(max_concurrency or len(requests))
    start = client.clock()
    results: dict[int, RequestResult] = {}

    async def send_chain(indices: list[int]) -> None:
        for i in indices:
            delay_s = send_times_s[i] - (client.clock() - start)
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            async with gate:
                results[i] = await client.send(requests[i], run_start_s=start)
            if progress is not None:
                progress.update(1)

    await asyncio.gather(*map(send_chain, session_chains(requests)))
    return [results[i] for i in range(len(requests))], client.clock() - start


def session_chains(requests: Sequence[BenchRequest]) -> list[list[int]]:
    """Indices of ``requests`` grouped into chains, each sent one request after the other.

    One chain per session (its requests in list order) and one single-request chain per request without a
    session; chains are ordered by their first index.
    """
    chains: list[list[int]] = []
    by_session: dict[str, list[int]] = {}
    for i, request in enumerate(requests):
        if request.session_id is None:
            chains.append([i])
        elif request.session_id in by_session:
            by_session[request.session_id].append(i)
        else:
            by_session[request.session_id] = [i]
            chains.append(by_session[request.session_id])
    return chains


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
            await _warm_up(client, _warmup_requests(dataset, config), out)
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


def _warmup_requests(dataset: Dataset, config: ServeConfig) -> list[BenchRequest]:
    """The first ``config.warmup`` requests of the dataset drawn with another seed, cycled if need be.

    It draws ``num_prompts`` requests, a count every dataset accepts (multiround's is fixed); session ids are
    dropped so that the warmup leaves no session state in a router.
    """
    pool = dataset.sample(config.num_prompts, config.seed + WARMUP_SEED_OFFSET)
    return [dataclasses.replace(pool[i % len(pool)], session_id=None) for i in range(config.warmup)]


async def _warm_up(client: OpenAIStreamClient, requests: Sequence[BenchRequest], out: TextIO) -> None:
    num_ok = 0
    for request in requests:
        result = await client.send(request)
        num_ok += result.success
        if not result.success:
            print(f"warmup request failed: {result.error}", file=out)
    print(f"warmup: {num_ok}/{len(requests)} requests succeeded", file=out)

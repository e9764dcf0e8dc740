"""The router's scrape of its workers' ``/metrics``, as production-stack's engine stats scraper does.

Every ``interval_s`` (production-stack's ``--engine-stats-interval`` default) each worker's page is read and its
``vllm:prefix_cache_{hits,queries}_total`` handed to the router's metrics, which expose them per worker as
production-stack's ``vllm:gpu_prefix_cache_*`` gauges. A worker that does not answer in ``timeout_s`` has its
last values forgotten (its gauges disappear until it answers again). The tokens the worker reports as cached
go to the hit check (``router/hit_check.py``), which compares them with what routing predicted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from splitserve.metrics import (
    EXTERNAL_PREFIX_CACHE_HITS_TOTAL,
    PREFIX_CACHE_HITS_TOTAL,
    PREFIX_CACHE_QUERIES_TOTAL,
    PROMPT_TOKENS_CACHED_TOTAL,
    PrefixCacheCounts,
    RouterMetrics,
    sample_totals,
)
from splitserve.router.hit_check import HitPredictionCheck
from splitserve.router.transport import Transport, TransportError

if TYPE_CHECKING:
    from splitserve.router.discovery import Worker

logger = logging.getLogger(__name__)

SCRAPE_INTERVAL_S = 30.0
MAX_PAGE_BYTES = 4 << 20  # a worker's metrics page is a few tens of KiB


class WorkerStatsScraper:
    """Reads every worker's ``/metrics`` (through ``transport``, each within ``timeout_s``) each ``interval_s``
    into ``metrics`` (the router's)."""

    def __init__(
        self,
        workers: Callable[[], Iterable[Worker]],
        transport: Transport,
        metrics: RouterMetrics,
        *,
        interval_s: float = SCRAPE_INTERVAL_S,
        timeout_s: float = 2.0,
        hit_check: HitPredictionCheck | None = None,
    ) -> None:
        self._workers = workers
        self._transport = transport
        self.metrics = metrics
        self.hit_check = hit_check
        self.interval_s = interval_s
        self.timeout_s = timeout_s

    async def run(self) -> None:
        while True:
            await self.scrape_all()
            await asyncio.sleep(self.interval_s)

    async def scrape_all(self) -> None:
        workers = list(self._workers())
        pages = await asyncio.gather(*(self._page(w.url) for w in workers))
        for worker, page in zip(workers, pages, strict=True):
            totals = page_totals(page) if page is not None else None  # the page parsed once, for both readers
            self.metrics.set_prefix_cache(worker.url, prefix_cache_counts(totals))
            if self.hit_check is not None:
                self.hit_check.reported(worker.url, cached_prompt_tokens(totals))

    async def _page(self, url: str) -> str | None:
        try:
            answer = await self._transport.get(f"{url}/metrics", self.timeout_s, MAX_PAGE_BYTES)
        except TransportError as exc:
            logger.debug("scraping %s/metrics failed: %s", url, exc)
            return None
        return answer.body.decode("utf-8", "replace") if answer.status == 200 else None


def page_totals(page: str) -> dict[str, float] | None:
    """A worker's metrics page read once (``metrics.sample_totals``); None when it does not parse."""
    try:
        return sample_totals(page)
    except ValueError:  # not a Prometheus text page
        return None


def cached_prompt_tokens(totals: Mapping[str, float] | None) -> float | None:
    """The prompt tokens a worker did not compute, cumulative: ``vllm:prompt_tokens_cached_total``, else (an
    older vLLM) its prefix-cache hits plus its external (connector) hits; None when the page (its
    :func:`page_totals`) has none of them or did not parse."""
    if totals is None:
        return None
    if PROMPT_TOKENS_CACHED_TOTAL in totals:
        return totals[PROMPT_TOKENS_CACHED_TOTAL]
    if PREFIX_CACHE_HITS_TOTAL not in totals:
        return None
    return totals[PREFIX_CACHE_HITS_TOTAL] + totals.get(EXTERNAL_PREFIX_CACHE_HITS_TOTAL, 0.0)


def prefix_cache_counts(totals: Mapping[str, float] | None) -> PrefixCacheCounts | None:
    """A worker's prefix-cache counters from its page's :func:`page_totals`; None when the page did not parse."""
    if totals is None:
        return None
    return PrefixCacheCounts(totals.get(PREFIX_CACHE_HITS_TOTAL, 0.0), totals.get(PREFIX_CACHE_QUERIES_TOTAL, 0.0))

"""The router's scrape of its workers' ``/metrics``, as production-stack's engine stats scraper does.

Every ``interval_s`` (production-stack's ``--engine-stats-interval`` default) each worker's page is read and its
``vllm:prefix_cache_{hits,queries}_total`` handed to the router's metrics, which expose them per worker as
production-stack's ``vllm:gpu_prefix_cache_*`` gauges. A worker that does not answer in ``timeout_s`` has its
last values forgotten (its gauges disappear until it answers again).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import aiohttp

from splitserve.metrics import (
    PREFIX_CACHE_HITS_TOTAL,
    PREFIX_CACHE_QUERIES_TOTAL,
    PrefixCacheCounts,
    RouterMetrics,
    sum_samples,
)

if TYPE_CHECKING:
    from splitserve.router.discovery import Worker

logger = logging.getLogger(__name__)

SCRAPE_INTERVAL_S = 30.0
MAX_PAGE_BYTES = 4 << 20  # a worker's metrics page is a few tens of KiB


class WorkerStatsScraper:
    """Reads every worker's ``/metrics`` each ``interval_s`` into ``metrics`` (the router's)."""

    def __init__(
        self,
        workers: Callable[[], Iterable[Worker]],
        session: Callable[[], aiohttp.ClientSession],
        metrics: RouterMetrics,
        *,
        interval_s: float = SCRAPE_INTERVAL_S,
        timeout_s: float = 2.0,
    ) -> None:
        self._workers = workers
        self._session = session
        self.metrics = metrics
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
            self.metrics.set_prefix_cache(worker.url, prefix_cache_counts(page) if page is not None else None)

    async def _page(self, url: str) -> str | None:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with self._session().get(f"{url}/metrics", timeout=timeout) as response:
                if response.status != 200:
                    return None
                body = await response.content.read(MAX_PAGE_BYTES)
        except (aiohttp.ClientError, TimeoutError) as exc:
            logger.debug("scraping %s/metrics failed: %s", url, exc)
            return None
        return body.decode("utf-8", "replace")


def prefix_cache_counts(page: str) -> PrefixCacheCounts | None:
    """A worker's prefix-cache counters from its metrics page; None when the page does not parse."""
    try:
        return PrefixCacheCounts(
            sum_samples(page, PREFIX_CACHE_HITS_TOTAL), sum_samples(page, PREFIX_CACHE_QUERIES_TOTAL)
        )
    except ValueError:  # not a Prometheus text page
        return None

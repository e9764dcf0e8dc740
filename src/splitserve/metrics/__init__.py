"""Every Prometheus metric splitserve exposes: names (``names``), the worker's (``worker``), the router's
(``router``), and a reader of ``/metrics`` pages (:func:`sum_samples`). ``docs/metrics.md`` documents each.

Names follow vLLM 0.32's (``vllm:*``), LMCache's (``lmcache:*``) and production-stack's router's, with their
meanings, so existing dashboards work unchanged; ``splitserve:*`` ones are our own.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from splitserve.metrics.names import *  # noqa: F403 -- every name, label and bucket edge, as splitserve.metrics.X
from splitserve.metrics.router import HostUsage, PrefixCacheCounts, RouterMetrics, RouterStateLike, WorkerRow
from splitserve.metrics.stats import (
    CumulativeHistogram,
    EngineStatsLike,
    FinishedRequest,
    KVCacheStatsLike,
    PDBufferStatsLike,
    RequestPhases,
    TierStatsLike,
)
from splitserve.metrics.worker import WorkerMetrics

__all__ = [
    "CumulativeHistogram",
    "EngineStatsLike",
    "FinishedRequest",
    "HostUsage",
    "KVCacheStatsLike",
    "PDBufferStatsLike",
    "PrefixCacheCounts",
    "RequestPhases",
    "RouterMetrics",
    "RouterStateLike",
    "TierStatsLike",
    "WorkerMetrics",
    "WorkerRow",
    "histogram_buckets",
    "sample_totals",
    "sum_samples",
]


def sample_totals(text: str) -> dict[str, float]:
    """Every sample name of a Prometheus text page with the sum of its samples over all labels, from one parse
    (``ValueError`` when the text is not such a page)."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def histogram_buckets(text: str, name: str) -> dict[float, float]:
    """Histogram ``name``'s cumulative counts by upper bound (``le``), summed over its other labels, from a
    Prometheus text page."""
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_bucket" and "le" in sample.labels:
                bound = float(sample.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
    return buckets


def sum_samples(text: str, name: str, **labels: str) -> float:
    """The sum of every sample named exactly ``name`` whose labels include ``labels``, in a Prometheus text page.

    ``name`` is the sample's full name: ``..._total`` for a counter, ``..._sum`` or ``..._count`` of a histogram.
    Every reader of ``/metrics`` (supervisor, benchmarks, the router's scrape) goes through here, never through
    substring matches.
    """
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )

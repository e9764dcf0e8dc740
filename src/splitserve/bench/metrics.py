"""Summary statistics of a benchmark run: throughput and TTFT / TPOT / ITL / E2E latency percentiles."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from splitserve.bench.client import RequestResult

PERCENTILES: tuple[int, ...] = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default).

    Returns NaN for an empty sequence.
    """
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Mean and percentiles of one latency, in milliseconds; NaN when there were no samples."""

    count: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float

    @classmethod
    def from_seconds(cls, values_s: Sequence[float]) -> LatencyStats:
        values_ms = [v * 1000.0 for v in values_s]
        mean_ms = sum(values_ms) / len(values_ms) if values_ms else math.nan
        p50, p90, p99 = (percentile(values_ms, q) for q in PERCENTILES)
        return cls(len(values_ms), mean_ms, p50, p90, p99)


@dataclass(frozen=True, slots=True)
class BenchSummary:
    """Totals over successful requests; throughputs are per second of the run's wall-clock duration.

    ``ttft_by_round`` maps a round index to the TTFT of that round's session requests (empty when no request
    has a session): later rounds of a conversation should be faster when the prefix cache hits.
    """

    num_completed: int
    num_failed: int
    duration_s: float
    total_prompt_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats
    ttft_by_round: dict[int, LatencyStats] = field(default_factory=dict)


def summarize(results: Sequence[RequestResult], duration_s: float) -> BenchSummary:
    """Summarize ``results``: failed requests count only in ``num_failed``.

    ITL pools the chunk gaps of all requests; TPOT has one value per request with at least two output
    tokens.
    """
    ok = [r for r in results if r.success]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = 1.0 / duration_s if duration_s > 0 else math.nan
    return BenchSummary(
        num_completed=len(ok),
        num_failed=len(results) - len(ok),
        duration_s=duration_s,
        total_prompt_tokens=prompt_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) * per_s,
        output_throughput=output_tokens * per_s,
        total_token_throughput=(prompt_tokens + output_tokens) * per_s,
        ttft=LatencyStats.from_seconds([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot=LatencyStats.from_seconds([t for r in ok if (t := r.tpot_s) is not None]),
        itl=LatencyStats.from_seconds([gap for r in ok for gap in r.itl_s]),
        e2e=LatencyStats.from_seconds([r.e2e_s for r in ok]),
        ttft_by_round=_ttft_by_round(ok),
    )


def _ttft_by_round(ok: Sequence[RequestResult]) -> dict[int, LatencyStats]:
    ttfts_s: dict[int, list[float]] = {}
    for r in ok:
        if r.session_id is not None and r.ttft_s is not None:
            ttfts_s.setdefault(r.round_index, []).append(r.ttft_s)
    return {index: LatencyStats.from_seconds(ttfts_s[index]) for index in sorted(ttfts_s)}


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency limits one request must meet to count towards goodput (seconds)."""

    ttft_s: float
    """The request's time to first token."""
    itl_s: float
    """The 99th percentile of the request's own chunk gaps."""

    def validate(self) -> None:
        if not (self.ttft_s > 0 and self.itl_s > 0):
            raise ValueError(f"SLO limits must be > 0, got ttft_s={self.ttft_s}, itl_s={self.itl_s}")


def meets_slo(result: RequestResult, slo: Slo) -> bool:
    """Whether ``result`` succeeded with TTFT and its own ITL p99 within ``slo`` (no gaps: TTFT alone decides).

    The planner's simulator judges its predicted requests the same way.
    """
    if not result.success or result.ttft_s is None:
        return False
    return result.ttft_s <= slo.ttft_s and (not result.itl_s or percentile(result.itl_s, 99) <= slo.itl_s)

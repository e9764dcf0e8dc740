"""The series that bench plots draw, as plain functions of per-request results (no matplotlib here).

Times are seconds from the start of the run, as ``RequestResult.start_s`` is. A request's chunk arrival
times are derived from its timings (start + TTFT, then each ITL gap), so results need no extra field and
older JSON results re-plot as well.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from splitserve.bench.client import RequestResult
from splitserve.bench.metrics import BenchSummary, Slo, meets_slo

DEFAULT_NUM_BINS = 50
_NICE_STEPS = (1.0, 2.0, 5.0, 10.0)


def cdf_points(values: Iterable[float]) -> tuple[list[float], list[float]]:
    """The empirical CDF: ``values`` sorted, and for the i-th of n (0-based) the fraction ``(i + 1) / n``.

    Drawn as a step function (``where="post"``); both lists are empty for no values.
    """
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def chunk_times_s(result: RequestResult) -> list[float]:
    """When each content chunk of ``result`` arrived: ``start_s + ttft_s``, then each ITL gap added in turn.

    Empty when no chunk arrived (``ttft_s`` is None).
    """
    if result.ttft_s is None:
        return []
    times = [result.start_s + result.ttft_s]
    for gap_s in result.itl_s:
        times.append(times[-1] + gap_s)
    return times


def in_flight_over_time(results: Iterable[RequestResult]) -> tuple[list[float], list[int]]:
    """Requests in flight as a step function: from ``times_s[i]`` until the next time there are ``counts[i]``.

    A request, failed or not, is in flight over ``[start_s, start_s + e2e_s)``: where one ends as another
    starts they do not overlap. The series starts at ``(0.0, 0)`` unless a request starts at 0, and ends with
    0 at the last request's end.
    """
    events = sorted((t, delta) for r in results for t, delta in ((r.start_s, 1), (r.start_s + r.e2e_s, -1)))
    times_s, counts = [0.0], [0]
    for t, delta in events:  # the events at one time merge into one step: no blip where one ends as one starts
        count = counts[-1] + delta
        if t == times_s[-1]:
            counts[-1] = count
        else:
            times_s.append(t)
            counts.append(count)
    return times_s, counts


def throughput_over_time(results: Iterable[RequestResult], bin_s: float) -> tuple[list[float], list[float]]:
    """Output tokens per second in consecutive ``bin_s``-second bins from 0: (bin start times, tokens/s).

    Successful requests only, as in the summary's output throughput; each chunk of a request carries
    ``output_tokens / number of chunks`` tokens (a chunk may hold several). The bins run up to the one that
    holds the last chunk; no chunks give two empty lists.
    """
    if not bin_s > 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s}")
    tokens_by_bin: list[float] = []
    for result in results:
        times_s = chunk_times_s(result) if result.success else []
        for t in times_s:
            index = int(t // bin_s)
            tokens_by_bin += [0.0] * (index + 1 - len(tokens_by_bin))
            tokens_by_bin[index] += result.output_tokens / len(times_s)
    return [i * bin_s for i in range(len(tokens_by_bin))], [tokens / bin_s for tokens in tokens_by_bin]


def default_bin_s(span_s: float, num_bins: int = DEFAULT_NUM_BINS) -> float:
    """A 1-2-5 bin width (1 ms at least) that splits ``span_s`` seconds into about ``num_bins`` bins."""
    raw_s = max(span_s / num_bins, 1e-3)
    magnitude = 10.0 ** math.floor(math.log10(raw_s))
    return next(step * magnitude for step in _NICE_STEPS if raw_s <= step * magnitude * (1 + 1e-9))


def run_span_s(results: Iterable[RequestResult]) -> float:
    """Seconds from the run's start to the end of its last request (0 for none)."""
    return max((r.start_s + r.e2e_s for r in results), default=0.0)


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One endpoint at one offered request rate, as a rate-sweep plot draws it. Latencies are in ms, NaN when
    no request completed; rates are per second of the run's wall-clock duration."""

    endpoint: str
    """The line this point belongs to (e.g. ``colocated``, ``dpd``)."""
    request_rate: float
    """Offered Poisson arrival rate, requests/s."""
    num_completed: int
    num_failed: int
    num_good: int
    """Completed requests that met the SLO (see ``metrics.meets_slo``)."""
    duration_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p99_ms: float
    """Over the chunk gaps of all completed requests pooled."""
    output_throughput: float
    """Output tokens/s."""
    request_throughput: float
    """Completed requests/s."""
    goodput: float
    """Requests/s that met the SLO: ``num_good / duration_s``."""
    result_path: str | None = None
    """The point's full result JSON, when one was written."""

    @property
    def slo_attainment(self) -> float:
        """Share of the sent requests (failed ones included) that met the SLO; NaN for none."""
        num_sent = self.num_completed + self.num_failed
        return self.num_good / num_sent if num_sent else math.nan


def sweep_point(
    endpoint: str,
    request_rate: float,
    summary: BenchSummary,
    results: Sequence[RequestResult],
    slo: Slo,
    *,
    result_path: str | None = None,
) -> SweepPoint:
    """The sweep point of one run: its summary's figures plus goodput under ``slo`` from ``results``."""
    num_good = sum(meets_slo(r, slo) for r in results)
    return SweepPoint(
        endpoint=endpoint,
        request_rate=request_rate,
        num_completed=summary.num_completed,
        num_failed=summary.num_failed,
        num_good=num_good,
        duration_s=summary.duration_s,
        ttft_p50_ms=summary.ttft.p50_ms,
        ttft_p99_ms=summary.ttft.p99_ms,
        itl_p99_ms=summary.itl.p99_ms,
        output_throughput=summary.output_throughput,
        request_throughput=summary.request_throughput,
        goodput=num_good / summary.duration_s if summary.duration_s > 0 else math.nan,
        result_path=result_path,
    )


def by_endpoint(points: Iterable[SweepPoint]) -> dict[str, list[SweepPoint]]:
    """``points`` grouped into one line per endpoint (in order of first appearance), each sorted by rate."""
    lines: dict[str, list[SweepPoint]] = {}
    for point in points:
        lines.setdefault(point.endpoint, []).append(point)
    return {name: sorted(line, key=lambda p: p.request_rate) for name, line in lines.items()}

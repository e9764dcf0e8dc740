"""Benchmark reports: the stdout table, the JSON result file, and PNG plots comparing several results.

matplotlib is an optional dependency (``pip install 'splitserve[plot]'``), imported only by
``plot_results``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import splitserve
from splitserve.bench.client import RequestResult
from splitserve.bench.metrics import PERCENTILES, BenchSummary, LatencyStats

if TYPE_CHECKING:
    from splitserve.bench.runner import ServeConfig

LATENCY_METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2e")
_MAX_ERRORS_SHOWN = 5


class PlotKind(StrEnum):
    CDF = "cdf"
    """One line per result: the cumulative distribution of the metric over requests (chunk gaps for itl)."""
    BAR = "bar"
    """Grouped bars per result: the metric's mean, p50, p90 and p99 from the summary."""


@dataclass(frozen=True)
class BenchReport:
    """One finished run: its configuration, summary and per-request results."""

    config: ServeConfig
    summary: BenchSummary
    results: list[RequestResult]
    started_at: str
    """UTC start time, ISO 8601."""


def format_table(report: BenchReport) -> str:
    """The human-readable result: totals, throughput, then latency mean and percentiles in ms."""
    s = report.summary
    rows = [
        ("Label", report.config.label or "-"),
        ("Successful requests", f"{s.num_completed}"),
        ("Failed requests", f"{s.num_failed}"),
        ("Benchmark duration (s)", f"{s.duration_s:.2f}"),
        ("Total input tokens", f"{s.total_prompt_tokens}"),
        ("Total generated tokens", f"{s.total_output_tokens}"),
        ("Request throughput (req/s)", f"{s.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{s.output_throughput:.2f}"),
        ("Total token throughput (tok/s)", f"{s.total_token_throughput:.2f}"),
    ]
    lines = [" Serving Benchmark Result ".center(60, "=")]
    lines += [f"{name + ':':<40}{value:>20}" for name, value in rows]
    lines.append(f"{'Latency (ms)':<12}{'mean':>12}" + "".join(f"{'p' + str(q):>12}" for q in PERCENTILES))
    for name in LATENCY_METRICS:
        stats: LatencyStats = getattr(s, name)
        values = (stats.mean_ms, stats.p50_ms, stats.p90_ms, stats.p99_ms)
        lines.append(f"{name.upper():<12}" + "".join(f"{v:>12.2f}" for v in values))
    lines += _round_lines(s.ttft_by_round)
    lines += _error_lines(report.results)
    lines.append("=" * 60)
    return "\n".join(lines)


def _round_lines(ttft_by_round: dict[int, LatencyStats]) -> list[str]:
    """TTFT mean and p50 per session round (rounds are 0-based); nothing for runs without sessions."""
    if not ttft_by_round:
        return []
    lines = [f"{'TTFT by round (ms)':<24}{'count':>12}{'mean':>12}{'p50':>12}"]
    for index, stats in ttft_by_round.items():
        lines.append(f"{'  round ' + str(index):<24}{stats.count:>12}{stats.mean_ms:>12.2f}{stats.p50_ms:>12.2f}")
    return lines


def _error_lines(results: Sequence[RequestResult]) -> list[str]:
    errors = Counter(r.error for r in results if not r.success)
    if not errors:
        return []
    lines = ["Errors (count, message):"]
    lines += [f"{count:>6}  {message}" for count, message in _most_common(errors)]
    if len(errors) > _MAX_ERRORS_SHOWN:
        lines.append(f"        ... and {len(errors) - _MAX_ERRORS_SHOWN} other messages")
    return lines


def _most_common(errors: Counter[str]) -> list[tuple[int, str]]:
    return [(count, message) for message, count in errors.most_common(_MAX_ERRORS_SHOWN)]


def report_to_json(report: BenchReport) -> dict[str, Any]:
    """The JSON document: label, version, start time, arguments, summary and one record per request.

    NaN statistics (no samples) become ``null``; an API key is redacted.
    """
    requests = [dataclasses.asdict(r) | {"tpot_s": r.tpot_s} for r in report.results]
    args = dataclasses.asdict(report.config)
    if args["api_key"]:
        args["api_key"] = "<redacted>"  # result files get shared; keys must not travel with them
    document: dict[str, Any] = {
        "label": report.config.label,
        "splitserve_version": splitserve.__version__,
        "started_at": report.started_at,
        "args": args,
        "summary": dataclasses.asdict(report.summary),
        "requests": requests,
    }
    safe: dict[str, Any] = _json_safe(document)
    return safe


def write_json(report: BenchReport, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report_to_json(report), indent=1, allow_nan=False) + "\n", encoding="utf-8")


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)  # request_rate=inf is stored as "inf"
    if isinstance(value, Path):
        return str(value)
    return value


def load_json(path: Path) -> dict[str, Any]:
    """Read a result written by ``write_json``."""
    document = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(document, dict) or "summary" not in document:
        raise ValueError(f"{path} is not a splitserve bench result (no 'summary')")
    return document


def _label(document: dict[str, Any], path: Path) -> str:
    return str(document.get("label") or path.stem)


def request_values_ms(document: dict[str, Any], metric: str) -> list[float]:
    """Values of ``metric`` over successful requests, in ms (ttft, tpot, e2e; itl: every chunk gap)."""
    if metric not in LATENCY_METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose one of: {', '.join(LATENCY_METRICS)}")
    ok = [r for r in document["requests"] if r["success"]]
    if metric == "itl":
        return [gap * 1000.0 for r in ok for gap in r["itl_s"]]
    return [r[f"{metric}_s"] * 1000.0 for r in ok if r.get(f"{metric}_s") is not None]


def plot_results(paths: Sequence[Path], out: Path, *, metric: str = "ttft", kind: PlotKind = PlotKind.CDF) -> None:
    """Draw ``metric`` for each JSON result in ``paths`` into the PNG ``out``, labelled by each label."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("plotting needs matplotlib: pip install 'splitserve[plot]'") from exc
    documents = [(load_json(p), p) for p in paths]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    if kind is PlotKind.CDF:
        _draw_cdf(ax, documents, metric)
    else:
        _draw_bars(ax, documents, metric)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def _draw_cdf(ax: Any, documents: list[tuple[dict[str, Any], Path]], metric: str) -> None:
    for document, path in documents:
        values = sorted(request_values_ms(document, metric))
        fractions = [(i + 1) / len(values) for i in range(len(values))]
        ax.step(values, fractions, where="post", label=_label(document, path))
    ax.set_xlabel(f"{metric.upper()} (ms)")
    ax.set_ylabel("fraction of requests" if metric != "itl" else "fraction of chunk gaps")
    ax.set_title(f"{metric.upper()} CDF")


def _draw_bars(ax: Any, documents: list[tuple[dict[str, Any], Path]], metric: str) -> None:
    if metric not in LATENCY_METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose one of: {', '.join(LATENCY_METRICS)}")
    stat_names = ["mean_ms"] + [f"p{q}_ms" for q in PERCENTILES]
    width = 0.8 / len(documents)
    for i, (document, path) in enumerate(documents):
        stats = document["summary"][metric]
        heights = [stats[name] if stats[name] is not None else 0.0 for name in stat_names]
        positions = [x + i * width for x in range(len(stat_names))]
        ax.bar(positions, heights, width=width, label=_label(document, path))
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(stat_names))])
    ax.set_xticklabels([name.removesuffix("_ms") for name in stat_names])
    ax.set_ylabel(f"{metric.upper()} (ms)")
    ax.set_title(f"{metric.upper()} by statistic")

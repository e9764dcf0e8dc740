"""Benchmark reports: the stdout table and the JSON result file (written, read back, and turned into values to
plot; the plots themselves are in ``plots``)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import splitserve
from splitserve.bench.client import RequestResult
from splitserve.bench.metrics import PERCENTILES, BenchSummary, LatencyStats

if TYPE_CHECKING:
    from splitserve.bench.runner import ServeConfig

LATENCY_METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2e")
_MAX_ERRORS_SHOWN = 5


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
    document: dict[str, Any] = {
        "label": report.config.label,
        "splitserve_version": splitserve.__version__,
        "started_at": report.started_at,
        "args": config_to_json(report.config),
        "summary": dataclasses.asdict(report.summary),
        "requests": requests,
    }
    safe: dict[str, Any] = _json_safe(document)
    return safe


def config_to_json(config: ServeConfig) -> dict[str, Any]:
    """The run's arguments as JSON-safe values, with an API key redacted."""
    args = dataclasses.asdict(config)
    if args["api_key"]:
        args["api_key"] = "<redacted>"  # result files get shared; keys must not travel with them
    safe: dict[str, Any] = _json_safe(args)
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


def results_from_json(document: dict[str, Any]) -> list[RequestResult]:
    """The per-request results of a loaded JSON result; fields a result file lacks (older versions) take
    their defaults and extra ones (``tpot_s``) are dropped."""
    names = {f.name for f in dataclasses.fields(RequestResult)}
    return [RequestResult(**{k: v for k, v in record.items() if k in names}) for record in document["requests"]]


def result_label(document: dict[str, Any], path: Path) -> str:
    """The result's label, or its file name without the suffix."""
    return str(document.get("label") or path.stem)


def request_values_ms(document: dict[str, Any], metric: str) -> list[float]:
    """Values of ``metric`` over successful requests, in ms (ttft, tpot, e2e; itl: every chunk gap)."""
    if metric not in LATENCY_METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose one of: {', '.join(LATENCY_METRICS)}")
    ok = [r for r in document["requests"] if r["success"]]
    if metric == "itl":
        return [gap * 1000.0 for r in ok for gap in r["itl_s"]]
    return [r[f"{metric}_s"] * 1000.0 for r in ok if r.get(f"{metric}_s") is not None]

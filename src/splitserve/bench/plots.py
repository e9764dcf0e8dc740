"""PNG plots of bench results: CDFs and bars comparing runs, one run's timeline, and rate sweeps.

The one module that imports matplotlib (an optional dependency: ``pip install 'splitserve[plot]'``), and only
when it draws, with the Agg backend (no display). The values it draws come from ``series``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any

from splitserve.bench.client import RequestResult
from splitserve.bench.metrics import PERCENTILES, Slo
from splitserve.bench.report import LATENCY_METRICS, load_json, request_values_ms, result_label, results_from_json
from splitserve.bench.series import (
    SweepPoint,
    by_endpoint,
    cdf_points,
    default_bin_s,
    in_flight_over_time,
    run_span_s,
    throughput_over_time,
)
from splitserve.bench.sweep import load_sweep


class PlotKind(StrEnum):
    CDF = "cdf"
    """One line per result: the cumulative distribution of the metric over requests (chunk gaps for itl)."""
    BAR = "bar"
    """Grouped bars per result: the metric's mean, p50, p90 and p99 from the summary."""
    TIMELINE = "timeline"
    """Four panels, one line per result: TTFT CDF, ITL CDF, output tokens/s and requests in flight over time."""
    SWEEP = "sweep"
    """One sweep summary (``bench sweep --json-dir``): TTFT p50/p99, ITL p99, goodput and output tokens/s
    against the offered rate, one line per endpoint."""


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend; RuntimeError naming the extra to install when it is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("plotting needs matplotlib: pip install 'splitserve[plot]'") from exc
    return plt


def plot_results(paths: Sequence[Path], out: Path, *, metric: str = "ttft", kind: PlotKind = PlotKind.CDF) -> None:
    """Draw the JSON files in ``paths`` into the PNG ``out`` as ``kind`` says; ``metric`` is for cdf and bar.

    cdf, bar and timeline take ``bench serve --json`` results (one line or bar group per result, named by its
    label); sweep takes exactly one ``sweep.json`` summary.
    """
    if kind is PlotKind.SWEEP:
        if len(paths) != 1:
            raise ValueError(f"--kind sweep draws one sweep summary, got {len(paths)} files")
        points, slo = load_sweep(paths[0])
        plot_sweep(points, out, slo=slo)
        return
    documents = _load_labelled(paths)
    if kind is PlotKind.TIMELINE:
        plot_timeline({label: results_from_json(document) for label, document in documents.items()}, out)
        return
    if metric not in LATENCY_METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose one of: {', '.join(LATENCY_METRICS)}")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    if kind is PlotKind.CDF:
        values = {label: request_values_ms(document, metric) for label, document in documents.items()}
        fractions_of = "chunk gaps" if metric == "itl" else "requests"
        draw_cdfs(ax, values, xlabel=f"{metric.upper()} (ms)", ylabel=f"fraction of {fractions_of}")
        ax.set_title(f"{metric.upper()} CDF")
    else:
        _draw_bars(ax, documents, metric)
    _save(plt, fig, out)


def plot_cdf(values_by_label: Mapping[str, Sequence[float]], out: Path, *, xlabel: str, title: str = "") -> None:
    """One PNG with the empirical CDF of each label's values (e.g. predicted against measured TTFTs in ms)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    draw_cdfs(ax, values_by_label, xlabel=xlabel)
    ax.set_title(title)
    _save(plt, fig, out)


def draw_cdfs(
    ax: Any, values_by_label: Mapping[str, Sequence[float]], *, xlabel: str, ylabel: str = "fraction"
) -> None:
    """One step line per label on the matplotlib axes ``ax``."""
    for label, values in values_by_label.items():
        xs, fractions = cdf_points(values)
        ax.step(xs, fractions, where="post", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0.0, 1.02)


def plot_timeline(
    runs: Mapping[str, Sequence[RequestResult]], out: Path, *, title: str = "", bin_s: float | None = None
) -> None:
    """Four panels, one line per labelled run: TTFT CDF (ms), ITL CDF (ms, every chunk gap), output tokens/s
    in ``bin_s`` bins (default: about 50 bins over the longest run) and requests in flight, against seconds
    since each run's start."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), dpi=120)
    (ttft_ax, itl_ax), (throughput_ax, in_flight_ax) = axes
    ok = {label: [r for r in results if r.success] for label, results in runs.items()}
    ttfts_ms = {label: [r.ttft_s * 1000.0 for r in rs if r.ttft_s is not None] for label, rs in ok.items()}
    draw_cdfs(ttft_ax, ttfts_ms, xlabel="TTFT (ms)", ylabel="fraction of requests")
    ttft_ax.set_title("Time to first token")
    itls_ms = {label: [gap * 1000.0 for r in rs for gap in r.itl_s] for label, rs in ok.items()}
    draw_cdfs(itl_ax, itls_ms, xlabel="ITL (ms)", ylabel="fraction of chunk gaps")
    itl_ax.set_title("Inter-token latency")
    bin_s = bin_s or default_bin_s(max((run_span_s(rs) for rs in runs.values()), default=0.0))
    for label, results in runs.items():
        starts_s, tokens_per_s = throughput_over_time(results, bin_s)
        if starts_s:
            throughput_ax.stairs(tokens_per_s, [*starts_s, starts_s[-1] + bin_s], label=label)
        times_s, counts = in_flight_over_time(results)
        in_flight_ax.step(times_s, counts, where="post", label=label)
    throughput_ax.set(title=f"Output throughput ({bin_s:g} s bins)", xlabel="time (s)", ylabel="tokens/s")
    in_flight_ax.set(title="Requests in flight", xlabel="time (s)", ylabel="requests")
    fig.suptitle(title)
    _save(plt, fig, out)


def plot_sweep(points: Sequence[SweepPoint], out: Path, *, slo: Slo | None = None, title: str = "") -> None:
    """Four panels against the offered rate, one colour per endpoint: TTFT p99 (solid) and p50 (dashed), ITL
    p99, goodput (with the offered rate dotted: the most it can be) and output tokens/s. The SLO limits, when
    given, are dotted lines on the latency panels."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), dpi=120)
    (ttft_ax, itl_ax), (goodput_ax, throughput_ax) = axes
    for i, (name, line) in enumerate(by_endpoint(points).items()):
        rates = [p.request_rate for p in line]
        style = {"color": f"C{i}", "marker": "o"}
        ttft_ax.plot(rates, [p.ttft_p99_ms for p in line], label=f"{name} p99", **style)
        ttft_ax.plot(rates, [p.ttft_p50_ms for p in line], label=f"{name} p50", linestyle="--", **style)
        itl_ax.plot(rates, [p.itl_p99_ms for p in line], label=name, **style)
        goodput_ax.plot(rates, [p.goodput for p in line], label=name, **style)
        throughput_ax.plot(rates, [p.output_throughput for p in line], label=name, **style)
    all_rates = sorted({p.request_rate for p in points})
    goodput_ax.plot(all_rates, all_rates, color="grey", linestyle=":", label="offered")
    if slo is not None:
        ttft_ax.axhline(slo.ttft_s * 1000.0, color="grey", linestyle=":", label="SLO")
        itl_ax.axhline(slo.itl_s * 1000.0, color="grey", linestyle=":", label="SLO")
    ttft_ax.set(title="TTFT", ylabel="ms")
    itl_ax.set(title="ITL p99", ylabel="ms")
    goodput_ax.set(title="Goodput (requests within the SLO)", ylabel="requests/s")
    throughput_ax.set(title="Output throughput", ylabel="tokens/s")
    for ax in axes.flat:
        ax.set_xlabel("offered rate (requests/s)")
    fig.suptitle(title)
    _save(plt, fig, out)


def _load_labelled(paths: Sequence[Path]) -> dict[str, dict[str, Any]]:
    """Each result by its label; a label already taken gets the file's name added."""
    documents: dict[str, dict[str, Any]] = {}
    for path in paths:
        document = load_json(path)
        label = result_label(document, path)
        documents[f"{label} ({path.name})" if label in documents else label] = document
    return documents


def _draw_bars(ax: Any, documents: Mapping[str, dict[str, Any]], metric: str) -> None:
    stat_names = ["mean_ms"] + [f"p{q}_ms" for q in PERCENTILES]
    width = 0.8 / len(documents)
    for i, (label, document) in enumerate(documents.items()):
        stats = document["summary"][metric]
        heights = [stats[name] if stats[name] is not None else 0.0 for name in stat_names]
        positions = [x + i * width for x in range(len(stat_names))]
        ax.bar(positions, heights, width=width, label=label)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(stat_names))])
    ax.set_xticklabels([name.removesuffix("_ms") for name in stat_names])
    ax.set_ylabel(f"{metric.upper()} (ms)")
    ax.set_title(f"{metric.upper()} by statistic")


def _save(plt: Any, fig: Any, out: Path) -> None:
    """Grid and legend on every panel, then write ``out`` (creating its folder) and free the figure."""
    for ax in fig.axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)

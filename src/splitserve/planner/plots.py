"""The planner's plots (matplotlib with the Agg backend, the ``plot`` extra, through ``bench.plots``).

- :func:`plot_plan` (``splitserve plan --plot``): without ``--verify``, the best candidates' predicted goodput
  and TTFT p99; with it, predicted against measured: TTFT and ITL distributions of each verified layout (the
  simulation dashed, the replay solid) and each figure's predicted / measured ratio against the 25 % band.
- :func:`plot_crossover` (``--sweep-rates``): each layout family's predicted goodput and TTFT p99 against the
  request rate, which shows where disaggregation starts to pay off.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from splitserve.bench.plots import pyplot
from splitserve.bench.series import cdf_points
from splitserve.planner.simulate import SimResult
from splitserve.planner.verify import FIGURES, VerifiedLayout

if TYPE_CHECKING:
    from splitserve.planner.recommend import Layout, Recommendation

TOP_CANDIDATES = 10
_FIGURE_NAMES = {"ttft_p50_s": "TTFT p50", "ttft_p99_s": "TTFT p99", "itl_p99_s": "ITL p99",
                 "output_tokens_per_s": "output tok/s"}  # fmt: skip


def plot_plan(
    path: Path,
    recommendation: Recommendation,
    verified: Sequence[VerifiedLayout],
    simulate_layout: Callable[[Layout], SimResult],
) -> None:
    plt = pyplot()
    if not verified:
        figure = _plot_candidates(plt, recommendation)
    else:
        by_label = {"pick": recommendation.pick, "current": recommendation.current}
        simulated = {}
        for layout in verified:
            candidate = by_label.get(layout.label)
            if candidate is not None:
                simulated[layout.label] = simulate_layout(candidate.layout)
        figure = _plot_verified(plt, verified, simulated)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _plot_candidates(plt: Any, recommendation: Recommendation) -> Any:
    candidates = recommendation.candidates[:TOP_CANDIDATES]
    names = [c.layout.describe() + (" (current)" if c.layout.is_current else "") for c in candidates]
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 0.45 * len(names) + 1.8), sharey=True)
    ys = list(range(len(names)))[::-1]
    left.barh(ys, [c.prediction.goodput_requests_per_s for c in candidates], color="tab:blue")
    left.set_yticks(ys, names, fontsize=8)
    left.set_xlabel("predicted goodput (req/s within the SLO)")
    right.barh(ys, [c.prediction.ttft_p99_s for c in candidates], color="tab:orange")
    right.set_xlabel("predicted TTFT p99 (s)")
    figure.suptitle(f"splitserve plan: the best {len(names)} candidates (pick on top)")
    return figure


def _plot_verified(plt: Any, verified: Sequence[VerifiedLayout], simulated: dict[str, SimResult]) -> Any:
    figure, (ttft_ax, itl_ax, ratio_ax) = plt.subplots(1, 3, figsize=(16, 4.8))
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    for color, layout in zip(colors, verified, strict=False):
        ok = [r for r in layout.replay.results if r.success and r.ttft_s is not None]
        name = f"{layout.label}: {layout.description}"
        ttft_ax.plot(*cdf_points([r.ttft_s or 0.0 for r in ok]), color=color, label=f"{name}, replay")
        itl_ax.plot(*cdf_points([g * 1000 for r in ok for g in r.itl_s]), color=color, label=f"{layout.label}, replay")
        sim = simulated.get(layout.label)
        if sim is not None:
            timings = [t for t in sim.timings if t.token_times_s]
            ttft_ax.plot(*cdf_points([t.ttft_s for t in timings]), color=color, linestyle="--",
                         label=f"{layout.label}, predicted")  # fmt: skip
            itl_ax.plot(*cdf_points([g * 1000 for t in timings for g in t.itls_s]), color=color, linestyle="--",
                        label=f"{layout.label}, predicted")  # fmt: skip
    ttft_ax.set_xlabel("TTFT (s)")
    ttft_ax.set_ylabel("share of requests")
    ttft_ax.set_title("time to first token")
    itl_ax.set_xlabel("inter-token latency (ms)")
    itl_ax.set_xscale("log")
    itl_ax.set_title("inter-token latency (all gaps)")
    width, top = 0.8 / len(verified), 2.0
    for i, (color, layout) in enumerate(zip(colors, verified, strict=False)):
        ratios = [getattr(layout.predicted, f) / max(getattr(layout.replay.measured, f), 1e-12) for f in FIGURES]
        xs = [j + i * width for j in range(len(FIGURES))]
        ratio_ax.bar(xs, [min(r, top) for r in ratios], width, color=color, label=layout.label)
        for x, ratio in zip(xs, ratios, strict=True):  # the value itself: a bar past the top is cut there
            ratio_ax.text(x, min(ratio, top) + 0.02, f"{ratio:.2f}", ha="center", va="bottom", fontsize=7)
    ratio_ax.axhspan(0.75, 1.25, color="0.9", zorder=0, label="within 25 %")
    ratio_ax.axhline(1.0, color="0.4", linewidth=0.8)
    ratio_ax.set_xticks([j + 0.4 - width / 2 for j in range(len(FIGURES))], [_FIGURE_NAMES[f] for f in FIGURES])
    ratio_ax.set_ylim(0, top + 0.15)
    ratio_ax.set_ylabel("predicted / measured")
    ratio_ax.set_title("each figure, predicted against the replay")
    for ax in (ttft_ax, itl_ax, ratio_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return figure


def plot_crossover(
    path: Path,
    title: str,
    xs: Sequence[float],
    series: dict[str, list[dict[str, float]]],
    *,
    xlabel: str = "request rate (req/s)",
    diagonal: bool = True,
) -> None:
    """``series``: per layout family (``colocated x2``, ``1P1D``, ...), one point per x (a rate or a prompt
    length) with ``goodput`` and ``ttft_p99_s`` (NaN where the family has no candidate). ``diagonal`` draws the
    offered rate on the goodput panel (x is the rate)."""
    plt = pyplot()
    figure, (good_ax, ttft_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, points in series.items():
        good_ax.plot(xs, [p["goodput"] for p in points], marker="o", label=name)
        ttft_ax.plot(xs, [p["ttft_p99_s"] for p in points], marker="o", label=name)
    if diagonal:
        good_ax.plot(xs, xs, color="0.6", linestyle=":", label="offered rate")
    good_ax.set_xlabel(xlabel)
    good_ax.set_ylabel("predicted goodput (req/s within the SLO)")
    ttft_ax.set_xlabel(xlabel)
    ttft_ax.set_ylabel("predicted TTFT p99 (s)")
    ttft_ax.set_yscale("log")
    for ax in (good_ax, ttft_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)

"""``splitserve bench``: thin typer commands that build a config and call ``serve``, ``run_sweep`` or a plot.

Nothing here (or below) imports torch, so the benchmark starts in well under a second.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from splitserve.bench.datasets import DatasetConfig, default_num_prompts
from splitserve.bench.plots import PlotKind, plot_results, plot_sweep, plot_timeline, pyplot
from splitserve.bench.report import LATENCY_METRICS
from splitserve.bench.runner import DATASET_PANEL, ServeConfig, serve
from splitserve.bench.sweep import SweepConfig, parse_endpoint, parse_rates, parse_slo, run_sweep
from splitserve.options import settings_command
from splitserve.settings import REQUIRED, Section, build, setting

bench_app = typer.Typer(
    help="Benchmark any OpenAI-compatible endpoint (a worker, the router, vLLM) and plot the results.",
    no_args_is_help=True,
)


@dataclass(frozen=True)
class _Plot:
    plot: Path | None = setting(
        None, "Also draw TTFT and ITL CDFs, output tokens/s and requests in flight over time (PNG)."
    )


@dataclass(frozen=True)
class _Sweep:
    """``bench sweep``'s own options; the workload's are ServeConfig's (less what each point sets)."""

    endpoints: tuple[str, ...] = setting(
        REQUIRED, "NAME=URL of an endpoint, e.g. dpd=http://127.0.0.1:8081; repeat it for several.", flag="url",
        option_type=list[str],
    )  # fmt: skip
    rates: str = setting(REQUIRED, "Offered request rates (req/s), comma-separated, e.g. 0.5,1,2,4.")
    slo: str = setting(
        "ttft_p99=5s,itl_p99=200ms", "Goodput counts requests whose TTFT and own ITL p99 are within these."
    )
    json_dir: Path | None = setting(None, "Write each point's result (NAME_rateR.json) and sweep.json here.")
    plot: Path | None = setting(None, "Draw TTFT, ITL p99, goodput and output tokens/s against the rate (PNG).")
    pause_s: float = setting(0.0, "Idle seconds between points.")


PER_POINT = frozenset({"url", "request_rate", "label", "json_path"})  # a sweep sets these for each point
SERVE_SECTIONS = (Section(ServeConfig), Section(DatasetConfig, DATASET_PANEL), Section(_Plot))
SWEEP_SECTIONS = (Section(_Sweep), Section(ServeConfig, skip=PER_POINT), Section(DatasetConfig, DATASET_PANEL))


def _workload(values: dict[str, Any], **per_point: Any) -> ServeConfig:
    """The ServeConfig of the options ``serve`` and ``sweep`` share (``num_prompts`` by the dataset's default)."""
    dataset_config = build(DatasetConfig, values)
    num_prompts = values["num_prompts"]
    if num_prompts is None:
        num_prompts = default_num_prompts(values["dataset"], dataset_config)
    return build(ServeConfig, values, dataset_config=dataset_config, num_prompts=num_prompts, **per_point)


@bench_app.command("serve")
@settings_command(SERVE_SECTIONS)
def serve_command(values: dict[str, Any]) -> None:
    """Send a dataset's requests to an OpenAI-compatible server and report TTFT, TPOT, ITL and throughput.

    Exits with status 1 when no request succeeded.
    """
    plot = values["plot"]
    _check_can_plot(plot)
    config = _workload(values)
    try:
        report = asyncio.run(serve(config))
    except (ValueError, OSError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    if plot is not None:
        plot_timeline({config.label or config.url: report.results}, plot, title=config.label or config.url)
        typer.echo(f"wrote {plot}")
    if report.summary.num_completed == 0:
        raise typer.Exit(code=1)  # scripts must notice a run in which nothing worked


@bench_app.command("sweep")
@settings_command(SWEEP_SECTIONS)
def sweep_command(values: dict[str, Any]) -> None:
    """Run the workload against each endpoint at each rate (rate by rate, endpoints in the order given) and
    compare latency, throughput and goodput.

    Exits with status 1 when no request of any point succeeded.
    """
    own: _Sweep = build(_Sweep, values)
    _check_can_plot(own.plot)
    try:
        endpoints = tuple(parse_endpoint(text) for text in own.endpoints)
        workload = _workload(values, url="")
        config = SweepConfig(workload, endpoints, parse_rates(own.rates), parse_slo(own.slo), own.json_dir, own.pause_s)
        points = asyncio.run(run_sweep(config))
    except (ValueError, OSError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    if own.plot is not None:
        plot_sweep(points, own.plot, slo=config.slo)
        typer.echo(f"wrote {own.plot}")
    if sum(p.num_completed for p in points) == 0:
        raise typer.Exit(code=1)


def _check_can_plot(plot: Path | None) -> None:
    """Fail before a long run, not after it, when a plot is asked for and matplotlib is missing."""
    if plot is None:
        return
    try:
        pyplot()
    except RuntimeError as exc:
        raise typer.BadParameter(str(exc), param_hint="--plot") from exc


@bench_app.command("plot")
def plot_command(
    results: Annotated[
        list[Path], typer.Argument(help="JSON results of bench serve --json; for --kind sweep, one sweep.json.")
    ],
    out: Annotated[Path, typer.Option(help="PNG file to write.")] = Path("bench.png"),
    metric: Annotated[str, typer.Option(help=f"cdf and bar: one of {', '.join(LATENCY_METRICS)}.")] = "ttft",
    kind: Annotated[
        PlotKind,
        typer.Option(
            help="cdf: distribution; bar: mean/p50/p90/p99; timeline: CDFs, tokens/s and in-flight over time; "
            "sweep: a bench sweep summary against the rate."
        ),
    ] = PlotKind.CDF,
) -> None:
    """Draw saved bench results in one PNG (needs matplotlib)."""
    try:
        plot_results(results, out, metric=metric, kind=kind)
    except (ValueError, OSError, KeyError, RuntimeError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(f"wrote {out}")

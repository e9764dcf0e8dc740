"""``splitserve bench``: thin typer commands that build a config and call ``serve``, ``run_sweep`` or a plot.

Nothing here (or below) imports torch, so the benchmark starts in well under a second.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import math
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from splitserve.bench.client import EndpointKind
from splitserve.bench.datasets import DatasetConfig, dataset_names, default_num_prompts
from splitserve.bench.plots import PlotKind, plot_results, plot_sweep, plot_timeline, pyplot
from splitserve.bench.report import LATENCY_METRICS
from splitserve.bench.runner import ServeConfig, serve
from splitserve.bench.sweep import SweepConfig, parse_endpoint, parse_rates, parse_slo, run_sweep

bench_app = typer.Typer(
    help="Benchmark any OpenAI-compatible endpoint (a worker, the router, vLLM) and plot the results.",
    no_args_is_help=True,
)

_DATASET = "Dataset options"
_LOAD = "Load options"


def _workload(
    model: Annotated[str, typer.Option(help="Model name sent in every request.")],
    endpoint: Annotated[
        EndpointKind, typer.Option(help="completions (prompt) or chat (messages; multiround wants chat).")
    ] = EndpointKind.COMPLETIONS,
    dataset: Annotated[
        str, typer.Option(help=f"One of: {', '.join(dataset_names())}.", rich_help_panel=_DATASET)
    ] = "random",
    dataset_path: Annotated[
        Path | None,
        typer.Option(help="jsonl: file with {prompt|messages, max_tokens?} per line.", rich_help_panel=_DATASET),
    ] = None,
    num_prompts: Annotated[
        int | None,
        typer.Option(help="Measured requests (per point in a sweep; default 100; multiround: num-users * num-rounds)."),
    ] = None,
    random_input_len: Annotated[
        int, typer.Option(help="random: mean prompt length in tokens (words).", rich_help_panel=_DATASET)
    ] = 256,
    random_output_len: Annotated[
        int,
        typer.Option(
            help="random: mean max_tokens; shared-prefix: max_tokens; jsonl: default max_tokens.",
            rich_help_panel=_DATASET,
        ),
    ] = 128,
    random_range_ratio: Annotated[
        float, typer.Option(help="random: lengths uniform in [L*(1-r), L*(1+r)].", rich_help_panel=_DATASET)
    ] = 0.0,
    shared_prefix_groups: Annotated[
        int, typer.Option(help="shared-prefix: number of distinct prefixes.", rich_help_panel=_DATASET)
    ] = 4,
    shared_prefix_len: Annotated[
        int,
        typer.Option(
            help="shared-prefix: tokens (words) per common prefix; multiround: words in the shared system prompt.",
            rich_help_panel=_DATASET,
        ),
    ] = 1024,
    shared_suffix_len: Annotated[
        int, typer.Option(help="shared-prefix: tokens (words) per unique suffix.", rich_help_panel=_DATASET)
    ] = 64,
    num_users: Annotated[
        int, typer.Option(help="multiround: users (sessions), each one conversation.", rich_help_panel=_DATASET)
    ] = 8,
    num_rounds: Annotated[
        int,
        typer.Option(
            help="multiround: questions per user; round r+1 is sent after round r's answer.",
            rich_help_panel=_DATASET,
        ),
    ] = 4,
    user_history_len: Annotated[
        int,
        typer.Option(
            help="multiround: words of each user's own document that opens their chat.", rich_help_panel=_DATASET
        ),
    ] = 0,
    max_concurrency: Annotated[
        int | None, typer.Option(help="At most this many requests in flight.", rich_help_panel=_LOAD)
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed for prompts and arrival times.")] = 0,
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos/--no-ignore-eos", help="Generate exactly max_tokens per request.")
    ] = True,
    timeout_s: Annotated[
        float, typer.Option(help="Seconds each connect, read or write of a request may take.")
    ] = 600.0,
    warmup: Annotated[int, typer.Option(help="Unmeasured requests sent one by one first.")] = 0,
    no_progress: Annotated[bool, typer.Option("--no-progress", help="Hide the progress bar.")] = False,
    api_key: Annotated[
        str | None, typer.Option(envvar="OPENAI_API_KEY", help="Bearer token, if the server wants one.")
    ] = None,
) -> ServeConfig:
    """The options ``serve`` and ``sweep`` share, as a config whose url is left empty for the command to set."""
    dataset_config = DatasetConfig(
        random_input_len=random_input_len,
        random_output_len=random_output_len,
        random_range_ratio=random_range_ratio,
        shared_prefix_groups=shared_prefix_groups,
        shared_prefix_len=shared_prefix_len,
        shared_suffix_len=shared_suffix_len,
        dataset_path=dataset_path,
        num_users=num_users,
        num_rounds=num_rounds,
        user_history_len=user_history_len,
    )
    return ServeConfig(
        url="",
        model=model,
        endpoint=endpoint,
        dataset=dataset,
        dataset_config=dataset_config,
        num_prompts=default_num_prompts(dataset, dataset_config) if num_prompts is None else num_prompts,
        max_concurrency=max_concurrency,
        seed=seed,
        ignore_eos=ignore_eos,
        timeout_s=timeout_s,
        warmup=warmup,
        show_progress=not no_progress,
        api_key=api_key,
    )


def _with_workload_options(command: Callable[..., None]) -> Callable[..., None]:
    """Give ``command`` the options of ``_workload`` as well as its own: typer sees both in the signature, and
    ``command`` is called with its own options and ``workload=`` the ``ServeConfig`` they build.

    typer has no option groups shared between commands; this keeps one declaration of each option.
    """
    shared = inspect.signature(_workload, eval_str=True).parameters
    own = inspect.signature(command, eval_str=True).parameters
    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own.values() if p.name != "workload"]
    params += [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in shared.values()]

    @functools.wraps(command)
    def run(**options: Any) -> None:
        workload = _workload(**{name: options.pop(name) for name in shared})
        command(**options, workload=workload)

    run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return run


@bench_app.command("serve")
@_with_workload_options
def serve_command(
    url: Annotated[str, typer.Option(help="Base URL of the server, e.g. http://127.0.0.1:8000.")],
    request_rate: Annotated[
        float,
        typer.Option(
            help="Poisson request arrivals per second; inf: all due at once (sessions still go round by round).",
            rich_help_panel=_LOAD,
        ),
    ] = math.inf,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write summary + per-request JSON here.")] = None,
    label: Annotated[str | None, typer.Option(help="Tag stored in the JSON result.")] = None,
    plot: Annotated[
        Path | None,
        typer.Option(help="Also draw TTFT and ITL CDFs, output tokens/s and requests in flight over time (PNG)."),
    ] = None,
    *,
    workload: ServeConfig,
) -> None:
    """Send a dataset's requests to an OpenAI-compatible server and report TTFT, TPOT, ITL and throughput.

    Exits with status 1 when no request succeeded.
    """
    _check_can_plot(plot)
    config = dataclasses.replace(workload, url=url, request_rate=request_rate, label=label, json_path=json_out)
    try:
        report = asyncio.run(serve(config))
    except (ValueError, OSError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    if plot is not None:
        plot_timeline({label or url: report.results}, plot, title=label or url)
        typer.echo(f"wrote {plot}")
    if report.summary.num_completed == 0:
        raise typer.Exit(code=1)  # scripts must notice a run in which nothing worked


@bench_app.command("sweep")
@_with_workload_options
def sweep_command(
    url: Annotated[
        list[str],
        typer.Option(help="NAME=URL of an endpoint, e.g. dpd=http://127.0.0.1:8081; repeat it for several."),
    ],
    rates: Annotated[str, typer.Option(help="Offered request rates (req/s), comma-separated, e.g. 0.5,1,2,4.")],
    slo: Annotated[
        str, typer.Option(help="Goodput counts requests whose TTFT and own ITL p99 are within these.")
    ] = "ttft_p99=5s,itl_p99=200ms",
    json_dir: Annotated[
        Path | None, typer.Option(help="Write each point's result (NAME_rateR.json) and sweep.json here.")
    ] = None,
    plot: Annotated[
        Path | None, typer.Option(help="Draw TTFT, ITL p99, goodput and output tokens/s against the rate (PNG).")
    ] = None,
    pause_s: Annotated[float, typer.Option(help="Idle seconds between points.")] = 0.0,
    *,
    workload: ServeConfig,
) -> None:
    """Run the workload against each endpoint at each rate (rate by rate, endpoints in the order given) and
    compare latency, throughput and goodput.

    Exits with status 1 when no request of any point succeeded.
    """
    _check_can_plot(plot)
    try:
        endpoints = tuple(parse_endpoint(text) for text in url)
        config = SweepConfig(workload, endpoints, parse_rates(rates), parse_slo(slo), json_dir, pause_s)
        points = asyncio.run(run_sweep(config))
    except (ValueError, OSError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    if plot is not None:
        plot_sweep(points, plot, slo=config.slo)
        typer.echo(f"wrote {plot}")
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

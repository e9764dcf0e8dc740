"""``splitserve bench``: thin typer commands that build a config and call ``serve`` or ``plot_results``.

Nothing here (or below) imports torch, so the benchmark starts in well under a second.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Annotated

import typer

from splitserve.bench.client import EndpointKind
from splitserve.bench.datasets import DatasetConfig, dataset_names, default_num_prompts
from splitserve.bench.report import LATENCY_METRICS, PlotKind, plot_results
from splitserve.bench.runner import ServeConfig, serve

bench_app = typer.Typer(
    help="Benchmark any OpenAI-compatible endpoint (a worker, the router, vLLM) and plot the results.",
    no_args_is_help=True,
)

_DATASET = "Dataset options"
_LOAD = "Load options"


@bench_app.command("serve")
def serve_command(
    url: Annotated[str, typer.Option(help="Base URL of the server, e.g. http://127.0.0.1:8000.")],
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
        typer.Option(help="Number of measured requests (default 100; multiround: num-users * num-rounds)."),
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
    request_rate: Annotated[
        float,
        typer.Option(
            help="Poisson request arrivals per second; inf: all due at once (sessions still go round by round).",
            rich_help_panel=_LOAD,
        ),
    ] = math.inf,
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
    json_out: Annotated[Path | None, typer.Option("--json", help="Write summary + per-request JSON here.")] = None,
    label: Annotated[str | None, typer.Option(help="Tag stored in the JSON result.")] = None,
    no_progress: Annotated[bool, typer.Option("--no-progress", help="Hide the progress bar.")] = False,
    api_key: Annotated[
        str | None, typer.Option(envvar="OPENAI_API_KEY", help="Bearer token, if the server wants one.")
    ] = None,
) -> None:
    """Send a dataset's requests to an OpenAI-compatible server and report TTFT, TPOT, ITL and throughput.

    Exits with status 1 when no request succeeded.
    """
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
    config = ServeConfig(
        url=url,
        model=model,
        endpoint=endpoint,
        dataset=dataset,
        dataset_config=dataset_config,
        num_prompts=default_num_prompts(dataset, dataset_config) if num_prompts is None else num_prompts,
        request_rate=request_rate,
        max_concurrency=max_concurrency,
        seed=seed,
        ignore_eos=ignore_eos,
        timeout_s=timeout_s,
        warmup=warmup,
        show_progress=not no_progress,
        label=label,
        json_path=json_out,
        api_key=api_key,
    )
    try:
        report = asyncio.run(serve(config))
    except (ValueError, OSError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    if report.summary.num_completed == 0:
        raise typer.Exit(code=1)  # scripts must notice a run in which nothing worked


@bench_app.command("plot")
def plot_command(
    results: Annotated[list[Path], typer.Argument(help="JSON results written by bench serve --json.")],
    out: Annotated[Path, typer.Option(help="PNG file to write.")] = Path("bench.png"),
    metric: Annotated[str, typer.Option(help=f"One of: {', '.join(LATENCY_METRICS)}.")] = "ttft",
    kind: Annotated[PlotKind, typer.Option(help="cdf: distribution; bar: mean/p50/p90/p99.")] = PlotKind.CDF,
) -> None:
    """Compare several bench results in one PNG (needs matplotlib)."""
    try:
        plot_results(results, out, metric=metric, kind=kind)
    except (ValueError, OSError, KeyError, RuntimeError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(f"wrote {out}")

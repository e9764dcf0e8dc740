"""The ``splitserve`` command line. Each subcommand builds a config and calls one run() function.

Heavy imports (torch, the engine) happen inside the subcommands that need them, so ``splitserve bench`` and
``splitserve router`` start fast and never import torch.
"""

from __future__ import annotations

import typer

from splitserve.bench.cli import bench_app

app = typer.Typer(
    name="splitserve",
    help="An open LLM serving stack: disaggregated prefill/decode, tiered KV cache, cache-aware routing.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(bench_app, name="bench")


def main() -> None:
    app()

"""The ``splitserve`` command line. Each subcommand builds a config and calls one run() function.

Heavy imports (torch, the engine) happen inside the subcommands that need them, so ``splitserve bench`` and
``splitserve router`` start fast and never import torch. A plain ``pip install splitserve`` has no torch: the
commands that run workers (``worker``, ``up``, ``apply``) then stop with one line naming the engine extra.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer

from splitserve.bench.cli import bench_app
from splitserve.config import ROUTER_SECTIONS, WORKER_SECTIONS, router_config, worker_configs
from splitserve.options import settings_command
from splitserve.planner.options import PlanOptions
from splitserve.settings import Section, build

_T = TypeVar("_T")

app = typer.Typer(
    name="splitserve",
    help="An open LLM serving stack: disaggregated prefill/decode, tiered KV cache, cache-aware routing.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(bench_app, name="bench")


@app.callback()
def _before_a_command(ctx: typer.Context) -> None:
    """Runs before a command's options are parsed: ``splitserve worker`` takes LMCache's settings (``LMCACHE_*``
    variables and ``LMCACHE_CONFIG_FILE``) where they have an equivalent, and warns about the rest."""
    if ctx.invoked_subcommand != "worker":
        return
    from splitserve import lmcache_env

    try:
        translation = lmcache_env.apply()
    except ValueError as exc:
        _fail(str(exc))
    if translation.settings:
        typer.echo(
            "LMCache settings taken: " + ", ".join(f"{k}={v}" for k, v in translation.settings.items()), err=True
        )
    for warning in translation.warnings:
        typer.echo(f"WARNING: {warning}", err=True)


ENGINE_EXTRA_INSTALL = "pip install 'splitserve[engine]'"


@app.command("worker")
@settings_command(WORKER_SECTIONS)
def worker_command(values: dict[str, Any]) -> None:
    """Run one engine behind an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)."""
    run_worker = _import_run_worker()
    engine_config, server_config = _checked(lambda: worker_configs(values))
    raise typer.Exit(run_worker(engine_config, server_config, server_config.log_level.lower()))


def _import_run_worker() -> Callable[..., int]:
    """The worker's entry point; without the engine extra (torch...), exit 2 with one line naming it."""
    try:
        from splitserve.worker.run import run_worker
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] == "splitserve":
            raise  # a broken install, not a missing extra
        _fail(f"the worker needs the engine extra, and {exc.name} is not installed: {ENGINE_EXTRA_INSTALL}")
    return run_worker


@app.command("router")
@settings_command(ROUTER_SECTIONS)
def router_command(values: dict[str, Any]) -> None:
    """Route OpenAI requests over workers: roundrobin, session, prefixaware or kvaware (no torch)."""
    config = _checked(lambda: router_config(values))
    from splitserve.router.run import run_router

    raise typer.Exit(run_router(config, config.log_level.lower()))


def _checked(make: Callable[[], _T]) -> _T:
    """``make()``; a ValueError (a setting that does not parse or validate) is one clear line and exit 2."""
    try:
        return make()
    except ValueError as exc:
        _fail(str(exc))


_FILE = Annotated[Path, typer.Option("-f", "--filename", help="The InferenceEndpointConfig YAML file.")]
_ROUTER_PORT = Annotated[int, typer.Option("--port", help="Port of the endpoint's router.")]


@app.command("up")
def up_command(filename: _FILE, port: _ROUTER_PORT = 8080) -> None:
    """Run an endpoint on this machine in the foreground (Ctrl-C stops it); `apply -f` changes it."""
    _require_local_workers()
    from splitserve.deploy.local import up

    raise typer.Exit(_endpoint_command(lambda: up(filename, router_port=port)))


@app.command("apply")
def apply_command(filename: _FILE, port: _ROUTER_PORT = 8080) -> None:
    """Start an endpoint in the background, or reconcile the running one with a changed file."""
    _require_local_workers()
    from splitserve.deploy.local import apply

    raise typer.Exit(_endpoint_command(lambda: apply(filename, router_port=port)))


@app.command("get")
def get_command(name: Annotated[str | None, typer.Argument(help="An endpoint (default: all).")] = None) -> None:
    """List endpoints and their pods, like kubectl get pods."""
    from splitserve.deploy.local import get

    raise typer.Exit(get(name))


@app.command("logs")
def logs_command(
    pod: Annotated[str, typer.Argument(help="A pod name, as `splitserve get` shows it.")],
    tail: Annotated[int, typer.Option(help="Lines to show.")] = 100,
) -> None:
    """Show the end of a pod's log."""
    from splitserve.deploy.local import logs

    raise typer.Exit(logs(pod, lines=tail))


@app.command("delete")
def delete_command(name: Annotated[str, typer.Argument(help="The endpoint (metadata.name).")]) -> None:
    """Stop an endpoint started with `splitserve apply`, and all its pods."""
    from splitserve.deploy.local import delete

    raise typer.Exit(delete(name))


def _require_local_workers() -> None:
    """A local endpoint runs its workers here: stop at once, not after its pods fail, when torch is missing."""
    if importlib.util.find_spec("torch") is None:
        _fail(f"a local endpoint runs its workers here, and they need the engine extra: {ENGINE_EXTRA_INSTALL}")


def _endpoint_command(run: Callable[[], int]) -> int:
    """Run a local endpoint command; a bad resource file is one clear error (exit 2), not a traceback."""
    from splitserve.endpoint import EndpointError

    try:
        return run()
    except (EndpointError, RuntimeError, OSError) as exc:
        _fail(str(exc))


def _fail(message: str) -> NoReturn:
    """A start-up error: one line on stderr, exit status 2, no traceback."""
    typer.echo(f"Error: {message}", err=True)
    raise typer.Exit(2)


_K8S = "Kubernetes options"


@app.command("render")
def render_command(
    file: Annotated[str | None, typer.Option("--file", "-f", help="The InferenceEndpointConfig resource file.")] = None,
    image: Annotated[
        str | None, typer.Option(help="Image when the resource sets no spec.worker.image (default splitserve:latest).")
    ] = None,
    crd: Annotated[bool, typer.Option("--crd", help="Print the InferenceEndpointConfig CRD instead.")] = False,
    operator: Annotated[
        bool, typer.Option("--operator", help="Print the CRD and the operator (RBAC, Deployment) instead.")
    ] = False,
    operator_namespace: Annotated[
        str, typer.Option(help="--operator: the namespace the operator runs in (must exist).")
    ] = "splitserve-system",
    cluster_wide: Annotated[
        bool,
        typer.Option(
            help="--operator: watch every namespace with a ClusterRole (default: its own namespace, with a Role)."
        ),
    ] = False,
) -> None:
    """Print the Kubernetes manifests of an endpoint (pipe them to kubectl apply -f -)."""
    import yaml

    from splitserve.deploy.render import DEFAULT_IMAGE, render_yaml

    if crd or operator:
        from splitserve.deploy.crd import crd_yaml
        from splitserve.deploy.operator import install_manifests

        if operator:
            manifests = install_manifests(operator_namespace, image or DEFAULT_IMAGE, cluster_wide=cluster_wide)
            typer.echo(yaml.safe_dump_all(manifests, sort_keys=False, width=4096), nl=False)
        else:
            typer.echo(crd_yaml(), nl=False)
        return
    if file is None:
        _fail("give the resource file with -f (or --crd, or --operator)")
    from splitserve.endpoint import EndpointError, load_endpoint

    try:
        text = render_yaml(load_endpoint(file), default_image=image or DEFAULT_IMAGE)
    except EndpointError as exc:
        _fail(str(exc))
    typer.echo(text, nl=False)


@app.command("plan")
@settings_command((Section(PlanOptions),))
def plan_command(values: dict[str, Any]) -> None:
    """Measure this machine, predict every layout the resource's cores allow, and recommend one."""
    from splitserve.endpoint import EndpointError

    try:
        from splitserve.planner.command import run_plan

        options = build(PlanOptions, values)
        code = run_plan(options, typer.echo, lambda line: typer.echo(line, err=True))
    except (EndpointError, ValueError, OSError, RuntimeError) as exc:
        _fail(str(exc))
    raise typer.Exit(code)


@app.command("operator")
def operator_command(
    namespace: Annotated[
        list[str] | None, typer.Option(help="Namespace to watch (repeatable; default: the operator's own).")
    ] = None,
    all_namespaces: Annotated[
        bool, typer.Option(help="Watch every namespace (its RBAC must then be cluster-wide).")
    ] = False,
    api_server: Annotated[
        str | None,
        typer.Option(help="API server URL, e.g. kubectl proxy's http://127.0.0.1:8001 (default: in-cluster)."),
    ] = None,
    interval: Annotated[float, typer.Option(help="Seconds between status refreshes.")] = 10.0,
    image: Annotated[
        str | None, typer.Option(help="Image for endpoints that set no spec.worker.image (default splitserve:latest).")
    ] = None,
    liveness_port: Annotated[int, typer.Option(help="Port of the operator's /healthz.")] = 8081,
) -> None:
    """Run the Kubernetes operator for InferenceEndpointConfig resources (needs the operator extra: kopf)."""
    from splitserve.deploy.operator import run_operator
    from splitserve.deploy.render import DEFAULT_IMAGE

    try:
        code = run_operator(
            namespaces=tuple(namespace or ()),
            all_namespaces=all_namespaces,
            api_server=api_server,
            interval_s=interval,
            default_image=image or DEFAULT_IMAGE,
            liveness_port=liveness_port,
        )
    except RuntimeError as exc:  # no kopf, no API server, or no namespace to watch
        _fail(str(exc))
    raise typer.Exit(code)


@app.command("k8s-discovery")
def k8s_discovery_command(
    selector: Annotated[str, typer.Option(help="Label selector of the worker pods.", rich_help_panel=_K8S)],
    port: Annotated[int, typer.Option(help="The workers' HTTP container port.", rich_help_panel=_K8S)],
    router: Annotated[
        str, typer.Option(help="The router's admin listener (its --admin-host/--admin-port).")
    ] = "http://127.0.0.1:8081",
    namespace: Annotated[
        str, typer.Option(help="Namespace of the pods.", envvar="SPLITSERVE_POD_NAMESPACE", rich_help_panel=_K8S)
    ] = "default",
    interval: Annotated[float, typer.Option(help="Seconds between pod listings.")] = 5.0,
    api_server: Annotated[
        str | None,
        typer.Option(help="API server URL, e.g. kubectl proxy's (default: in-cluster).", rich_help_panel=_K8S),
    ] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
) -> None:
    """Router sidecar: keep the router's workers equal to the ready pods matching --selector."""
    from splitserve.router.k8s_discovery import run_discovery

    if log_level.lower() not in ("critical", "error", "warning", "info", "debug"):
        _fail(f"--log-level must be one of debug, info, warning, error; got {log_level!r}")
    try:
        code = run_discovery(
            namespace=namespace,
            selector=selector,
            port=port,
            router_url=router,
            interval_s=interval,
            api_server=api_server,
            log_level=log_level.lower(),
        )
    except RuntimeError as exc:  # not in a pod and no --api-server
        _fail(str(exc))
    raise typer.Exit(code)


def main() -> None:
    app()

"""The ``splitserve`` command line. Each subcommand builds a config and calls one run() function.

Heavy imports (torch, the engine) happen inside the subcommands that need them, so ``splitserve bench`` and
``splitserve router`` start fast and never import torch. A plain ``pip install splitserve`` has no torch: the
commands that run workers (``worker``, ``up``, ``apply``) then stop with one line naming the engine extra.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, NoReturn
from urllib.parse import urlsplit

import typer

from splitserve.bench.cli import bench_app
from splitserve.config import (
    REDIS_PASSWORD_ENV,
    REDIS_USERNAME_ENV,
    BackendKind,
    L2Backend,
    PDDecision,
    Role,
    RoutingStrategy,
    SchedulingPolicy,
)

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

_ENGINE = "Engine options"
_CACHE = "KV cache options"
_SERVER = "Server options"
_TIERS = "KV cache tier options (L1 memory, L2 Redis or disk)"


@app.command("worker")
def worker_command(
    model: Annotated[
        str, typer.Option(help="Model: a registry name (smollm2), a GGUF file or a Hugging Face folder.")
    ] = "smollm2",
    host: Annotated[str, typer.Option(help="Address to bind.", rich_help_panel=_SERVER)] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.", rich_help_panel=_SERVER)] = 8000,
    served_model_name: Annotated[
        str | None, typer.Option(help="Model name the API answers to (default: --model).", rich_help_panel=_SERVER)
    ] = None,
    role: Annotated[
        Role, typer.Option(help="colocated, prefill (KV sender) or decode (KV receiver).", rich_help_panel=_SERVER)
    ] = Role.COLOCATED,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.", rich_help_panel=_ENGINE)] = "auto",
    device: Annotated[str, typer.Option(help="auto (CUDA if present), cpu or cuda.", rich_help_panel=_ENGINE)] = "auto",
    max_model_len: Annotated[
        int | None, typer.Option(help="Context length (default: the model's).", rich_help_panel=_ENGINE)
    ] = None,
    max_num_seqs: Annotated[int, typer.Option(help="Requests running at once.", rich_help_panel=_ENGINE)] = 64,
    max_num_batched_tokens: Annotated[
        int, typer.Option(help="Tokens computed per engine step.", rich_help_panel=_ENGINE)
    ] = 1024,
    enable_chunked_prefill: Annotated[
        bool, typer.Option(help="Split long prompts across steps.", rich_help_panel=_ENGINE)
    ] = True,
    scheduling_policy: Annotated[
        SchedulingPolicy,
        typer.Option(
            help="Which waiting request goes first: lpm (fewest tokens left to compute, so cache hits pass cold "
            "prompts; oldest first past --scheduling-max-wait) or fcfs (arrival order).",
            rich_help_panel=_ENGINE,
        ),
    ] = SchedulingPolicy.LPM,
    scheduling_max_wait: Annotated[
        float, typer.Option(help="lpm: seconds after which a request goes first.", rich_help_panel=_ENGINE)
    ] = 5.0,
    long_prefill_token_threshold: Annotated[
        int,
        typer.Option(
            help="When the request next in line is short, the running prompts share at most this many tokens "
            "that step and the rest admits it whole (0: no limit).",
            rich_help_panel=_ENGINE,
        ),
    ] = 256,
    verify_sample_rate: Annotated[
        float,
        typer.Option(
            help="Fraction of the requests that reused KV (prefix cache, L1/L2, a prefill worker's push, a "
            "resumed stream) that are recomputed cold when nothing else waits and compared token by token; a "
            "mismatch counts in splitserve:exactness_mismatches_total and is logged (0: never).",
            rich_help_panel=_ENGINE,
        ),
    ] = 0.001,
    seed: Annotated[int, typer.Option(help="Seed for unseeded sampling.", rich_help_panel=_ENGINE)] = 0,
    quantization: Annotated[
        str,
        typer.Option(
            help="gguf: every CPU matmul from a Q4_0/Q4_1/Q8_0 GGUF's own blocks (native kernels); int4: "
            "PyTorch's int4 kernel for decode steps (bf16 CPU); auto: gguf, else int4, where they run; "
            "none: always the dequantized --dtype weights.",
            rich_help_panel=_ENGINE,
        ),
    ] = "auto",
    num_threads: Annotated[
        int | None,
        typer.Option(
            help="CPU threads for the engine (default: the CPUs this process may use).", rich_help_panel=_ENGINE
        ),
    ] = None,
    tensor_parallel_size: Annotated[int, typer.Option(help="Only 1 is supported.", rich_help_panel=_ENGINE)] = 1,
    pipeline_parallel_size: Annotated[int, typer.Option(help="Only 1 is supported.", rich_help_panel=_ENGINE)] = 1,
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.", rich_help_panel=_CACHE)] = 16,
    kv_cache_memory: Annotated[
        str | None,
        typer.Option(
            help="KV cache size in bytes (2GiB) or as a fraction of free memory (0.3); default 2GiB on CPU.",
            rich_help_panel=_CACHE,
        ),
    ] = None,
    gpu_memory_utilization: Annotated[
        float, typer.Option(help="CUDA: fraction of device memory the worker may use.", rich_help_panel=_CACHE)
    ] = 0.9,
    enable_prefix_caching: Annotated[
        bool, typer.Option(help="Reuse KV blocks of shared prompt prefixes.", rich_help_panel=_CACHE)
    ] = True,
    l1_cache: Annotated[
        bool,
        typer.Option(
            help="Keep computed KV chunks in this process's memory (L1).",
            envvar="SPLITSERVE_L1_CACHE",
            rich_help_panel=_TIERS,
        ),
    ] = False,
    l1_cache_bytes: Annotated[
        str,
        typer.Option(
            help="L1 size (1GiB, 512MB or bytes).", envvar="SPLITSERVE_L1_CACHE_BYTES", rich_help_panel=_TIERS
        ),
    ] = "1GiB",
    l2_backend: Annotated[
        L2Backend,
        typer.Option(
            help="Shared L2 tier: redis (--l2-url) or tieredstorage (a directory, --l2-path).",
            envvar="SPLITSERVE_L2_BACKEND",
            rich_help_panel=_TIERS,
        ),
    ] = L2Backend.NONE,
    l2_url: Annotated[
        str | None,
        typer.Option(help="Redis URL, redis://host:port/db.", envvar="SPLITSERVE_L2_URL", rich_help_panel=_TIERS),
    ] = None,
    l2_key_prefix: Annotated[
        str,
        typer.Option(
            help="Prefix of every Redis key (endpoints sharing one Redis stay apart). The Redis password and ACL "
            "user come from the URL or SPLITSERVE_REDIS_PASSWORD / SPLITSERVE_REDIS_USERNAME, never a flag.",
            envvar="SPLITSERVE_L2_KEY_PREFIX",
            rich_help_panel=_TIERS,
        ),
    ] = "",
    l2_path: Annotated[
        str | None,
        typer.Option(help="Directory of the tieredstorage tier.", envvar="SPLITSERVE_L2_PATH", rich_help_panel=_TIERS),
    ] = None,
    l2_max_bytes: Annotated[
        str,
        typer.Option(
            help="tieredstorage size (10GiB or bytes).", envvar="SPLITSERVE_L2_MAX_BYTES", rich_help_panel=_TIERS
        ),
    ] = "10GiB",
    kv_chunk_size: Annotated[
        int,
        typer.Option(
            help="Tokens per stored KV chunk (a multiple of --block-size).",
            envvar="SPLITSERVE_KV_CHUNK_SIZE",
            rich_help_panel=_TIERS,
        ),
    ] = 256,
    save_decode_cache: Annotated[
        bool,
        typer.Option(
            "--save-decode-cache/--no-save-decode-cache",
            help="Also store generated tokens' KV (and, on the decode role, store anything at all).",
            envvar=["SPLITSERVE_SAVE_DECODE_CACHE", "LMCACHE_SAVE_DECODE_CACHE"],
            rich_help_panel=_TIERS,
        ),
    ] = False,
    kv_transfer_port: Annotated[
        int,
        typer.Option(
            help="Decode role: port of the KV receiver prefill workers push to (0: any free port, shown at "
            "GET /kv/transfer).",
            rich_help_panel=_SERVER,
        ),
    ] = 0,
    pd_buffer_size: Annotated[
        str,
        typer.Option(
            help="Decode role: bytes of pushed KV held until their requests arrive (1GiB, 512MB or bytes).",
            envvar=["PD_BUFFER_SIZE", "SPLITSERVE_PD_BUFFER_SIZE"],
            rich_help_panel=_SERVER,
        ),
    ] = "1GiB",
    kv_transfer_timeout: Annotated[
        float,
        typer.Option(
            help="Prefill role: seconds to keep retrying a KV push (a full PD buffer); then decode recomputes.",
            rich_help_panel=_SERVER,
        ),
    ] = 10.0,
    kv_events_url: Annotated[
        str | None,
        typer.Option(
            help="Send KV events (registration, cached blocks and chunks per tier) to this URL, normally the "
            "router's http://HOST:PORT/kv/events, for its kvaware routing.",
            envvar="SPLITSERVE_KV_EVENTS_URL",
            rich_help_panel=_SERVER,
        ),
    ] = None,
    kv_events_config: Annotated[
        str | None,
        typer.Option(
            help="Also publish the engine's KV events in vLLM's format over ZMQ, configured as vLLM's flag is: "
            '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
            '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}\' (for llm-d, Dynamo, a vLLM-kind router).',
            rich_help_panel=_SERVER,
        ),
    ] = None,
    worker_id: Annotated[
        str | None, typer.Option(help="This worker's name in KV events (default: host:port).", rich_help_panel=_SERVER)
    ] = None,
    advertise_url: Annotated[
        str | None,
        typer.Option(
            help="The URL the router reaches this worker at (default: http://host:port).", rich_help_panel=_SERVER
        ),
    ] = None,
    api_key: Annotated[
        list[str] | None,
        typer.Option(
            help="A client key /v1/* requires as 'Authorization: Bearer KEY' (repeatable). Also read from "
            "SPLITSERVE_API_KEY and VLLM_API_KEY. Without one, /v1/* is open.",
            rich_help_panel=_SERVER,
        ),
    ] = None,
    salt_per_api_key: Annotated[
        bool,
        typer.Option(
            help="Make each client key a cache tenant: its requests share cached prefixes with no other key's "
            "(a cache_salt derived from the key, then the request's own cache_salt).",
            envvar="SPLITSERVE_SALT_PER_API_KEY",
            rich_help_panel=_SERVER,
        ),
    ] = False,
    max_tokens_limit: Annotated[
        int | None,
        typer.Option(
            help="The most max_tokens a request may ask for, and what it gets when it sets none "
            "(default: the context left).",
            rich_help_panel=_SERVER,
        ),
    ] = None,
    max_queued_requests: Annotated[
        int | None,
        typer.Option(
            help="Requests that may wait for their first token; past that, new ones get a 429 with Retry-After "
            "(default: no bound).",
            rich_help_panel=_SERVER,
        ),
    ] = None,
    shutdown_timeout: Annotated[
        float,
        typer.Option(
            help="On SIGTERM the worker drains: it takes no new requests and lets those in flight finish, "
            "for at most this many seconds.",
            rich_help_panel=_SERVER,
        ),
    ] = 30.0,
    cluster_secret_file: Annotated[
        str | None,
        typer.Option(
            help="A file holding the cluster secret, the router's credential here (default: the "
            "SPLITSERVE_CLUSTER_SECRET environment variable).",
            rich_help_panel=_SERVER,
        ),
    ] = None,
    uvicorn_log_level: Annotated[
        str, typer.Option(help="debug, info, warning or error.", rich_help_panel=_SERVER)
    ] = "info",
) -> None:
    """Run one engine behind an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)."""
    run_worker = _import_run_worker()
    from splitserve.config import (
        CacheConfig,
        EngineConfig,
        KVEventsConfig,
        KVTierConfig,
        ModelConfig,
        PDConfig,
        SchedulerConfig,
        ServerConfig,
        parse_bytes,
    )

    for name, size in (
        ("--tensor-parallel-size", tensor_parallel_size),
        ("--pipeline-parallel-size", pipeline_parallel_size),
    ):
        if size != 1:
            _fail(f"{name} {size} is not supported: splitserve runs one engine per worker (use 1)")
    try:
        kv_tiers = KVTierConfig(
            l1_cache=l1_cache,
            l1_cache_bytes=parse_bytes(l1_cache_bytes),
            l2_backend=l2_backend,
            l2_url=l2_url,
            l2_username=os.environ.get(REDIS_USERNAME_ENV) or None,
            l2_password=os.environ.get(REDIS_PASSWORD_ENV) or None,
            l2_key_prefix=l2_key_prefix,
            l2_path=l2_path,
            l2_max_bytes=parse_bytes(l2_max_bytes),
            kv_chunk_size=kv_chunk_size,
            save_decode_cache=save_decode_cache,
        )
    except ValueError as exc:
        _fail(str(exc))
    engine_config = EngineConfig(
        model=ModelConfig(
            model=model,
            dtype=dtype,
            device=device,
            max_model_len=max_model_len,
            seed=seed,
            served_model_name=served_model_name,
            num_threads=num_threads,
            quantization=quantization,
        ),
        cache=CacheConfig(
            block_size=block_size,
            kv_cache_memory=kv_cache_memory,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            policy=scheduling_policy,
            max_wait_s=scheduling_max_wait,
            long_prefill_token_threshold=long_prefill_token_threshold,
            verify_sample_rate=verify_sample_rate,
        ),
        kv_tiers=kv_tiers,
        pd=PDConfig(
            kv_transfer_host=host if host not in ("0.0.0.0", "::") else "0.0.0.0",
            kv_transfer_port=kv_transfer_port,
            pd_buffer_size=_parse_size("--pd-buffer-size", pd_buffer_size),
            transfer_deadline_s=kv_transfer_timeout,
            kv_transfer_advertise_host=urlsplit(advertise_url).hostname if advertise_url else None,
        ),
    )
    if uvicorn_log_level.lower() not in ("critical", "error", "warning", "info", "debug", "trace"):
        _fail(f"--uvicorn-log-level must be one of debug, info, warning, error; got {uvicorn_log_level!r}")
    from splitserve import auth

    try:
        api_keys = auth.api_keys(api_key or (), (auth.API_KEY_ENV, auth.VLLM_API_KEY_ENV))
        secret = auth.cluster_secret(cluster_secret_file)
    except ValueError as exc:
        _fail(str(exc))
    try:
        vllm_events = KVEventsConfig.from_json(kv_events_config) if kv_events_config is not None else None
    except ValueError as exc:
        _fail(str(exc))
    server_config = ServerConfig(
        host=host,
        port=port,
        role=role,
        kv_events_url=kv_events_url,
        kv_events_config=vllm_events,
        worker_id=worker_id,
        advertise_url=advertise_url,
        api_keys=api_keys,
        salt_per_api_key=salt_per_api_key,
        cluster_secret=secret,
        max_tokens_limit=max_tokens_limit,
        max_queued_requests=max_queued_requests,
        shutdown_timeout_s=shutdown_timeout,
    )
    try:
        engine_config.validate()
        server_config.validate()
    except ValueError as exc:
        _fail(str(exc))
    raise typer.Exit(run_worker(engine_config, server_config, uvicorn_log_level.lower()))


def _import_run_worker() -> Callable[..., int]:
    """The worker's entry point; without the engine extra (torch...), exit 2 with one line naming it."""
    try:
        from splitserve.server.run import run_worker
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] == "splitserve":
            raise  # a broken install, not a missing extra
        _fail(f"the worker needs the engine extra, and {exc.name} is not installed: {ENGINE_EXTRA_INSTALL}")
    return run_worker


_ROUTING = "Routing options"
_FAULTS = "Health and retry options"


@app.command("router")
def router_command(
    backend: Annotated[
        list[str] | None, typer.Option(help="A worker's base URL (repeatable).", rich_help_panel=_ROUTING)
    ] = None,
    prefill: Annotated[
        list[str] | None,
        typer.Option(help="A prefill worker's URL (repeatable; disaggregated).", rich_help_panel=_ROUTING),
    ] = None,
    decode: Annotated[
        list[str] | None,
        typer.Option(help="A decode worker's URL (repeatable; disaggregated).", rich_help_panel=_ROUTING),
    ] = None,
    model: Annotated[str, typer.Option(help="Model whose tokenizer and chat template routing uses.")] = "smollm2",
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = 8080,
    admin_host: Annotated[
        str, typer.Option(help="Interface of the admin listener (/admin/*: the worker lists).")
    ] = "127.0.0.1",
    admin_port: Annotated[
        int | None, typer.Option(help="Port of the admin listener (default: --port + 1).", show_default=False)
    ] = None,
    routing_strategy: Annotated[
        RoutingStrategy,
        typer.Option(help="roundrobin, session, prefixaware or kvaware.", rich_help_panel=_ROUTING),
    ] = RoutingStrategy.ROUNDROBIN,
    routing_threshold: Annotated[
        int, typer.Option(help="Prompt tokens from which a request is disaggregated.", rich_help_panel=_ROUTING)
    ] = 4096,
    pd_decision: Annotated[
        PDDecision,
        typer.Option(
            envvar="SPLITSERVE_PD_DECISION",
            help="threshold: disaggregate every prompt from --routing-threshold (the reference rule); cost: from "
            "there, only when prefill plus the KV push beats the decode worker prefilling it while stalling its "
            "streams (measured costs).",
            rich_help_panel=_ROUTING,
        ),
    ] = PDDecision.THRESHOLD,
    session_key: Annotated[
        str,
        typer.Option(help="Header naming the session (the body's user field also counts).", rich_help_panel=_ROUTING),
    ] = "x-session-id",
    block_size: Annotated[int, typer.Option(help="The workers' KV block size.", rich_help_panel=_ROUTING)] = 16,
    kv_chunk_size: Annotated[int, typer.Option(help="The workers' KV chunk size.", rich_help_panel=_ROUTING)] = 256,
    prefix_index_max_blocks: Annotated[
        int, typer.Option(help="prefixaware: block hashes remembered (LRU).", rich_help_panel=_ROUTING)
    ] = 200_000,
    kv_index_max_blocks: Annotated[
        int, typer.Option(help="kvaware: block hashes kept per tier and worker.", rich_help_panel=_ROUTING)
    ] = 1_000_000,
    kv_l2_weight: Annotated[
        float, typer.Option(help="kvaware: weight of a token in the shared L2 (0..1).", rich_help_panel=_ROUTING)
    ] = 0.5,
    backend_kind: Annotated[
        BackendKind,
        typer.Option(
            help="kvaware: what the workers are, hence where their KV events come from: splitserve (GET /kv/events), "
            "vllm (its ZMQ publisher, --kv-events-config) or auto (ask each worker's /version).",
            rich_help_panel=_ROUTING,
        ),
    ] = BackendKind.AUTO,
    vllm_kv_events_port: Annotated[
        str | None,
        typer.Option(
            help="kvaware: a vLLM worker's KV event port (its --kv-events-config endpoint), reached at "
            "tcp://<worker host>:PORT; +N means the worker's HTTP port plus N (default: what the worker's "
            "/kv_event_sources names, else 5557).",
            rich_help_panel=_ROUTING,
        ),
    ] = None,
    vllm_kv_replay_port: Annotated[
        str | None,
        typer.Option(
            help="kvaware: a vLLM worker's replay port (its replay_endpoint), the same way (default: as the worker "
            "names it, if it does; without one, missed events make the router forget that worker's blocks).",
            rich_help_panel=_ROUTING,
        ),
    ] = None,
    routing_cost_model: Annotated[
        bool,
        typer.Option(
            help="Cache-aware: pick the worker with the lowest estimated TTFT (its uncached tokens plus the prefill "
            "queued there, times its measured seconds per token) instead of the thresholds below (experimental).",
            rich_help_panel=_ROUTING,
        ),
    ] = False,
    cache_threshold: Annotated[
        float,
        typer.Option(
            help="Cache-aware, without the cost model: a match under this share of the prompt goes to the "
            "least-loaded worker.",
            rich_help_panel=_ROUTING,
        ),
    ] = 0.4,
    balance_abs_threshold: Annotated[
        int, typer.Option(help="Load guard: in-flight gap to the least-loaded worker...", rich_help_panel=_ROUTING)
    ] = 4,
    balance_rel_threshold: Annotated[
        float, typer.Option(help="...that is also this many times its load + 1.", rich_help_panel=_ROUTING)
    ] = 1.5,
    health_interval: Annotated[
        float, typer.Option(help="Seconds between /health probes.", rich_help_panel=_FAULTS)
    ] = 2.0,
    health_failure_threshold: Annotated[
        int, typer.Option(help="Failed probes that mark a worker unhealthy.", rich_help_panel=_FAULTS)
    ] = 2,
    connect_timeout: Annotated[
        float, typer.Option(help="Seconds to connect to a worker.", rich_help_panel=_FAULTS)
    ] = 2.0,
    read_timeout: Annotated[
        float, typer.Option(help="Seconds a worker may stay silent mid-answer.", rich_help_panel=_FAULTS)
    ] = 600.0,
    max_retries: Annotated[
        int, typer.Option(help="Other workers to try when one fails before answering.", rich_help_panel=_FAULTS)
    ] = 2,
    breaker_failure_threshold: Annotated[
        int, typer.Option(help="Failed requests in a row that open a worker's breaker.", rich_help_panel=_FAULTS)
    ] = 3,
    breaker_cooldown: Annotated[
        float, typer.Option(help="Seconds before a tripped breaker lets a trial through.", rich_help_panel=_FAULTS)
    ] = 5.0,
    shutdown_timeout: Annotated[
        int,
        typer.Option(
            help="On SIGTERM the router takes no new connections and lets streams in flight finish, for at most "
            "this many seconds.",
            rich_help_panel=_FAULTS,
        ),
    ] = 30,
    stream_migration: Annotated[
        bool,
        typer.Option(help="Resume a stream whose worker fails mid-answer on another worker.", rich_help_panel=_FAULTS),
    ] = True,
    max_concurrent_requests: Annotated[
        int | None,
        typer.Option(
            help="Client requests handled at once; as many more wait for a slot, the rest get a 429 "
            "(default: no bound).",
            rich_help_panel=_FAULTS,
        ),
    ] = None,
    queue_timeout: Annotated[
        float,
        typer.Option(
            help="Seconds a request past --max-concurrent-requests waits for a slot before its 429.",
            rich_help_panel=_FAULTS,
        ),
    ] = 10.0,
    api_key: Annotated[
        list[str] | None,
        typer.Option(
            help="A client key /v1/* requires as 'Authorization: Bearer KEY' (repeatable). Also read from "
            "SPLITSERVE_API_KEY and VLLM_API_KEY. Without one, /v1/* is open."
        ),
    ] = None,
    salt_per_api_key: Annotated[
        bool,
        typer.Option(
            help="Make each client key a cache tenant: the router sets each request's cache_salt from its key "
            "(then the request's own cache_salt), so no key shares cached prefixes with another.",
            envvar="SPLITSERVE_SALT_PER_API_KEY",
        ),
    ] = False,
    cluster_secret_file: Annotated[
        str | None,
        typer.Option(
            help="A file holding the cluster secret, sent to workers in place of the client's key (default: the "
            "SPLITSERVE_CLUSTER_SECRET environment variable)."
        ),
    ] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
) -> None:
    """Route OpenAI requests over workers: roundrobin, session, prefixaware or kvaware (no torch)."""
    from splitserve import auth
    from splitserve.config import RouterConfig

    try:
        api_keys = auth.api_keys(api_key or (), (auth.API_KEY_ENV, auth.VLLM_API_KEY_ENV))
        secret = auth.cluster_secret(cluster_secret_file)
    except ValueError as exc:
        _fail(str(exc))
    config = RouterConfig(
        api_keys=api_keys,
        salt_per_api_key=salt_per_api_key,
        cluster_secret=secret,
        model=model,
        host=host,
        port=port,
        admin_host=admin_host,
        admin_port=admin_port,
        backends=tuple(backend or ()),
        prefill=tuple(prefill or ()),
        decode=tuple(decode or ()),
        routing_strategy=routing_strategy,
        routing_threshold=routing_threshold,
        pd_decision=pd_decision,
        session_key=session_key.lower(),
        block_size=block_size,
        kv_chunk_size=kv_chunk_size,
        prefix_index_max_blocks=prefix_index_max_blocks,
        kv_index_max_blocks=kv_index_max_blocks,
        l2_weight=kv_l2_weight,
        backend_kind=backend_kind,
        vllm_kv_events_port=vllm_kv_events_port,
        vllm_kv_replay_port=vllm_kv_replay_port,
        routing_cost_model=routing_cost_model,
        cache_threshold=cache_threshold,
        balance_abs_threshold=balance_abs_threshold,
        balance_rel_threshold=balance_rel_threshold,
        health_interval_s=health_interval,
        health_failure_threshold=health_failure_threshold,
        connect_timeout_s=connect_timeout,
        read_timeout_s=read_timeout,
        max_retries=max_retries,
        breaker_failure_threshold=breaker_failure_threshold,
        breaker_cooldown_s=breaker_cooldown,
        stream_migration=stream_migration,
        max_concurrent_requests=max_concurrent_requests,
        queue_timeout_s=queue_timeout,
        shutdown_timeout_s=shutdown_timeout,
    )
    if log_level.lower() not in ("critical", "error", "warning", "info", "debug"):
        _fail(f"--log-level must be one of debug, info, warning, error; got {log_level!r}")
    try:
        config.validate()
    except ValueError as exc:
        _fail(str(exc))
    from splitserve.router.run import run_router

    raise typer.Exit(run_router(config, log_level.lower()))


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


def _parse_size(flag: str, text: str) -> int:
    from splitserve.config import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        _fail(f"{flag}: {exc}")


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
def plan_command(
    file: Annotated[Path, typer.Option("--file", "-f", help="The InferenceEndpointConfig resource file.")],
    workload: Annotated[
        str, typer.Option(help="chat, rag, mixed or long-context (shapes and rates: docs/planner.md).")
    ] = "chat",
    trace: Annotated[
        Path | None, typer.Option(help="A JSON-lines trace instead: arrival_s, prompt_tokens, output_tokens, ...")
    ] = None,
    rate: Annotated[float | None, typer.Option(help="Requests/s (default: the workload's).")] = None,
    num_requests: Annotated[int, typer.Option(help="Requests of the generated workload.")] = 400,
    seed: Annotated[int, typer.Option(help="Seed of the generated workload.")] = 0,
    slo: Annotated[
        str | None, typer.Option(help="ttft_p99=2s,itl_p99=200ms (default: the workload's, see docs/planner.md).")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Write the resource with the pick here.")] = None,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Write candidates, pick and calibration here.")
    ] = None,
    recalibrate: Annotated[bool, typer.Option(help="Measure again, ignoring the cached calibration.")] = False,
    thresholds: Annotated[str, typer.Option(help="routingThreshold values to try, comma-separated.")] = (
        "512,1024,2048,4096"
    ),
    strategies: Annotated[
        str, typer.Option(help="Routing strategies to try, comma-separated.")
    ] = "roundrobin,session,prefixaware,kvaware",
    verify: Annotated[
        bool,
        typer.Option(help="Bring up the pick (and the resource as written) locally, replay the workload, compare."),
    ] = False,
    verify_dir: Annotated[
        Path | None, typer.Option(help="Where --verify keeps resources, logs and results (default: a temp dir).")
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option(help="PNG: candidates; with --verify predicted against measured; with --sweep-rates the curves."),
    ] = None,
    sweep_rates: Annotated[
        str | None, typer.Option(help="Predict at each of these rates (comma-separated) and state the crossover.")
    ] = None,
    sweep_prompt_tokens: Annotated[
        str | None,
        typer.Option(help="Predict with every prompt this long, for each length (comma-separated): the crossover."),
    ] = None,
) -> None:
    """Measure this machine, predict every layout the resource's cores allow, and recommend one."""
    from splitserve.endpoint import EndpointError

    try:
        from splitserve.planner.command import PlanOptions, parse_choices, run_plan
        from splitserve.planner.workload import WorkloadShape

        options = PlanOptions(
            file=file,
            workload=parse_choices("--workload", workload, WorkloadShape)[0],
            trace=trace,
            rate=rate,
            num_requests=num_requests,
            seed=seed,
            slo=slo,
            out=out,
            json_path=json_path,
            recalibrate=recalibrate,
            thresholds=parse_choices("--thresholds", thresholds, int),
            strategies=parse_choices("--strategies", strategies, RoutingStrategy),
            verify=verify,
            verify_dir=verify_dir,
            plot=plot,
            sweep_rates=parse_choices("--sweep-rates", sweep_rates, float) if sweep_rates else (),
            sweep_prompt_tokens=parse_choices("--sweep-prompt-tokens", sweep_prompt_tokens, int)
            if sweep_prompt_tokens
            else (),
        )
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

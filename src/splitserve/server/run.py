"""Run one worker: log its config, bind the HTTP server at once, load the engine in the background.

``/health`` answers 503 while the model loads and 200 once it is ready. If loading fails the process exits
with status 1 (a supervisor restarts it). Ctrl-C / SIGTERM stop uvicorn, whose shutdown stops the engine.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict

import uvicorn

from splitserve.auth import bearer_header, warn_if_open
from splitserve.config import EngineConfig, Role, ServerConfig, redact_url
from splitserve.engine.async_engine import AsyncEngine, EngineCore
from splitserve.kv_events import KVEventPublisher
from splitserve.metrics import WorkerMetrics
from splitserve.model.kernels import loaded_cpu_info
from splitserve.server.app import build_app

logger = logging.getLogger("splitserve.worker")

PD_ROLE_NAMES = {Role.COLOCATED: "colocated", Role.PREFILL: "sender", Role.DECODE: "receiver"}
LOG_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"


def served_model_name(config: EngineConfig) -> str:
    return config.model.served_model_name or config.model.model


def startup_config(engine_config: EngineConfig, server_config: ServerConfig) -> dict[str, object]:
    """The one-line summary logged at start; ``pd_role`` is the KV-transfer role, as LMCache reports it."""
    return {
        "model": engine_config.model.model,
        "served_model_name": served_model_name(engine_config),
        "role": server_config.role.value,
        "pd_role": PD_ROLE_NAMES[server_config.role],
        "host": server_config.host,
        "port": server_config.port,
        **{f"model.{k}": v for k, v in asdict(engine_config.model).items() if k != "model"},
        **{f"cache.{k}": v for k, v in asdict(engine_config.cache).items()},
        **{f"scheduler.{k}": v for k, v in asdict(engine_config.scheduler).items()},
        **{f"kv_tiers.{k}": v for k, v in asdict(engine_config.kv_tiers).items() if k != "l2_url"},
        "kv_tiers.l2_url": redact_url(engine_config.kv_tiers.l2_url),
    }


def run_worker(engine_config: EngineConfig, server_config: ServerConfig, log_level: str = "info") -> int:
    """Serve until stopped; returns the process exit status (0, or 1 if the engine failed)."""
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    logger.info("Starting worker with config: %s", startup_config(engine_config, server_config))
    warn_if_open("worker", server_config.api_keys, server_config.cluster_secret)
    events = _event_publisher(engine_config, server_config)
    metrics = WorkerMetrics(served_model_name(engine_config), cpu_info=loaded_cpu_info)
    load = lambda: _load_engine(engine_config, server_config.role, events)  # noqa: E731
    engine = AsyncEngine(load, metrics, max_queued=server_config.max_queued_requests)
    app = build_app(engine, server_config)
    uv_config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_level=log_level,
        timeout_graceful_shutdown=5,
        access_log=log_level == "debug",
    )
    server = uvicorn.Server(uv_config)
    failed = threading.Event()
    threading.Thread(target=_exit_if_load_fails, args=(engine, server, failed), daemon=True).start()
    if events is not None:
        events.start()
    try:
        server.run()
    finally:
        if events is not None:
            events.close()
    return 1 if failed.is_set() else 0


def _event_publisher(engine_config: EngineConfig, server_config: ServerConfig) -> KVEventPublisher | None:
    """The KV event publisher ``--kv-events-url`` asks for; it registers the worker as soon as it starts."""
    if server_config.kv_events_url is None:
        return None
    meta = {
        "model": served_model_name(engine_config),
        "role": server_config.role.value,
        "block_size": engine_config.cache.block_size,
        "chunk_size": engine_config.kv_tiers.kv_chunk_size,
        "prefix_caching": engine_config.cache.enable_prefix_caching,
        "l1_cache": engine_config.kv_tiers.l1_cache,
        "l2_backend": engine_config.kv_tiers.l2_backend.value,
    }
    url, name = server_config.kv_events_url, server_config.name
    return KVEventPublisher(url, name, server_config.url, meta, headers=bearer_header(server_config.cluster_secret))


def _load_engine(config: EngineConfig, role: Role, events: KVEventPublisher | None) -> EngineCore:
    from splitserve.worker.build import build_engine  # torch: imported on the engine thread, after binding

    return build_engine(config, role, events)


def _exit_if_load_fails(engine: AsyncEngine, server: uvicorn.Server, failed: threading.Event) -> None:
    """Wait for the engine to load; if it failed instead, stop the server so the process exits."""
    engine.wait_settled()
    if engine.error is not None and not server.should_exit:
        logger.error("the engine failed to start; exiting: %s", engine.error.__cause__ or engine.error)
        failed.set()
        server.should_exit = True

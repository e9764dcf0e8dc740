"""Run one worker: log its config, bind the HTTP server at once, load the engine in the background.

``/health`` answers 503 while the model loads and 200 once it is ready. If loading fails, or the engine
thread dies later, the process exits with status 1 (a supervisor restarts it).

SIGTERM drains: ``/health`` answers 503 ``draining``, new requests get a 503 ``draining`` (a router sends them
elsewhere), and requests in flight run to their end, for at most ``--shutdown-timeout`` seconds; then the
server stops, cutting what is left (a router resumes those streams on another worker). A second SIGTERM, or
Ctrl-C, stops at once.
"""

from __future__ import annotations

import gc
import logging
import signal
import threading
import time
from dataclasses import asdict
from types import FrameType

import uvicorn

from splitserve import tracing
from splitserve.auth import bearer_header, warn_if_open
from splitserve.config import EngineConfig, Role, ServerConfig, redact_url
from splitserve.engine.async_engine import AsyncEngine, EngineCore
from splitserve.httpserver import uvicorn_options
from splitserve.metrics import WorkerMetrics
from splitserve.model.kernels import loaded_cpu_info
from splitserve.policy.admission import AdmissionLimits
from splitserve.worker.app import build_app
from splitserve.worker.kv_events import KVEventLog, KVEventPublisher
from splitserve.worker.vllm_publisher import VLLMEventPublisher

logger = logging.getLogger("splitserve.worker")

PD_ROLE_NAMES = {Role.COLOCATED: "colocated", Role.PREFILL: "sender", Role.DECODE: "receiver"}
LOG_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"


def served_model_name(config: EngineConfig) -> str:
    return config.model.served_model_name or config.model.model


_NOT_LOGGED = ("l2_url", "l2_password")  # the URL is logged redacted; a password never


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
        **{f"kv_tiers.{k}": v for k, v in asdict(engine_config.kv_tiers).items() if k not in _NOT_LOGGED},
        "kv_tiers.l2_url": redact_url(engine_config.kv_tiers.l2_url),
    }


def admission_limits(config: ServerConfig) -> AdmissionLimits:
    """The worker's admission bounds (``policy.admission``), from its settings."""
    return AdmissionLimits(
        max_waiting=config.max_queued_requests,
        max_in_flight=config.max_num_queued_reqs,
        max_prefill_tokens=config.max_num_queued_tokens,
        max_queue_delay_s=config.max_queue_delay_s,
    )


def run_worker(engine_config: EngineConfig, server_config: ServerConfig, log_level: str = "info") -> int:
    """Serve until stopped; returns the process exit status (0, or 1 if the engine failed)."""
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    logger.info("Starting worker with config: %s", startup_config(engine_config, server_config))
    warn_if_open("worker", server_config.api_keys, server_config.cluster_secret)
    events = _event_log(engine_config, server_config)  # pulled from GET /kv/events; pushed with --kv-events-url
    vllm_events = _vllm_event_publisher(engine_config, server_config, events)  # --kv-events-config
    publisher = None
    if server_config.kv_events_url is not None:
        headers = bearer_header(server_config.cluster_secret)
        publisher = KVEventPublisher(server_config.kv_events_url, events, headers=headers)
    metrics = WorkerMetrics(served_model_name(engine_config), cpu_info=loaded_cpu_info)
    load = lambda: _load_engine(engine_config, server_config.role, events, server_config.cluster_secret)  # noqa: E731
    engine = AsyncEngine(load, metrics, limits=admission_limits(server_config))
    draining = threading.Event()
    tracing.configure(server_config.otlp_traces_endpoint, "splitserve-worker", server_config.name)
    app = tracing.with_tracing(build_app(engine, server_config, draining, events))
    uv_config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_level=log_level,
        timeout_graceful_shutdown=FLUSH_S,
        **uvicorn_options(),  # limits against slow and greedy clients
        access_log=log_level == "debug",
    )
    server = DrainingServer(uv_config, engine, draining, server_config.shutdown_timeout_s)
    failed = threading.Event()
    threading.Thread(target=_exit_when_engine_stops, args=(engine, server, failed), daemon=True).start()
    if publisher is not None:
        publisher.start()
    if vllm_events is not None:
        vllm_events.start()
    try:
        server.run()
    finally:
        if publisher is not None:
            publisher.close()
        if vllm_events is not None:
            vllm_events.close()
        tracing.shutdown()
    return 1 if failed.is_set() else 0


def _event_log(engine_config: EngineConfig, server_config: ServerConfig) -> KVEventLog:
    """What the worker's caches hold, for routers: they pull it (``GET /kv/events``), or it is pushed to
    ``--kv-events-url``."""
    meta = {
        "model": served_model_name(engine_config),
        "role": server_config.role.value,
        "block_size": engine_config.cache.block_size,
        "chunk_size": engine_config.kv_tiers.kv_chunk_size,
        "prefix_caching": engine_config.cache.enable_prefix_caching,
        "l1_cache": engine_config.kv_tiers.l1_cache,
        "l2_backend": engine_config.kv_tiers.l2_backend.value,
    }
    return KVEventLog(server_config.name, server_config.url, meta)


def _vllm_event_publisher(
    engine_config: EngineConfig, server_config: ServerConfig, events: KVEventLog
) -> VLLMEventPublisher | None:
    """The engine's KV events in vLLM's format over ZMQ, when ``--kv-events-config`` enables them."""
    config = server_config.kv_events_config
    if config is None or not config.is_enabled:
        return None
    publisher = VLLMEventPublisher(config, engine_config.cache.block_size)
    events.add_listener(publisher)
    return publisher


def _load_engine(config: EngineConfig, role: Role, events: KVEventLog, secret: str | None) -> EngineCore:
    from splitserve.worker.build import build_engine  # torch: imported on the engine thread, after binding

    engine = build_engine(config, role, events, secret)
    # What loading left (the tokenizer's tables, the model's modules) lives as long as the worker: moved out of
    # the collector's generations, a full collection during serving no longer walks it (as vLLM freezes its heap
    # after start-up); on a Zen 4, 1.5% of a cold prefill's samples were the collector. The worker's own start
    # only: a process that builds and closes engines (the planner, the tests) must keep collecting them.
    gc.collect()
    gc.freeze()
    return engine


FLUSH_S = 2  # after the drain, for the last bytes of finished answers to go out


class DrainingServer(uvicorn.Server):
    """uvicorn's server, except that the first SIGTERM drains (see the module's doc) before it stops."""

    def __init__(
        self, config: uvicorn.Config, engine: AsyncEngine, draining: threading.Event, timeout_s: float
    ) -> None:
        super().__init__(config)
        self.engine = engine
        self.draining = draining
        self.timeout_s = timeout_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self.draining.is_set() or self.should_exit:
            super().handle_exit(sig, frame)
            return
        self.draining.set()
        logger.info(
            "SIGTERM: draining; %d requests in flight, at most %.0f s", self.engine.num_in_flight, self.timeout_s
        )
        threading.Thread(target=self._drain, name="drain", daemon=True).start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while self.engine.num_in_flight and time.monotonic() < deadline and not self.should_exit:
            time.sleep(0.05)
        if self.engine.num_in_flight:
            logger.warning("drain deadline passed: cutting %d requests in flight", self.engine.num_in_flight)
        else:
            logger.info("drained: no request in flight; stopping")
        self.should_exit = True


def _exit_when_engine_stops(engine: AsyncEngine, server: uvicorn.Server, failed: threading.Event) -> None:
    """Wait for the engine to load, then for its thread to end; if it failed (to load, or later) while the
    server was not stopping anyway, stop the server so the process exits with status 1."""
    engine.wait_settled()
    if engine.error is None:
        engine.join()
    if engine.error is not None and not server.should_exit:
        what = "failed to start" if not engine.was_ready else "thread died"
        logger.error("the engine %s; exiting: %s", what, engine.error.__cause__ or engine.error)
        failed.set()
        server.should_exit = True

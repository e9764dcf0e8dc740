"""Run the router: build it (``router/build.py``, the tokenizer too where its policy needs one), serve its public
and admin apps until stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Coroutine, Iterator
from typing import Any

import uvicorn

from splitserve import envs, tracing
from splitserve.auth import warn_if_open
from splitserve.config import RouterConfig
from splitserve.httpserver import uvicorn_options
from splitserve.router.app import build_admin_app, build_router_app
from splitserve.router.build import build_router, load_tokenize

logger = logging.getLogger("splitserve.router")

LOG_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"


def run_router(config: RouterConfig, log_level: str = "info") -> int:
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    router = build_router(config, load_tokenize(config))
    warn_if_open("router", config.api_keys, config.cluster_secret)
    if config.api_keys and not config.cluster_secret:
        logger.warning(
            "the router requires client keys but has no cluster secret (%s): it forwards requests without "
            "credentials, so workers that require a key will refuse them", envs.CLUSTER_SECRET.name,
        )  # fmt: skip
    logger.info(
        "router on %s:%d, strategy %s, workers %s%s",
        config.host, config.port, config.routing_strategy.value, ", ".join(w.url for w in router.pool),
        f", disaggregation decided by {config.pd_decision.value}" if config.decode else "",
    )  # fmt: skip
    admin_socket = _admin_socket(config)
    logger.info("admin routes (/admin/*) on %s:%d", config.admin_host, admin_socket.getsockname()[1])
    tracing.configure(config.otlp_traces_endpoint, "splitserve-router", f"{config.host}:{config.port}")
    public = uvicorn.Server(
        uvicorn.Config(
            tracing.with_tracing(build_router_app(router, with_admin=False)),
            host=config.host,
            port=config.port,
            log_level=log_level,
            access_log=False,
            timeout_graceful_shutdown=config.shutdown_timeout_s,  # SIGTERM: no new connections, streams run on
            **uvicorn_options(),  # limits against slow and greedy clients
        )
    )
    admin = _FollowerServer(
        uvicorn.Config(
            build_admin_app(router),
            host=config.admin_host,
            port=config.admin_listen_port,
            log_level=log_level,
            access_log=False,
            lifespan="off",
            **uvicorn_options(),
        )
    )
    try:
        run_event_loop(_serve_both(public, admin, admin_socket))
    finally:
        tracing.shutdown()
    return 0


def run_event_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run ``main`` on uvloop where it is installed (a dependency everywhere but Windows), else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


def _admin_socket(config: RouterConfig) -> socket.socket:
    """The admin listener's socket: ``--admin-port``, else the port after ``--port``, else (taken) any free
    port, with a warning naming it. An explicit ``--admin-port`` that is taken stops the router."""
    family = socket.AF_INET6 if ":" in config.admin_host else socket.AF_INET
    try:
        return socket.create_server((config.admin_host, config.admin_listen_port), family=family)
    except OSError as exc:
        if config.admin_port is not None:
            raise SystemExit(f"the admin listener cannot bind {config.admin_host}:{config.admin_port}: {exc}") from None
        try:
            sock = socket.create_server((config.admin_host, 0), family=family)
        except OSError as again:
            raise SystemExit(f"the admin listener cannot bind {config.admin_host}: {again}") from None
        logger.warning(
            "port %d (--port + 1) is taken: admin routes on %s:%d instead; pass --admin-port to choose",
            config.admin_listen_port, config.admin_host, sock.getsockname()[1],
        )  # fmt: skip
        return sock


class _FollowerServer(uvicorn.Server):
    """A server that leaves the signals to another one (two ``capture_signals`` would override each other)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _serve_both(public: uvicorn.Server, admin: _FollowerServer, admin_socket: socket.socket) -> None:
    """Serve the public and the admin listener; the admin one stops when the public one has (SIGTERM, SIGINT)."""
    admin_task = asyncio.create_task(admin.serve(sockets=[admin_socket]))
    try:
        await public.serve()
    finally:
        admin.should_exit = True
        await admin_task

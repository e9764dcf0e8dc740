"""An in-process router in front of fake-engine workers, and a completion request to it: over real HTTP
(``start_router``, with ``FakeWorker`` and ``EventfulWorker``, whose KV event log it serves), or with no socket
at all (``start_router_in_memory``, with ``MemoryWorker`` apps behind an in-memory transport)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from contextlib import ExitStack
from typing import Any

import httpx
from starlette.testclient import TestClient
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splitserve.config import RouterConfig
from splitserve.engine.async_engine import AsyncEngine
from splitserve.metrics import WorkerMetrics
from splitserve.router.app import Router, build_router_app
from splitserve.router.build import build_router
from splitserve.router.tokens import prompt_token_ids
from splitserve.worker.app import build_app
from splitserve.worker.kv_events import KVEventLog
from tests.support.fake_engine import FakeEngine, FakeTokenizer, ServerThread
from tests.support.transport import InMemoryTransport
from tests.support.waiting import wait_until

MODEL = "fake-model"


class FakeWorker:
    def __init__(self, stack: ExitStack) -> None:
        self.engine = FakeEngine(step_delay_s=0.001)
        self.server = stack.enter_context(
            ServerThread(build_app(AsyncEngine(lambda: self.engine, WorkerMetrics(MODEL))))
        )
        wait_until(lambda: httpx.get(f"{self.server.url}/health").status_code == 200)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def num_requests(self) -> int:
        return len(self.engine.added_ids)


class EventfulWorker:
    """A fake-engine worker serving ``GET /kv/events`` from its own log (as every splitserve worker does)."""

    def __init__(self, stack: ExitStack, name: str) -> None:
        self.engine = FakeEngine()
        self.log = KVEventLog(name, "unused", {"block_size": 16})
        app = build_app(AsyncEngine(lambda: self.engine, WorkerMetrics(MODEL)), events=self.log)
        self.server = stack.enter_context(ServerThread(app))
        self.url = self.server.url
        wait_until(lambda: httpx.get(f"{self.url}/health").status_code == 200)

    @property
    def num_requests(self) -> int:
        return len(self.engine.added_ids)


class MemoryWorker:
    """A fake-engine worker as an in-process app at ``url`` (a name: nothing listens there), for a router over
    an :class:`InMemoryTransport`. With a ``name`` it serves its KV event ``log`` at ``GET /kv/events``, as
    :class:`EventfulWorker` does; without, that route is a 404 (an older worker's, or vLLM's). Its lifespan's
    startup (run by the transport) completes once the engine is ready, as :class:`FakeWorker` waits for
    ``/health``: the router's first probe finds it healthy."""

    def __init__(self, url: str, name: str | None = None) -> None:
        self.url = url
        self.engine = FakeEngine(step_delay_s=0.001)
        self.log = KVEventLog(name or url, "unused", {"block_size": 16})
        self._async_engine = AsyncEngine(lambda: self.engine, WorkerMetrics(MODEL))
        self._app = build_app(self._async_engine, events=self.log if name is not None else None)

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            return await self._app(scope, receive, send)

        async def send_once_ready(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                await self._async_engine.wait_until_ready(10)
            await send(message)

        await self._app(scope, receive, send_once_ready)

    @property
    def num_requests(self) -> int:
        return len(self.engine.added_ids)


def router_config(backends: list[str], **options: Any) -> RouterConfig:
    return RouterConfig(model=MODEL, backends=tuple(backends), **({"health_interval_s": 0.2} | options))


TOKENIZE = functools.partial(prompt_token_ids, FakeTokenizer())


def start_router(stack: ExitStack, backends: list[str], **options: Any) -> tuple[Router, httpx.Client]:
    router = build_router(router_config(backends, **options), TOKENIZE)
    server = stack.enter_context(ServerThread(build_router_app(router)))
    client = stack.enter_context(httpx.Client(base_url=server.url, timeout=10))
    return router, client


def start_router_in_memory(
    stack: ExitStack, backends: list[str], apps: Mapping[str, ASGIApp], *, probe: bool = True, **options: Any
) -> tuple[Router, TestClient]:
    """The router over ``backends`` with no socket: ``apps`` answer for their URLs (one without an app is a dead
    worker), and the client reaches the router through Starlette's in-process test client. ``probe`` off: no
    health probes or scrapes (a test that sets workers' health itself)."""
    transport = InMemoryTransport(apps)
    router = build_router(router_config(backends, **options), TOKENIZE, transport=transport)
    client = stack.enter_context(TestClient(build_router_app(router, probe=probe)))
    return router, client


def completion(client: httpx.Client | TestClient, prompt: Any = "Hello", **extra: Any) -> Any:
    """The answer to a small completion request (an httpx response, or the test client's)."""
    return client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3, **extra})

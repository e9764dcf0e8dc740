"""An in-process router over real HTTP in front of fake-engine workers (``FakeWorker``, and ``EventfulWorker``
with a KV event log), and a completion request to it."""

from __future__ import annotations

import functools
from contextlib import ExitStack
from typing import Any

import httpx

from splitserve.config import RouterConfig
from splitserve.engine.async_engine import AsyncEngine
from splitserve.kv_events import KVEventLog
from splitserve.metrics import WorkerMetrics
from splitserve.router.app import Router, build_router_app
from splitserve.router.tokens import prompt_token_ids
from splitserve.server.app import build_app
from tests.support.fake_engine import FakeEngine, FakeTokenizer, ServerThread
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


def start_router(stack: ExitStack, backends: list[str], **options: Any) -> tuple[Router, httpx.Client]:
    config = RouterConfig(model=MODEL, backends=tuple(backends), **({"health_interval_s": 0.2} | options))
    tokenize = functools.partial(prompt_token_ids, FakeTokenizer())
    router = Router(config, tokenize)
    server = stack.enter_context(ServerThread(build_router_app(router)))
    client = stack.enter_context(httpx.Client(base_url=server.url, timeout=10))
    return router, client


def completion(client: httpx.Client, prompt: Any = "Hello", **extra: Any) -> httpx.Response:
    return client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3, **extra})

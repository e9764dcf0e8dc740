"""The router in front of fake-engine workers: proxying, retries, breaker, errors, KV events. No socket: the
workers are in-process apps behind the in-memory transport, and the client reaches the router through
Starlette's test client."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from splitserve import __version__
from splitserve.config import RoutingStrategy
from splitserve.keys import hash_blocks
from tests.support.router import MODEL, MemoryWorker, completion, start_router_in_memory
from tests.support.transport import no_sockets
from tests.support.waiting import wait_until

DEAD = "http://dead-worker:8000"  # no app: the connection is refused


@pytest.fixture(autouse=True)
def _no_sockets(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with no_sockets(monkeypatch):
        yield


@pytest.fixture
def workers() -> list[MemoryWorker]:
    return [MemoryWorker("http://worker-0:8000"), MemoryWorker("http://worker-1:8000")]


@pytest.fixture
def apps(workers: list[MemoryWorker]) -> dict[str, ASGIApp]:
    return {w.url: w.app for w in workers}


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def test_roundrobin_proxies_every_kind_of_request_over_both_workers(
    workers: list[MemoryWorker], apps: dict[str, ASGIApp], stack: ExitStack
) -> None:
    before = [w.num_requests for w in workers]
    _, client = start_router_in_memory(stack, [w.url for w in workers], apps)
    for _ in range(2):
        r = completion(client)
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert client.post("/v1/chat/completions", json=chat).json()["object"] == "chat.completion"
    with client.stream("POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 4
    assert [w.num_requests - b for w, b in zip(workers, before, strict=True)] in ([3, 2], [2, 3])
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert client.get("/health").status_code == 200
    text = client.get("/metrics").text
    assert "splitserve:router_routing_decisions_total" in text and "splitserve:e2e_time_to_first_token_seconds" in text


def test_sagemaker_routes_tokenizer_routes_and_version(
    workers: list[MemoryWorker], apps: dict[str, ASGIApp], stack: ExitStack
) -> None:
    _, client = start_router_in_memory(stack, [DEAD, workers[0].url], apps, health_interval_s=60)
    for method in ("GET", "POST"):
        assert client.request(method, "/ping").status_code == 200
    chat = client.post("/invocations", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion", chat.text
    completion = client.post("/invocations", json={"prompt": "Hi", "max_tokens": 2, "stream": True})
    assert completion.status_code == 200 and completion.text.rstrip().endswith("data: [DONE]")
    assert '"object":"text_completion"' in completion.text
    shapeless = client.post("/invocations", json={"max_tokens": 2})
    assert shapeless.status_code == 400 and "'messages'" in shapeless.json()["error"]["message"]
    assert client.post("/invocations", json={"prompt": "x", "bogus": 1}).status_code == 400  # the worker's 400
    tokens = client.post("/tokenize", json={"prompt": "Hi"})  # the dead worker is passed over
    assert tokens.status_code == 200 and tokens.json()["tokens"] == [72, 105]
    assert client.post("/detokenize", json={"tokens": [72, 105]}).json() == {"prompt": "Hi"}
    assert client.post("/detokenize", json={"tokens": [999]}).status_code == 400
    assert client.get("/version").json() == {"version": __version__}


def test_ping_is_503_without_a_worker(stack: ExitStack) -> None:
    _, client = start_router_in_memory(stack, [DEAD], {})
    wait_until(lambda: client.get("/ping").status_code == 503)
    assert client.post("/tokenize", json={"prompt": "Hi"}).status_code == 503


@pytest.mark.parametrize(
    ("method", "path", "content", "status"),
    [
        ("POST", "/v1/completions", b"{not json", 400),
        ("POST", "/v1/completions", b"[1, 2]", 400),
        ("GET", "/v1/nothing", b"", 404),
        ("GET", "/v1/completions", b"", 405),
    ],
)
def test_client_mistakes_get_openai_errors(
    workers: list[MemoryWorker],
    apps: dict[str, ASGIApp],
    stack: ExitStack,
    method: str,
    path: str,
    content: bytes,
    status: int,
) -> None:
    _, client = start_router_in_memory(stack, [workers[0].url], apps)
    r = client.request(method, path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status
    assert r.json()["error"]["message"]


def test_a_worker_4xx_is_passed_back_not_retried(
    workers: list[MemoryWorker], apps: dict[str, ASGIApp], stack: ExitStack
) -> None:
    router, client = start_router_in_memory(stack, [w.url for w in workers], apps)
    r = completion(client, max_tokens=-1)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    assert all(w.breaker.allows() for w in router.pool)
    assert "splitserve:router_retries_total{" not in client.get("/metrics").text


def test_a_dead_worker_is_skipped_by_retries_and_its_breaker_opens(
    workers: list[MemoryWorker], apps: dict[str, ASGIApp], stack: ExitStack
) -> None:
    dead = DEAD
    router, client = start_router_in_memory(
        stack, [dead, workers[0].url], apps, probe=False, breaker_failure_threshold=2
    )
    router.pool.get(dead).healthy = True  # type: ignore[union-attr]  # as if it had just died
    for _ in range(6):
        assert completion(client).status_code == 200
    assert not router.pool.get(dead).breaker.allows()  # type: ignore[union-attr]
    assert 'splitserve:router_retries_total{reason="connect"} 2.0' in client.get("/metrics").text


def test_no_worker_at_all_is_a_503_with_an_openai_error(stack: ExitStack) -> None:
    _, client = start_router_in_memory(stack, [DEAD], {})
    r = completion(client)
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "no_worker_available"
    assert client.get("/health").status_code == 503


def test_an_overloaded_worker_answer_is_retried_elsewhere(
    workers: list[MemoryWorker], apps: dict[str, ASGIApp], stack: ExitStack
) -> None:
    async def overloaded(_: Any) -> JSONResponse:
        return JSONResponse({"error": {"message": "busy"}}, status_code=503)

    async def healthy(_: Any) -> JSONResponse:
        return JSONResponse({})

    busy_app = Starlette(routes=[Route("/v1/completions", overloaded, methods=["POST"]), Route("/health", healthy)])
    busy = "http://busy-worker:8000"
    _, client = start_router_in_memory(stack, [busy, workers[1].url], apps | {busy: busy_app})
    for _ in range(4):
        assert completion(client).status_code == 200
    _, only_busy = start_router_in_memory(stack, [busy], {busy: busy_app})
    r = completion(only_busy)
    assert r.status_code == 503 and r.json()["error"]["message"] == "busy"  # the worker's own answer


def test_kv_events_register_workers_and_kvaware_follows_them(
    workers: list[MemoryWorker], apps: dict[str, ASGIApp], stack: ExitStack
) -> None:
    kvaware = RoutingStrategy.KVAWARE
    router, client = start_router_in_memory(stack, [w.url for w in workers], apps, routing_strategy=kvaware)
    batch = {"worker_id": "b", "worker_url": workers[1].url, "events": []}
    assert client.post("/kv/events", json=batch).status_code == 409  # never registered
    assert client.post("/kv/events", json={"worker_id": "b"}).status_code == 400
    prompt = list(range(1, 70))  # 4 full blocks of 16
    held = {"tier": "engine", "kind": "stored", "hashes": hash_blocks(prompt, 16)}
    assert client.post("/kv/events", json=batch | {"reset": True, "events": [held]}).status_code == 200
    assert client.post("/kv/events", json=batch).status_code == 200
    assert router.pool.get(workers[1].url).worker_id == "b"  # type: ignore[union-attr]
    before = [w.num_requests for w in workers]
    for _ in range(3):
        assert completion(client, prompt=[*prompt, 99]).status_code == 200
    assert [w.num_requests - b for w, b in zip(workers, before, strict=True)] == [0, 3]
    assert (
        'splitserve:router_routing_decisions_total{outcome="matched",strategy="kvaware"} 3.0'
        in client.get("/metrics").text
    )


def test_the_worker_list_can_be_replaced_while_serving(
    workers: list[MemoryWorker], apps: dict[str, ASGIApp], stack: ExitStack
) -> None:
    router, client = start_router_in_memory(stack, [workers[0].url], apps)
    assert completion(client).status_code == 200
    kept = router.pool.get(workers[0].url)
    r = client.put("/admin/workers", json={"backend": [workers[0].url, workers[1].url]})
    assert r.status_code == 200 and [w["url"] for w in r.json()["workers"]] == [workers[0].url, workers[1].url]
    assert router.pool.get(workers[0].url) is kept  # its state stays
    before = workers[1].num_requests
    for _ in range(4):
        assert completion(client).status_code == 200
    assert workers[1].num_requests - before == 2
    assert client.put("/admin/workers", json={"backend": "x"}).status_code == 400
    assert client.put("/admin/workers", json={"decode": [workers[1].url]}).status_code == 400  # mode change
    assert client.get("/admin/workers").json()["workers"][1]["breaker"] == "closed"

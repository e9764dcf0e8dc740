"""The router with an in-memory transport: no socket anywhere (the client reaches the app through Starlette's
in-process test client, the router reaches its workers through :class:`FakeTransport`). Retries, the three
kinds of answer, and a stream resumed on another worker, as the real transport's tests show them over HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from splitserve.config import RouterConfig, RoutingStrategy
from splitserve.router.app import Router, build_router_app
from splitserve.router.build import build_router
from tests.support.transport import FakeTransport, FakeUpstream, completion_chunk, sse

A, B = "http://worker-a:8000", "http://worker-b:8000"


@pytest.fixture
def stack() -> Iterator[list[Any]]:
    clients: list[TestClient] = []
    yield clients
    for client in clients:
        client.__exit__(None, None, None)


def start(stack: list[Any], transport: FakeTransport, **options: Any) -> tuple[Router, TestClient]:
    roundrobin = RoutingStrategy.ROUNDROBIN
    config = RouterConfig(model="m", backends=(A, B), retry_backoff_s=0.001, routing_strategy=roundrobin, **options)
    router = build_router(config, transport=transport)
    client = TestClient(build_router_app(router, probe=False))
    client.__enter__()
    stack.append(client)
    return router, client


def test_a_refused_answer_is_retried_and_a_whole_one_passed_back(stack: list[Any]) -> None:
    overloaded = FakeUpstream(503, [b'{"error": {"message": "busy", "code": 503}}'], content_type="application/json")
    whole = FakeUpstream(200, [b'{"object": "text_completion", "choices": []}'], content_type="application/json")
    transport = FakeTransport({A: [overloaded], B: [whole]})
    router, client = start(stack, transport)
    answer = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert answer.status_code == 200 and answer.json()["object"] == "text_completion"
    assert [url for url, _ in transport.sent] == [f"{A}/v1/completions", f"{B}/v1/completions"]
    assert router.metrics.retries.labels("status")._value.get() == 1
    assert all(w.in_flight == 0 for w in router.pool)


def test_a_client_error_is_passed_back_at_once(stack: list[Any]) -> None:
    refused = FakeUpstream(400, [b'{"error": {"message": "bad max_tokens"}}'], content_type="application/json")
    transport = FakeTransport({A: [refused], B: []})
    _, client = start(stack, transport)
    answer = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": -1})
    assert answer.status_code == 400 and len(transport.sent) == 1


def test_no_worker_at_all_is_a_503_with_openais_body(stack: list[Any]) -> None:
    _, client = start(stack, FakeTransport({}))
    answer = client.post("/v1/completions", json={"prompt": "hi"})
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "no_worker_available"


def test_a_broken_stream_is_resumed_on_the_other_worker(stack: list[Any]) -> None:
    first = completion_chunk("H", [72], prompt_token_ids=[104, 105])
    broken = FakeUpstream(200, sse(first, completion_chunk("e", [101])), breaks=True)
    rest = FakeUpstream(200, sse(completion_chunk("y", [121]), completion_chunk("!", [33], "length"), "[DONE]"))
    transport = FakeTransport({A: [broken], B: [rest]})
    router, client = start(stack, transport)
    body = {"prompt": [104, 105], "max_tokens": 4, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as answer:
        lines = [line for line in answer.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]"
    assert "".join(e["choices"][0]["text"] for e in events) == "Hey!"
    assert {e["id"] for e in events} == {"cmpl-1"}  # the resumed chunks carry the stream's own id
    assert all("token_ids" not in e["choices"][0] for e in events)  # the client did not ask for ids
    resumed_url, resumed = transport.sent[1]
    assert resumed_url == f"{B}/v1/completions"
    assert resumed["prompt"] == [104, 105, 72, 101] and resumed["max_tokens"] == 2
    assert router.metrics.migrations.labels("resumed")._value.get() == 1
    assert broken.closed and rest.closed and all(w.in_flight == 0 for w in router.pool)

"""The router with an in-memory transport: no socket anywhere (the client reaches the app through Starlette's
in-process test client, the router reaches its workers through :class:`FakeTransport`). Retries, the three
kinds of answer, and a stream resumed on another worker, as the real transport's tests show them over HTTP."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
from starlette.testclient import TestClient

from splitserve.config import RouterConfig, RoutingStrategy
from splitserve.router.app import Router, build_router_app
from splitserve.router.transport import TransportError

A, B = "http://worker-a:8000", "http://worker-b:8000"


@dataclass
class FakeUpstream:
    status: int
    parts: list[bytes]
    breaks: bool = False  # the connection breaks after the last part
    content_type: str = "text/event-stream"
    closed: bool = False

    async def read(self) -> bytes:
        if self.breaks:
            raise TransportError("read: ClientPayloadError")
        return b"".join(self.parts)

    async def chunks(self) -> AsyncIterator[bytes]:
        for part in self.parts:
            yield part
        if self.breaks:
            raise TransportError("ClientPayloadError: the connection broke")

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeTransport:
    """Answers from scripts: per worker URL, a list of upstreams (one per request, in order); a worker with no
    script left refuses the connection. ``/detokenize`` answers with each id as a character."""

    scripts: dict[str, list[FakeUpstream]]
    sent: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> FakeUpstream:
        worker = url.rsplit("/v1/", 1)[0]
        self.sent.append((url, json.loads(body)))
        script = self.scripts.get(worker, [])
        if not script:
            raise TransportError("connect: ClientConnectorError")
        return script.pop(0)

    async def get_json(self, url: str, timeout_s: float) -> Any:
        return {"data": [{"id": "m", "max_model_len": 512}]} if url.endswith("/v1/models") else None

    async def post_json(self, url: str, body: Any, timeout_s: float) -> Any:
        return {"prompt": "".join(chr(t) for t in body["tokens"])} if url.endswith("/detokenize") else None

    async def aclose(self) -> None:
        pass


def sse(*events: dict[str, Any] | str) -> list[bytes]:
    return [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events]


def completion_chunk(text: str, ids: list[int], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "finish_reason": finish, "token_ids": ids} | extra
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}


@pytest.fixture
def stack() -> Iterator[list[Any]]:
    clients: list[TestClient] = []
    yield clients
    for client in clients:
        client.__exit__(None, None, None)


def start(stack: list[Any], transport: FakeTransport, **options: Any) -> tuple[Router, TestClient]:
    roundrobin = RoutingStrategy.ROUNDROBIN
    config = RouterConfig(model="m", backends=(A, B), retry_backoff_s=0.001, routing_strategy=roundrobin, **options)
    router = Router(config, transport=transport)
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

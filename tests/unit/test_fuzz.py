"""Fuzzing the worker's and the router's HTTP surfaces (hypothesis): whatever the body, the answer is never a
5xx, and a 4xx carries OpenAI's error body. Real uvicorn servers over a fake engine; each property sends a few
hundred bodies built from valid requests with fields dropped, mistyped or set to any JSON."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.config import RoutingStrategy
from tests.support.router import MODEL, FakeWorker, start_router

EXAMPLES = 150
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()  # NaN and infinities too: Python's JSON writes them
    | st.text(max_size=12)
)
any_json = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip
token_ids = st.lists(st.integers(min_value=-3, max_value=300), max_size=8)
text_parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}))
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]) | any_json,
        "content": st.text(max_size=20) | text_parts | any_json,
    }
)


def field(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(valid, valid, any_json)  # mostly plausible, sometimes anything


SAMPLING = {
    "model": field(st.sampled_from([MODEL, "other-model"])),
    "max_tokens": field(st.integers(min_value=-2, max_value=40)),
    "temperature": field(st.floats(min_value=-1, max_value=3)),
    "top_p": field(st.floats(min_value=-0.5, max_value=1.5)),
    "top_k": field(st.integers(min_value=-2, max_value=50)),
    "n": field(st.integers(min_value=0, max_value=3)),
    "seed": field(st.integers(min_value=-(2**65), max_value=2**65)),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "stop": field(st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3)),
    "stop_token_ids": field(token_ids),
    "min_tokens": field(st.integers(min_value=-2, max_value=10)),
    "ignore_eos": field(st.booleans()),
    "return_token_ids": field(st.booleans()),
    "kv_transfer_params": field(st.fixed_dictionaries({"transfer_id": st.text(max_size=6)})),
    "user": field(st.text(max_size=8)),
}
PROMPT = st.text(max_size=30) | token_ids | st.lists(token_ids, max_size=2)
COMPLETION_FIELDS = {
    **SAMPLING,
    "prompt": field(PROMPT),
    "echo": field(st.booleans()),
    "logprobs": field(st.integers(0, 3)),
}
COMPLETION = st.fixed_dictionaries({}, optional=COMPLETION_FIELDS)
CHAT_FIELDS = {
    **SAMPLING,
    "messages": field(st.lists(message, max_size=3)),
    "max_completion_tokens": field(st.integers(-1, 40)),
}
CHAT = st.fixed_dictionaries({}, optional=CHAT_FIELDS)
TOKENIZE_FIELDS = {
    "model": field(st.just(MODEL)),
    "prompt": field(st.text(max_size=20)),
    "messages": field(st.lists(message, max_size=2)),
    "tokens": field(token_ids),
}
TOKENIZE = st.fixed_dictionaries({}, optional=TOKENIZE_FIELDS)
EVENT = st.fixed_dictionaries(
    {
        "tier": st.sampled_from(["engine", "l1", "l2", "l9"]),
        "kind": st.sampled_from(["stored", "removed"]),
        "hashes": st.lists(st.integers(-1, 2**65), max_size=3),
    }
)
KV_EVENTS_FIELDS = {
    "worker_id": field(st.text(max_size=8)),
    "worker_url": field(st.sampled_from(["http://127.0.0.1:1", "ftp://x", "http://u:p@h:1/x"])),
    "reset": field(st.booleans()),
    "meta": any_json,
    "events": field(st.lists(EVENT, max_size=3)),
}
KV_EVENTS = st.fixed_dictionaries({}, optional=KV_EVENTS_FIELDS)
URLS = st.lists(st.sampled_from(["http://127.0.0.1:1", "not a url", "http://h:1/path"]), max_size=2)
WORKER_LISTS = st.fixed_dictionaries({}, optional={role: field(URLS) for role in ("backend", "prefill", "decode")})


def check(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]


def send(client: httpx.Client, method: str, path: str, body: Any) -> None:
    content = json.dumps(body).encode()  # NaN and Infinity included, as a careless client sends them
    response = client.request(method, path, content=content, headers={"content-type": "application/json"})
    check(response)
    if response.status_code == 200 and response.headers.get("content-type", "").startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]")


@pytest.fixture(scope="module")
def worker() -> Iterator[FakeWorker]:
    with ExitStack() as stack:
        yield FakeWorker(stack)


@pytest.fixture(scope="module")
def worker_client(worker: FakeWorker) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=worker.url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def router_client(worker: FakeWorker) -> Iterator[httpx.Client]:
    with ExitStack() as stack:
        _, client = start_router(stack, [worker.url], routing_strategy=RoutingStrategy.KVAWARE)
        yield client


@FUZZ
@given(body=COMPLETION)
def test_worker_completions(worker_client: httpx.Client, body: dict[str, Any]) -> None:
    send(worker_client, "POST", "/v1/completions", body)


@FUZZ
@given(body=CHAT)
def test_worker_chat_completions(worker_client: httpx.Client, body: dict[str, Any]) -> None:
    send(worker_client, "POST", "/v1/chat/completions", body)


@FUZZ
@given(body=TOKENIZE, path=st.sampled_from(["/tokenize", "/detokenize", "/kv/lookup"]))
def test_worker_tokenize_detokenize_and_lookup(worker_client: httpx.Client, body: dict[str, Any], path: str) -> None:
    if path == "/kv/lookup" and "tokens" in body:
        body["token_ids"] = body.pop("tokens")
    send(worker_client, "POST", path, body)


@FUZZ
@given(body=COMPLETION | CHAT, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_router_proxy(router_client: httpx.Client, body: dict[str, Any], path: str) -> None:
    send(router_client, "POST", path, body)


@FUZZ
@given(body=KV_EVENTS)
def test_router_kv_events(router_client: httpx.Client, body: dict[str, Any]) -> None:
    send(router_client, "POST", "/kv/events", body)


@FUZZ
@given(body=WORKER_LISTS | any_json)
def test_router_worker_lists(router_client: httpx.Client, worker: FakeWorker, body: Any) -> None:
    response = router_client.put("/admin/workers", content=json.dumps(body).encode())
    check(response)
    if response.status_code == 200:  # a valid list took effect: put the real worker back
        assert all(w["url"].startswith("http://") for w in response.json()["workers"])
        assert router_client.put("/admin/workers", json={"backend": [worker.url]}).status_code == 200

"""The router under hostile bodies, overload and workers that die mid-stream (fake-engine workers, real HTTP;
the body checks, which no socket changes, run in memory)."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from splitserve import httpserver
from splitserve.router.migrate import ChoiceTrack, SSEBuffer, StreamTracker, held_back_text, is_migratable, resume_body
from tests.support.fake_engine import REPLY
from tests.support.faults import FaultProxy
from tests.support.router import MODEL, FakeWorker, MemoryWorker, start_router, start_router_in_memory
from tests.support.transport import no_sockets
from tests.support.waiting import wait_until
from tests.support.workers import free_port


@pytest.fixture(scope="module")
def workers() -> Iterator[list[FakeWorker]]:
    with ExitStack() as stack:
        yield [FakeWorker(stack), FakeWorker(stack)]


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


@pytest.fixture
def in_memory(monkeypatch: pytest.MonkeyPatch) -> Iterator[MemoryWorker]:
    """A worker app behind the in-memory transport; no socket may open meanwhile."""
    with no_sockets(monkeypatch):
        yield MemoryWorker("http://worker:8000")


# ---- hostile bodies ----------------------------------------------------------------------------------------


def test_bodies_over_the_limit_are_413_declared_or_streamed(in_memory: MemoryWorker, stack: ExitStack) -> None:
    apps = {in_memory.url: in_memory.app}
    _, client = start_router_in_memory(stack, [in_memory.url], apps, max_request_body_bytes=1000)
    declared = client.post("/v1/completions", content=b"x" * 2000, headers={"content-type": "application/json"})
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "body_too_large"

    def endless() -> Iterator[bytes]:  # no content-length: chunked, and more than the limit
        for _ in range(100):
            yield b'{"pad": "' + b"x" * 500 + b'"}'

    streamed = client.post("/v1/completions", content=endless(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413
    for path, method in (("/kv/events", "POST"), ("/admin/workers", "PUT")):
        assert client.request(method, path, content=b"[" * 5000).status_code == 413
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_a_body_that_trickles_in_is_cut_off_with_a_408(
    workers: list[FakeWorker], stack: ExitStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(httpserver, "BODY_TIMEOUT_S", 0.3)
    _, client = start_router(stack, [workers[0].url])

    def slowly() -> Iterator[bytes]:
        yield b'{"prompt": '
        time.sleep(1.0)
        yield b'"Hi"}'

    r = client.post("/v1/completions", content=slowly(), headers={"content-type": "application/json"})
    assert r.status_code == 408 and "took over" in r.json()["error"]["message"]


def test_a_client_that_sends_its_headers_slowly_is_cut_off(
    workers: list[FakeWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slowloris: the server closes a connection whose request headers are not in after HEADER_TIMEOUT_S."""
    import uvicorn

    from splitserve.config import RouterConfig
    from splitserve.router.app import build_router_app
    from splitserve.router.build import build_router

    monkeypatch.setattr(httpserver, "HEADER_TIMEOUT_S", 0.5)
    router = build_router(RouterConfig(model=MODEL, backends=(workers[0].url,)))
    port = free_port()
    config = uvicorn.Config(build_router_app(router, probe=False), port=port, log_level="warning",
                            **httpserver.uvicorn_options())  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, timeout_s=10)
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and nothing more
        slow.settimeout(5)
        began = time.monotonic()
        assert slow.recv(1024) == b""  # closed by the server
        assert 0.3 < time.monotonic() - began < 3
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=10).status_code == 200
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:  # keep-alive: fresh timers
            for _ in range(2):
                assert client.get("/metrics").status_code == 200
                time.sleep(0.6)
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/kv/events"])
def test_deeply_nested_json_is_a_400_not_a_500(in_memory: MemoryWorker, stack: ExitStack, path: str) -> None:
    _, client = start_router_in_memory(stack, [in_memory.url], {in_memory.url: in_memory.app})
    r = client.post(path, content=b"[" * 200_000 + b"]" * 200_000, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "nests too deeply" in r.json()["error"]["message"]
    nested_put = client.put("/admin/workers", content=b'{"backend": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert nested_put.status_code == 400


# ---- overload ------------------------------------------------------------------------------------------------


def test_past_max_concurrent_requests_a_request_waits_then_gets_a_429(stack: ExitStack) -> None:
    slow = FakeWorker(stack)
    slow.engine.step_delay_s = 0.1  # 8 tokens: about 0.8 s
    _, client = start_router(stack, [slow.url], max_concurrent_requests=1, queue_timeout_s=0.3)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 8}

    def send(delay_s: float) -> httpx.Response:
        time.sleep(delay_s)
        return client.post("/v1/completions", json=body)

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(send, (0.0, 0.1, 0.2)))
    statuses = [a.status_code for a in answers]
    assert statuses[0] == 200 and statuses[1:] == [429, 429], statuses
    refused = answers[1]
    assert refused.headers["retry-after"] == "1" and refused.json()["error"]["code"] == "router_overloaded"
    # a wait long enough gets the slot when the running request ends; a stream holds it to its end
    _, patient = start_router(stack, [slow.url], max_concurrent_requests=1, queue_timeout_s=5)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        stream = pool.submit(lambda: patient.post("/v1/completions", json=body | {"stream": True}))
        time.sleep(0.1)
        waiting = pool.submit(lambda: patient.post("/v1/completions", json=body))
        assert stream.result().status_code == 200 and waiting.result().status_code == 200


# ---- stream migration ----------------------------------------------------------------------------------------


class DyingWorker:
    """Streams ``events`` (SSE data strings) to any POST, then drops the connection (with ``finishes``: ends the
    stream properly instead); answers /health, and /version with ``version`` when given."""

    def __init__(self, events: list[str], version: dict[str, Any] | None = None, finishes: bool = False) -> None:
        self.events = events
        self.version = version
        self.finishes = finishes
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.bodies: list[dict[str, Any]] = []
        self.paths: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            request = conn.recv(65536)
            head, _, body = request.partition(b"\r\n\r\n")
            if head.startswith(b"GET /health"):
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                return
            if head.startswith(b"GET /version") and self.version is not None:
                answer = json.dumps(self.version).encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                             b"content-length: %d\r\n\r\n%s"
                             % (len(answer), answer))  # fmt: skip
                return
            if head.startswith(b"GET "):  # /version, /metrics...: a worker that has no such route
                conn.sendall(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                return
            self.bodies.append(json.loads(body))
            self.paths.append(head.split(b" ")[1].decode())
            head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            conn.sendall(head)
            for data in self.events:
                event = f"data: {data}\n\n".encode()
                conn.sendall(f"{len(event):x}\r\n".encode() + event + b"\r\n")
            if self.finishes:
                conn.sendall(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
                return
            time.sleep(0.1)  # then the connection drops, without the last chunk

    def close(self) -> None:
        self.sock.close()


def _dying(stack: ExitStack, events: list[dict[str, Any]], **kwargs: Any) -> DyingWorker:
    worker = DyingWorker([json.dumps(e) for e in events], **kwargs)
    stack.callback(worker.close)
    return worker


def _stream(client: httpx.Client, path: str, body: dict[str, Any]) -> list[Any]:
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]" for line in r.iter_lines() if line]


def test_a_completion_stream_resumes_on_another_worker(workers: list[FakeWorker], stack: ExitStack) -> None:
    first = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": MODEL,
             "choices": [{"index": 0, "text": "Pa", "prompt_token_ids": [72, 105], "token_ids": [80, 97],
                          "finish_reason": None}]}  # fmt: skip
    dying = _dying(stack, [first])
    router, client = start_router(stack, [dying.url, workers[1].url], health_interval_s=60)
    before = len(workers[1].engine.seen_prompts)
    events = _stream(client, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 5, "stream": True})
    assert dying.bodies[0]["return_token_ids"] is True  # the router asked for ids
    chunks = [e for e in events if isinstance(e, dict)]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Pa" + REPLY[:3]  # the fake restarts its reply
    assert {c["id"] for c in chunks} == {"cmpl-1"} and {c["created"] for c in chunks} == {7}
    assert all("token_ids" not in c["choices"][0] and "prompt_token_ids" not in c["choices"][0] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and events[-1] == "[DONE]"
    assert workers[1].engine.seen_prompts[before:] == [[72, 105, 80, 97]]  # prompt + generated, 3 tokens left
    # the original prompt's length, from the router's header: what the worker's exactness check replays from
    assert workers[1].engine.seen_params[-1].resumed_prompt_tokens == 2
    assert router.metrics.migrations.labels("resumed")._value.get() == 1


def test_a_chat_stream_resumes_as_chat_with_held_back_text_and_whole_usage(
    workers: list[FakeWorker], stack: ExitStack
) -> None:
    common = {"id": "chatcmpl-9", "object": "chat.completion.chunk", "created": 3, "model": MODEL}
    role = common | {
        "prompt_token_ids": [60, 117, 62],
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
    }
    # three tokens generated, "r" held back (the possible start of the stop string) when the worker died
    token = common | {"choices": [{"index": 0, "delta": {"content": "Pa"}, "token_ids": [80, 97, 114],
                                   "finish_reason": None}]}  # fmt: skip
    dying = _dying(stack, [role, token])
    _, client = start_router(stack, [dying.url, workers[0].url], health_interval_s=60)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "u"}], "max_tokens": 6, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}, "stop": ["rx"]}  # fmt: skip
    before = len(workers[0].engine.seen_prompts)
    events = _stream(client, "/v1/chat/completions", body)
    # a splitserve worker went on as a chat request: the prompt's and the answer's ids, its output replayed, so
    # that it handed out the held-back "r" itself
    assert workers[0].engine.seen_prompts[before:] == [[60, 117, 62, 80, 97, 114]]
    params = workers[0].engine.seen_params[-1]
    assert params.resumed_prompt_tokens == 3 and params.replay_output and params.max_tokens == 3
    chunks = [e for e in events if isinstance(e, dict)]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and {c["id"] for c in chunks} == {"chatcmpl-9"}
    text = "".join((c["choices"][0]["delta"].get("content") or "") for c in chunks if c["choices"])
    assert text == "Par" + REPLY[:3]
    assert chunks[0]["prompt_token_ids"] == [60, 117, 62]  # the client asked for ids: they stay
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9,
                                   "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_an_n_stream_resumes_each_unfinished_choice_with_its_own_seed(
    workers: list[FakeWorker], stack: ExitStack
) -> None:
    common = {"id": "cmpl-3", "object": "text_completion", "created": 5, "model": MODEL}

    def choice(index: int, text: str, ids: list[int], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        return common | {"choices": [{"index": index, "text": text, "token_ids": ids, "finish_reason": finish} | extra]}

    events = [choice(i, "Pa", [80, 97], prompt_token_ids=[72, 105]) for i in range(3)]
    events += [choice(0, "r", [114], "length"), choice(2, "r", [114])]  # choice 0 done; 1 and 2 midway
    dying = _dying(stack, events)
    router, client = start_router(stack, [dying.url, workers[1].url], health_interval_s=60)
    before = len(workers[1].engine.seen_prompts)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "n": 3, "seed": 11, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    out = _stream(client, "/v1/completions", body)
    assert out[-1] == "[DONE]" and out.count("[DONE]") == 1
    chunks = [e for e in out if isinstance(e, dict) and e["choices"]]
    texts = {i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in range(3)}
    assert texts == {0: "Par", 1: "Pa" + REPLY[:1], 2: "Par"}  # 1 token left for choice 1, none for choice 2...
    finishes = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"] is not None]
    assert sorted(finishes) == [0, 1, 2]
    # ...so choice 2 needed no resumed request; choice 1 went on as its own request, drawing from seed + 1
    resumed = workers[1].engine.seen_prompts[before:]
    assert resumed == [[72, 105, 80, 97]]
    assert workers[1].engine.seen_params[-1].seed == 12
    assert {c["id"] for c in chunks} == {"cmpl-3"}
    assert out[-2]["usage"]["completion_tokens"] == 3 * 3 and out[-2]["usage"]["prompt_tokens"] == 2
    assert router.metrics.migrations.labels("resumed")._value.get() == 1


def test_an_echoed_stream_resumes_without_a_second_echo_and_a_choice_never_started_gets_its_echo(
    workers: list[FakeWorker], stack: ExitStack
) -> None:
    """n=2 with echo: choice 0's first chunk (the echo and "Pa") reached the client, choice 1's never did. The
    resumed requests do not echo; choice 1's echo goes out before its resumed text, and the held-back text and
    the resumed prompts are the answers' own, without the echo."""
    common = {"id": "cmpl-e", "object": "text_completion", "created": 5, "model": MODEL}
    first = common | {"choices": [{"index": 0, "text": "Hi there" + "Pa", "prompt_token_ids": [72, 105],
                                   "token_ids": [80, 97], "finish_reason": None}]}  # fmt: skip
    dying = _dying(stack, [first])
    router, client = start_router(stack, [dying.url, workers[1].url], health_interval_s=60)
    before = len(workers[1].engine.seen_prompts)
    body = {"model": MODEL, "prompt": "Hi there", "echo": True, "max_tokens": 4, "n": 2, "stream": True}
    out = _stream(client, "/v1/completions", body)
    chunks = [e for e in out if isinstance(e, dict) and e["choices"]]
    texts = {i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in range(2)}
    assert texts == {0: "Hi there" + "Pa" + REPLY[:2], 1: "Hi there" + REPLY[:4]}
    assert sorted(workers[1].engine.seen_prompts[before:]) == [[72, 105], [72, 105, 80, 97]]  # no echo text in them
    assert out[-1] == "[DONE]" and router.metrics.migrations.labels("resumed")._value.get() == 1


def test_a_stream_with_the_prompts_logprobs_resumes_once_they_were_sent(
    workers: list[FakeWorker], stack: ExitStack
) -> None:
    """echo with logprobs: the first chunk carried the echoed prompt's entries, then the first tokens'. The resumed
    request asks only for the output's logprobs, whose text_offset goes on past the echo and the text sent."""
    common = {"id": "cmpl-p", "object": "text_completion", "created": 5, "model": MODEL}
    entries = {
        "tokens": ["H", "i", "P", "a"],
        "token_logprobs": [None, -1.0, -0.5, -0.5],
        "top_logprobs": [None, {"i": -1.0}, {"P": -0.5}, {"a": -0.5}],
        "text_offset": [0, 1, 2, 3],
    }
    first = common | {"choices": [{"index": 0, "text": "Hi" + "Pa", "prompt_token_ids": [72, 105],
                                   "token_ids": [80, 97], "logprobs": entries, "finish_reason": None}]}  # fmt: skip
    dying = _dying(stack, [first])
    router, client = start_router(stack, [dying.url, workers[1].url], health_interval_s=60)
    body = {"model": MODEL, "prompt": "Hi", "echo": True, "logprobs": 1, "prompt_logprobs": 1, "max_tokens": 5,
            "stream": True}  # fmt: skip
    out = _stream(client, "/v1/completions", body)
    chunks = [e for e in out if isinstance(e, dict) and e["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "HiPa" + REPLY[:3]
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == [0, 1, 2, 3, 4, 5, 6]  # the resumed tokens' go on past "HiPa"
    params = workers[1].engine.seen_params[-1]
    assert params.prompt_logprobs is None and params.logprobs == 1  # the prompt's were sent: not asked again
    assert out[-1] == "[DONE]" and router.metrics.migrations.labels("resumed")._value.get() == 1


def test_a_choice_that_never_got_the_prompts_logprobs_is_not_resumed(stack: ExitStack) -> None:
    common = {"id": "cmpl-p", "object": "text_completion", "created": 5, "model": MODEL}
    first = common | {"choices": [{"index": 0, "text": "Pa", "prompt_token_ids": [72, 105], "token_ids": [80, 97],
                                   "prompt_logprobs": [None, {"105": {"logprob": -1.0, "rank": 1}}],
                                   "finish_reason": None}]}  # fmt: skip
    dying, other = _dying(stack, [first]), _dying(stack, [])
    _, client = start_router(stack, [dying.url, other.url], health_interval_s=60)
    body = {"model": MODEL, "prompt": "Hi", "prompt_logprobs": 1, "n": 2, "max_tokens": 5, "stream": True}
    out = _stream(client, "/v1/completions", body)
    assert other.bodies == [] and "no other worker could resume" in out[-2]["error"]["message"]


NAMED_TOOL = {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}  # fmt: skip


def _tool_chunks(common: dict[str, Any], deltas: list[tuple[dict[str, Any], list[int]]]) -> list[dict[str, Any]]:
    return [common | {"choices": [{"index": 0, "delta": delta, "token_ids": ids, "finish_reason": None}]}
            for delta, ids in deltas]  # fmt: skip


def test_a_tool_call_stream_resumes_as_chat_on_a_splitserve_worker_and_its_call_goes_on(stack: ExitStack) -> None:
    """The call's head and the start of its arguments reached the client; the new worker, given the prompt's
    and the answer's ids, sends the rest of the arguments under the same call index, in the original stream."""
    common = {"id": "chatcmpl-t", "object": "chat.completion.chunk", "created": 4, "model": MODEL}
    head = {"index": 0, "id": "chatcmpl-tool-1", "type": "function", "function": {"name": "get_weather",
                                                                                   "arguments": ""}}  # fmt: skip
    role = common | {"prompt_token_ids": [5, 6], "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                                      "content": ""}}]}  # fmt: skip
    first = [
        role,
        *_tool_chunks(
            common,
            [
                ({"tool_calls": [head]}, [1, 2]),
                ({"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}, [3, 4]),
            ],
        ),
    ]
    other = {"id": "chatcmpl-other", "object": "chat.completion.chunk", "created": 9, "model": MODEL}
    rest = [other | {"prompt_token_ids": [5, 6, 1, 2, 3, 4], "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                                                   "content": ""}}]},
            other | {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {
                "arguments": 'ty": "Oslo"}'}}]}, "token_ids": [7, 8], "finish_reason": "stop"}]},
            other | {"choices": [], "usage": {"prompt_tokens": 6, "completion_tokens": 2,
                                              "total_tokens": 8}}]  # fmt: skip
    dying = _dying(stack, first)
    resuming = _dying(stack, rest, version={"version": "0", "cpu": "x86"}, finishes=True)
    router, client = start_router(stack, [dying.url, resuming.url], health_interval_s=60)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "u"}], "max_tokens": 20, "stream": True,
            "stream_options": {"include_usage": True}, **NAMED_TOOL}  # fmt: skip
    events = _stream(client, "/v1/chat/completions", body)
    assert resuming.paths == ["/v1/chat/completions"]
    sent = resuming.bodies[0]
    assert sent["resume_from"] == {"prompt_token_ids": [5, 6], "output_token_ids": [1, 2, 3, 4]}
    assert sent["max_completion_tokens"] == 16 and "max_tokens" not in sent and sent["return_token_ids"] is True
    assert sent["tools"] == NAMED_TOOL["tools"] and sent["tool_choice"] == NAMED_TOOL["tool_choice"]
    chunks = [e for e in events if isinstance(e, dict)]
    assert {c["id"] for c in chunks} == {"chatcmpl-t"} and {c["created"] for c in chunks} == {4}
    calls = [d for c in chunks for choice in c["choices"] for d in choice["delta"].get("tool_calls", [])]
    assert [d["index"] for d in calls] == [0, 0, 0] and [d.get("id") for d in calls] == ["chatcmpl-tool-1", None, None]
    assert "".join(d["function"].get("arguments", "") for d in calls) == '{"city": "Oslo"}'
    assert all("token_ids" not in choice for c in chunks for choice in c["choices"])
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"] for c in chunks[1:] if c["choices"]]
    assert all(d.get("tool_calls") for d in deltas)  # no second role chunk, no empty ones
    assert chunks[-1]["usage"]["completion_tokens"] == 6 and events[-1] == "[DONE]"
    assert router.metrics.migrations.labels("resumed")._value.get() == 1


def test_a_tool_call_stream_is_not_resumed_as_text(stack: ExitStack) -> None:
    """A worker that is not splitserve's (no /version naming a cpu) would go on as a completion, whose text is
    no tool call: the stream ends with an error event instead."""
    common = {"id": "chatcmpl-t", "object": "chat.completion.chunk", "created": 4, "model": MODEL}
    head = {"index": 0, "id": "chatcmpl-tool-1", "type": "function", "function": {"name": "get_weather",
                                                                                   "arguments": ""}}  # fmt: skip
    role = common | {"prompt_token_ids": [5, 6], "choices": [{"index": 0, "delta": {"role": "assistant"}}]}
    dying = _dying(stack, [role, *_tool_chunks(common, [({"tool_calls": [head]}, [1, 2])])])
    other = _dying(stack, [])
    _, client = start_router(stack, [dying.url, other.url], health_interval_s=60)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "u"}], "max_tokens": 20, "stream": True,
            **NAMED_TOOL}  # fmt: skip
    events = _stream(client, "/v1/chat/completions", body)
    assert other.bodies == [] and "no other worker could resume" in events[-2]["error"]["message"]


def test_a_stream_no_worker_can_resume_ends_with_an_error_event(stack: ExitStack) -> None:
    first = {"id": "c", "choices": [{"index": 0, "text": "Pa", "prompt_token_ids": [1], "token_ids": [80, 97]}]}
    dying = _dying(stack, [first])
    _, client = start_router(stack, [dying.url], health_interval_s=60)
    events = _stream(client, "/v1/completions", {"prompt": "x", "max_tokens": 9, "stream": True})
    assert events[0]["choices"][0]["text"] == "Pa"
    assert events[1]["error"]["code"] == 502 and "no other worker" in events[1]["error"]["message"]
    assert events[-1] == "[DONE]"


# ---- the pieces ---------------------------------------------------------------------------------------------


def test_sse_buffer_yields_whole_events_only() -> None:
    buffer = SSEBuffer()
    assert buffer.feed(b'data: {"a"') == []
    assert buffer.feed(b": 1}\n\ndata: [DO") == ['{"a": 1}']
    assert buffer.feed(b"NE]\r\n\r\n: comment\n\n") == ["[DONE]"]


def test_resume_body_carries_sampling_and_what_is_left() -> None:
    tracker = StreamTracker(is_chat=True, client_wants_ids=False, client_wants_usage=False)
    tracker.prompt_ids, tracker.choices[0].output_ids = [1, 2], [3, 4, 5]
    choice = tracker.choices[0]
    original = {"model": "m", "messages": [], "max_completion_tokens": 10, "temperature": 0.5, "seed": 7,
                "stop": ["\n"], "min_tokens": 4, "stream": True,
                "stream_options": {"include_usage": False}}  # fmt: skip
    body = resume_body(tracker, choice, original)
    assert body == {"model": "m", "prompt": [1, 2, 3, 4, 5], "max_tokens": 7, "min_tokens": 1, "temperature": 0.5,
                    "seed": 7, "stop": ["\n"], "stream": True, "return_token_ids": True}  # fmt: skip
    assert resume_body(tracker, choice, original | {"max_completion_tokens": 3}) is None  # nothing left to generate
    unbounded: dict[str, Any] = {"model": "m", "messages": [], "max_completion_tokens": None, "stream": True}
    assert (resume_body(tracker, choice, unbounded | {"max_tokens": 9}) or {})["max_tokens"] == 6
    # a chat without a budget had the context left: the new worker's context, less the prompt and what is done
    assert (resume_body(tracker, choice, unbounded, max_model_len=100) or {})["max_tokens"] == 100 - 2 - 3
    completion = StreamTracker(is_chat=False, client_wants_ids=False, client_wants_usage=True)
    completion.prompt_ids = [9]
    resumed = resume_body(completion, completion.choices[0], {"prompt": "x"})
    assert resumed is not None and resumed["max_tokens"] == 16 and resumed["stream_options"] == {"include_usage": True}
    # choice i of a seeded n: its own request, drawing from seed + i as the worker drew it
    three = StreamTracker(is_chat=False, client_wants_ids=False, client_wants_usage=False, num_choices=3)
    three.prompt_ids, three.choices[2].output_ids = [9], [4]
    third = resume_body(three, three.choices[2], {"prompt": "x", "n": 3, "seed": 7, "max_tokens": 5})
    assert third is not None and third["seed"] == 9 and third["prompt"] == [9, 4] and "n" not in third


def test_held_back_text_is_what_the_client_lacks() -> None:
    choice = ChoiceTrack(0, text=" Hello wor")
    assert held_back_text(choice, "ctx", "ctx Hello world") == "ld"
    assert held_back_text(choice, "ctx", "ctx Hello wor") == ""
    assert held_back_text(choice, "ctx", "other") == ""
    assert held_back_text(choice, "ctx", "ctx Hello world\ufffd") == ""  # an incomplete character: wait


def test_which_streams_migrate() -> None:
    chat = {"stream": True, "messages": []}
    assert is_migratable("/v1/chat/completions", chat)
    assert is_migratable("/v1/chat/completions", chat | {"n": 3}) and is_migratable(
        "/v1/completions", chat | {"n": 2, "best_of": 2}
    )
    assert not is_migratable("/v1/completions", chat | {"n": 2, "best_of": 4})  # not streamed whole
    assert not is_migratable("/v1/chat/completions", chat | {"n": 0})
    assert is_migratable("/v1/chat/completions", chat | {"logprobs": True, "top_logprobs": 2})
    assert is_migratable("/v1/completions", chat | {"logprobs": 0})
    assert not is_migratable("/v1/completions", chat | {"logprobs": "many"})  # the worker refuses it anyway
    assert is_migratable("/v1/completions", chat | {"prompt_logprobs": 1})  # once each choice's first chunk came
    assert is_migratable("/v1/completions", chat | {"prompt": "Hi", "echo": True})
    assert is_migratable("/v1/completions", chat | {"prompt": ["Hi"], "echo": True})  # a batch of one
    assert not is_migratable("/v1/completions", chat | {"prompt": [1, 2], "echo": True})  # its text: the worker's
    assert is_migratable("/v1/completions", chat | {"prompt": "Hi", "echo": True, "logprobs": 0})
    assert not is_migratable("/v1/chat/completions", chat | {"stream": False})


def _sent(tracker: StreamTracker, event: dict[str, Any], index: int | None = None) -> dict[str, Any] | None:
    out = tracker.on_event(json.dumps(event), index)
    return json.loads(out.decode().removeprefix("data: ")) if out else None


def test_a_resumed_chat_streams_logprobs_come_in_its_shape_and_none_twice() -> None:
    """The first worker sent two tokens with their logprobs; the second ends in half a character, so the new
    worker generates it again: its entry is not sent twice, the next one comes as chat's, with its top token."""
    tracker = StreamTracker(is_chat=True, client_wants_ids=False, client_wants_usage=False, logprobs=1)
    entry = {"token": "P", "logprob": -0.1, "bytes": [80], "top_logprobs": [{"token": "P", "logprob": -0.1,
                                                                              "bytes": [80]}]}  # fmt: skip
    common = {"id": "chatcmpl-2", "object": "chat.completion.chunk", "created": 3, "model": MODEL}
    _sent(tracker, common | {"prompt_token_ids": [1, 2], "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    _sent(tracker, common | {"choices": [{"index": 0, "delta": {"content": "P"}, "token_ids": [80, 200],
                                          "logprobs": {"content": [entry, entry | {"token": "\ufffd"}]}}]})  # fmt: skip
    choice = tracker.choices[0]
    assert choice.num_logprobs == 2
    choice.output_ids.pop()  # half a character: generated again
    assert resume_body(tracker, choice, {"messages": [], "logprobs": True, "top_logprobs": 1})["logprobs"] == 1
    tracker.resume()
    resumed = {"choices": [{"index": 0, "text": "éa", "token_ids": [200, 97], "logprobs": {
        "tokens": ["é", "a"], "token_logprobs": [-0.2, -0.3], "top_logprobs": [{"é": -0.2}, {"a": -0.3, "b": -0.25}],
        "text_offset": [0, 1]}}]}  # fmt: skip
    out = _sent(tracker, resumed, 0)
    assert out is not None and out["object"] == "chat.completion.chunk"
    top = [{"token": "b", "logprob": -0.25, "bytes": [98]}]  # its most likely, as asked (the chosen one after it)
    assert out["choices"][0]["logprobs"] == {"content": [{"token": "a", "logprob": -0.3, "bytes": [97],
                                                          "top_logprobs": top}]}  # fmt: skip
    assert choice.num_logprobs == 3


def test_a_resumed_completion_streams_text_offsets_go_on_from_the_text_sent() -> None:
    tracker = StreamTracker(is_chat=False, client_wants_ids=False, client_wants_usage=False, logprobs=0)
    first = {"index": 0, "text": "Pa", "prompt_token_ids": [1], "token_ids": [80, 97],
             "logprobs": {"tokens": ["P", "a"], "token_logprobs": [-0.1, -0.2], "top_logprobs": [{"P": -0.1},
                          {"a": -0.2}], "text_offset": [0, 1]}}  # fmt: skip
    _sent(tracker, {"id": "cmpl-4", "choices": [first]})
    tracker.resume()
    resumed = {"choices": [{"index": 0, "text": "ris", "token_ids": [114, 105], "logprobs": {
        "tokens": ["r", "is"], "token_logprobs": [-0.3, -0.4], "top_logprobs": [{"r": -0.3}, {"is": -0.4}],
        "text_offset": [0, 1]}}]}  # fmt: skip
    out = _sent(tracker, resumed, 0)
    assert out is not None and out["choices"][0]["logprobs"] == {
        "tokens": ["r", "is"], "token_logprobs": [-0.3, -0.4], "top_logprobs": [{"r": -0.3}, {"is": -0.4}],
        "text_offset": [2, 3]}  # fmt: skip


# ---- faults between the router and a worker (tests/support/faults.py) ------------------------------------------------


@pytest.fixture
def proxied(stack: ExitStack) -> tuple[FakeWorker, FaultProxy]:
    """A slow fake worker (20 ms a token) behind a fault proxy."""
    worker = FakeWorker(stack)
    worker.engine.step_delay_s = 0.02
    proxy = FaultProxy(int(worker.url.rsplit(":", 1)[1]))
    stack.callback(proxy.close)
    return worker, proxy


STREAM = {"model": MODEL, "prompt": "Hi", "max_tokens": 20, "stream": True}


def test_bytes_sliced_to_one_at_a_time_change_nothing(
    workers: list[FakeWorker], proxied: tuple[FakeWorker, FaultProxy], stack: ExitStack
) -> None:
    _, proxy = proxied
    proxy.slice_bytes, proxy.latency_s = 1, 0.001
    _, client = start_router(stack, [proxy.url], health_interval_s=60)
    events = _stream(client, "/v1/completions", STREAM)
    assert "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict)) == REPLY[:20]
    assert events[-1] == "[DONE]"


def test_a_connection_reset_mid_stream_is_resumed_on_the_other_worker(
    workers: list[FakeWorker], proxied: tuple[FakeWorker, FaultProxy], stack: ExitStack
) -> None:
    _, proxy = proxied
    router, client = start_router(stack, [proxy.url, workers[1].url], health_interval_s=60)
    before = len(workers[1].engine.seen_prompts)
    with client.stream("POST", "/v1/completions", json=STREAM) as r:
        lines = r.iter_lines()
        received = [next(lines) for _ in range(5)]  # "data: ..." and blank lines: a few tokens
        proxy.reset()
        received += list(lines)
    received = [line for line in received if line]
    events = [json.loads(line[6:]) for line in received if line.startswith("data: {")]
    assert not any("error" in e for e in events) and received[-1] == "data: [DONE]"
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    resumed_prompt = workers[1].engine.seen_prompts[before]
    assert resumed_prompt[:2] == [72, 105] and len(resumed_prompt) > 2  # "Hi" and the tokens generated
    assert router.metrics.migrations.labels("resumed")._value.get() == 1


def test_a_stalled_worker_is_left_for_another_before_and_during_a_stream(
    workers: list[FakeWorker], proxied: tuple[FakeWorker, FaultProxy], stack: ExitStack
) -> None:
    _, proxy = proxied
    router, client = start_router(stack, [proxy.url, workers[1].url], health_interval_s=60, read_timeout_s=0.5)
    with client.stream("POST", "/v1/completions", json=STREAM) as r:
        lines = r.iter_lines()
        received = [next(lines) for _ in range(3)]
        proxy.blackhole = True  # silent from now on: the router's read timeout fires
        received += list(lines)
    received = [line for line in received if line]
    assert received[-1] == "data: [DONE]" and not any('"error"' in line for line in received)
    assert router.metrics.migrations.labels("resumed")._value.get() == 1
    # a whole request to the stalled worker times out and goes to the other one
    answer = client.post("/v1/completions", json=STREAM | {"stream": False})
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == REPLY[:20]

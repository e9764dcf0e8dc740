"""A fast OpenAI-compatible stub server with no model, the backend for router benchmarks.

    .venv/bin/python benchmarks/stub_openai_server.py --port 8100 [--model smollm2]

Every completion answers the same short text at once: ``POST /v1/completions`` and ``/v1/chat/completions``
return one JSON body, or, with ``"stream": true``, ``NUM_STREAM_CHUNKS`` SSE ``data:`` events and
``data: [DONE]``. ``GET /v1/models`` lists the one model, ``GET /health`` is 200 and ``GET /metrics`` is a small
Prometheus page with vLLM's request gauges and a request counter, as a router's stats scraper expects.

A raw ASGI app under uvicorn (uvloop + httptools when installed, no access log): no framework, no validation, responses
built from pre-encoded pieces, so the stub costs as little CPU per request as Python allows and a router's
overhead is what a benchmark sees.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import uvicorn

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

COMPLETION_TOKENS = ("Hello", " from", " the", " stub", ".")
COMPLETION_TEXT = "".join(COMPLETION_TOKENS)
NUM_STREAM_CHUNKS = len(COMPLETION_TOKENS)
NUM_PROMPT_TOKENS = 8  # reported in ``usage``; the prompt is never tokenized
JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
TEXT_HEADERS = [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]
DONE_EVENT = b"data: [DONE]\n\n"


@dataclass(slots=True)
class StubStats:
    """What ``/metrics`` reports."""

    num_running: int = 0
    num_requests_total: int = 0


class StubApp:
    """The ASGI app: route on ``(method, path)``, answer completions from fixed text."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.stats = StubStats()
        models = {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "stub"}]}
        self.models_body = json.dumps(models).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            await self._completion(path == "/v1/chat/completions", receive, send)
        elif method == "GET" and path == "/health":
            await _respond(send, 200, b"", JSON_HEADERS)
        elif method == "GET" and path == "/v1/models":
            await _respond(send, 200, self.models_body, JSON_HEADERS)
        elif method == "GET" and path == "/metrics":
            await _respond(send, 200, self._metrics_text().encode(), TEXT_HEADERS)
        else:
            await _respond(send, 404, b'{"error":{"message":"not found","type":"not_found"}}', JSON_HEADERS)

    async def _completion(self, is_chat: bool, receive: Receive, send: Send) -> None:
        try:
            request = json.loads(await _read_body(receive) or b"{}")
        except ValueError:
            await _respond(send, 400, b'{"error":{"message":"invalid JSON","type":"bad_request"}}', JSON_HEADERS)
            return
        model = request.get("model") or self.model
        self.stats.num_running += 1
        self.stats.num_requests_total += 1
        try:
            if request.get("stream"):
                await _stream(send, is_chat, model)
            else:
                await _respond(send, 200, _completion_body(is_chat, model), JSON_HEADERS)
        finally:
            self.stats.num_running -= 1

    def _metrics_text(self) -> str:
        label = f'{{model_name="{self.model}"}}'
        return (
            "# HELP vllm:num_requests_running Requests being answered.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{label} {self.stats.num_running}\n"
            "# HELP vllm:num_requests_waiting Requests waiting (always 0 here).\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{label} 0\n"
            "# HELP vllm:kv_cache_usage_perc KV cache usage (always 0 here).\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{label} 0.0\n"
            "# HELP stub:requests_total Completion requests received.\n"
            "# TYPE stub:requests_total counter\n"
            f"stub:requests_total {self.stats.num_requests_total}\n"
        )


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _respond(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    length = (b"content-length", str(len(body)).encode())
    await send({"type": "http.response.start", "status": status, "headers": [*headers, length]})
    await send({"type": "http.response.body", "body": body})


async def _stream(send: Send, is_chat: bool, model: str) -> None:
    """``NUM_STREAM_CHUNKS`` events of one token each, the last with ``finish_reason``, then ``[DONE]``."""
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    created = int(time.time())
    for i, token in enumerate(COMPLETION_TOKENS):
        finish = "length" if i == NUM_STREAM_CHUNKS - 1 else None
        if is_chat:
            delta = {"role": "assistant", "content": token} if i == 0 else {"content": token}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": token, "finish_reason": finish}
        chunk: dict[str, Any] = {"id": "cmpl-stub", "object": _object(is_chat, True), "created": created}
        chunk.update(model=model, choices=[choice])
        event = b"data: " + json.dumps(chunk).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": DONE_EVENT, "more_body": False})


def _completion_body(is_chat: bool, model: str) -> bytes:
    if is_chat:
        message = {"role": "assistant", "content": COMPLETION_TEXT}
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": "length"}
    else:
        choice = {"index": 0, "text": COMPLETION_TEXT, "finish_reason": "length"}
    usage = {
        "prompt_tokens": NUM_PROMPT_TOKENS,
        "completion_tokens": NUM_STREAM_CHUNKS,
        "total_tokens": NUM_PROMPT_TOKENS + NUM_STREAM_CHUNKS,
    }
    body: dict[str, Any] = {"id": "cmpl-stub", "object": _object(is_chat, False), "created": int(time.time())}
    body.update(model=model, choices=[choice], usage=usage)
    return json.dumps(body).encode()


def _object(is_chat: bool, is_chunk: bool) -> str:
    if is_chat:
        return "chat.completion.chunk" if is_chunk else "chat.completion"
    return "text_completion"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="smollm2", help="the model id /v1/models lists")
    args = parser.parse_args()
    uvicorn.run(
        StubApp(args.model),
        host=args.host,
        port=args.port,
        loop="auto",  # uvloop and httptools when installed (the venv has them), else asyncio and h11
        http="auto",
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main()

"""A fake OpenAI streaming server for the benchmark client's tests, usable as an httpx.MockTransport handler
(``FakeOpenAI.handle``) or behind FastAPI (``stub_app``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class FakeOpenAI:
    """Streams ``max_tokens`` one-token chunks; every ``fail_every``-th request gets a 500 instead."""

    def __init__(
        self,
        *,
        fail_every: int = 0,
        chunk_delay_s: float = 0.0,
        with_usage: bool = True,
        clock: FakeClock | None = None,
        first_delay_s: float = 0.0,
    ) -> None:
        self.fail_every = fail_every
        self.chunk_delay_s = chunk_delay_s
        self.first_delay_s = first_delay_s
        self.with_usage = with_usage
        self.clock = clock
        self.payloads: list[dict[str, Any]] = []
        self.authorizations: set[str | None] = set()
        self.session_headers: list[str | None] = []
        self.events: list[tuple[str, str | None, int]] = []
        """("start" | "end", the payload's ``user``, its number of user messages), in the order they happened."""
        self.num_in_flight = 0
        self.max_in_flight = 0

    def should_fail(self, payload: dict[str, Any]) -> bool:
        self.payloads.append(payload)
        return bool(self.fail_every) and len(self.payloads) % self.fail_every == 0

    async def handle(self, request: httpx.Request) -> httpx.Response:
        payload = json.loads(request.content)
        self.authorizations.add(request.headers.get("authorization"))
        self.session_headers.append(request.headers.get("x-session-id"))
        if self.should_fail(payload):
            return httpx.Response(500, json={"error": {"message": "boom", "type": "server_error"}})
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=self.stream(payload))

    async def stream(self, payload: dict[str, Any]) -> AsyncIterator[bytes]:
        num_questions = sum(m["role"] == "user" for m in payload.get("messages", []))
        self.events.append(("start", payload.get("user"), num_questions))
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        for i in range(payload["max_tokens"]):
            await self._wait(self.first_delay_s if i == 0 else self.chunk_delay_s)
            yield _sse(_content_chunk("messages" in payload, f" w{i}"))
        if self.with_usage and payload.get("stream_options", {}).get("include_usage"):
            usage = {"prompt_tokens": 7, "completion_tokens": payload["max_tokens"], "total_tokens": 0}
            yield _sse({"choices": [], "usage": usage})
        self.num_in_flight -= 1  # before [DONE]: a client may stop reading there and never resume us
        self.events.append(("end", payload.get("user"), num_questions))
        yield b"data: [DONE]\n\n"

    async def _wait(self, delay_s: float) -> None:
        if self.clock is not None:
            self.clock.now_s += delay_s
        elif delay_s:
            await asyncio.sleep(delay_s)
        else:
            await asyncio.sleep(0)


def _content_chunk(chat: bool, text: str) -> dict[str, Any]:
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    return {"object": "chunk", "choices": [choice]}


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


def stub_app(fake: FakeOpenAI) -> FastAPI:
    api = FastAPI()

    async def handle(request: Request) -> Response:
        payload = await request.json()
        if fake.should_fail(payload):
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)
        return StreamingResponse(fake.stream(payload), media_type="text/event-stream")

    api.add_api_route("/v1/completions", handle, methods=["POST"])
    api.add_api_route("/v1/chat/completions", handle, methods=["POST"])
    return api

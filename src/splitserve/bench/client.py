"""Streaming client for OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions``.

One ``send()`` is one request; a request with a session id carries it as the ``x-session-id`` header (for
session-affine routers) and as OpenAI's ``user`` field. ``send()`` always returns a ``RequestResult`` and
never raises for a failed request (HTTP error status, error event in the stream, broken connection,
timeout), so one bad request cannot end a benchmark run.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import httpx

from splitserve.bench.datasets import BenchRequest
from splitserve.protocol.openai import chunk_text


class EndpointKind(StrEnum):
    COMPLETIONS = "completions"
    CHAT = "chat"


_PATHS = {EndpointKind.COMPLETIONS: "/v1/completions", EndpointKind.CHAT: "/v1/chat/completions"}
SESSION_HEADER = "x-session-id"
"""HTTP header that carries a request's session id to the router."""


@dataclass(slots=True)
class RequestResult:
    """What one request did. Times are seconds; ``start_s`` is relative to the start of the run.

    ``session_id`` and ``round_index`` are copied from the request, so per-request results can be grouped by
    session and round.

    ``ttft_s`` is the time to the first non-empty content chunk; ``itl_s`` holds the gaps between
    consecutive content chunks (a chunk may carry several tokens); ``output_tokens`` comes from the
    server's usage report when present (``usage_reported``), else it is the number of content chunks.
    """

    success: bool
    max_tokens: int
    start_s: float = 0.0
    e2e_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    num_chunks: int = 0
    usage_reported: bool = False
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens, when the server reports it
    status_code: int | None = None
    error: str = ""
    session_id: str | None = None
    round_index: int = 0

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (output_tokens - 1)."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def endpoint_url(base_url: str, kind: EndpointKind) -> str:
    """Join a server's base URL (with or without a trailing ``/v1``) and the endpoint's path."""
    base = base_url.rstrip("/")
    base = base.removesuffix("/v1")
    return base + _PATHS[kind]


class OpenAIStreamClient:
    """Sends benchmark requests with ``stream: true`` and times the streamed chunks.

    The ``httpx.AsyncClient`` is injected (tests pass one built on ``httpx.MockTransport``) and not closed
    here; ``clock`` returns seconds and defaults to ``time.perf_counter``.
    """

    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        base_url: str,
        model: str,
        kind: EndpointKind = EndpointKind.COMPLETIONS,
        ignore_eos: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.http = http
        self.url = endpoint_url(base_url, kind)
        self.model = model
        self.kind = kind
        self.ignore_eos = ignore_eos
        self.clock = clock

    def build_payload(self, request: BenchRequest) -> dict[str, Any]:
        """The JSON body for ``request``: greedy, streaming, with usage in the last chunk; ``user`` is its
        session id when it has one."""
        payload: dict[str, Any] = {
            "model": self.model,
            "max_tokens": request.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": self.ignore_eos,
        }
        if self.kind is EndpointKind.CHAT:
            payload["messages"] = request.as_messages()
        else:
            payload["prompt"] = request.as_prompt()
        if request.session_id is not None:
            payload["user"] = request.session_id
        return payload

    async def send(self, request: BenchRequest, *, run_start_s: float = 0.0) -> RequestResult:
        """Send ``request`` and return its timings; failures are returned, not raised."""
        result = RequestResult(
            success=False,
            max_tokens=request.max_tokens,
            session_id=request.session_id,
            round_index=request.round_index,
        )
        headers = {SESSION_HEADER: request.session_id} if request.session_id is not None else None
        start = self.clock()
        result.start_s = start - run_start_s
        try:
            payload = self.build_payload(request)
            async with self.http.stream("POST", self.url, json=payload, headers=headers) as response:
                result.status_code = response.status_code
                if response.status_code != 200:
                    body = await response.aread()
                    result.error = _error_message(body, f"HTTP {response.status_code}")
                else:
                    await self._read_stream(response, result, start)
        except Exception as exc:  # any failure (network, timeout, malformed stream) is this request's result
            result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        result.e2e_s = self.clock() - start
        _fill_defaults(result, request)
        return result

    async def _read_stream(self, response: httpx.Response, result: RequestResult, start: float) -> None:
        last_chunk_at = start
        async for event in _sse_events(response.aiter_lines()):
            if "error" in event:
                result.error = _error_message(json.dumps(event).encode(), "stream error")
                return
            _read_usage(event, result)
            if not chunk_text(self.kind is EndpointKind.CHAT, event):
                continue
            now = self.clock()
            if result.ttft_s is None:
                result.ttft_s = now - start
            else:
                result.itl_s.append(now - last_chunk_at)
            last_chunk_at = now
            result.num_chunks += 1
        if result.num_chunks == 0:
            result.error = "stream ended without any content"
            return
        result.success = True


async def _sse_events(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of a server-sent event stream, up to ``data: [DONE]``."""
    async for raw in lines:
        line = raw.strip()
        if not line.startswith("data:"):
            continue  # blank separators, comments (": ping") and other SSE fields
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if isinstance(event, dict):
            yield event


def _read_usage(event: dict[str, Any], result: RequestResult) -> None:
    usage = event.get("usage")
    if not isinstance(usage, dict):
        return
    if usage.get("completion_tokens") is not None:
        result.output_tokens = int(usage["completion_tokens"])
        result.usage_reported = True
    if usage.get("prompt_tokens") is not None:
        result.prompt_tokens = int(usage["prompt_tokens"])
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        result.cached_tokens = details["cached_tokens"]


def _fill_defaults(result: RequestResult, request: BenchRequest) -> None:
    """Without a usage report, count chunks as tokens and the prompt's words as its tokens."""
    if not result.usage_reported:
        result.output_tokens = result.num_chunks
    if result.prompt_tokens == 0:
        result.prompt_tokens = request.approx_prompt_tokens


def _error_message(body: bytes, prefix: str) -> str:
    """``<prefix>: <message>``, the message taken from an OpenAI error body when there is one."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error", parsed.get("detail", parsed))
        message = error.get("message", error) if isinstance(error, dict) else error
        text = str(message)
    return f"{prefix}: {text[:500]}"

"""A scripted stand-in for the router's HTTP transport to its workers (``FakeTransport``, answering with
``FakeUpstream`` bodies), and the SSE and completion-chunk bytes its scripts are written in."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from splitserve.router.transport import TransportError


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

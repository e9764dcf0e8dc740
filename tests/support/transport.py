"""The router's transport to its workers without a socket: ``InMemoryTransport`` calls in-process ASGI apps
(a worker's app, or a handler made into one with ``handler_app``) by base URL, and ``FakeTransport`` answers
forwarded requests from scripts (``FakeUpstream`` bodies, written with ``sse`` and ``completion_chunk``)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message

from splitserve.router.transport import Answer, TransportError, Upstream

logger = logging.getLogger(__name__)


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


class InMemoryTransport:
    """The router's :class:`~splitserve.router.transport.Transport` with no socket: each base URL
    (``http://host:port``) is an in-process ASGI app, called on the caller's event loop as a server would call
    it, its answer streamed back as the app sends it. A base URL with no app refuses the connection, as a dead
    worker does. Each app's lifespan starts before its first request and ends at :meth:`aclose` (the router's),
    so a worker app built over a fake engine starts that engine on the router's loop."""

    def __init__(self, apps: Mapping[str, ASGIApp] | None = None) -> None:
        self.apps: dict[str, ASGIApp] = dict(apps or {})
        self.requests: list[tuple[str, str]] = []  # (method, url) of every request that reached an app
        self._lifespans: dict[str, asyncio.Task[_Lifespan]] = {}
        self._running: set[asyncio.Task[None]] = set()  # apps still answering a request

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> Upstream:
        sent = dict(headers)
        if not any(name.lower() == "content-type" for name in sent):
            sent["Content-Type"] = "application/json"
        return await self._open("POST", url, body, sent, TransportError("connect: ClientConnectorError"))

    async def get(self, url: str, timeout_s: float, max_bytes: int | None = None) -> Answer:
        refused = TransportError(f"ClientConnectorError: cannot connect to {url}", "ClientConnectorError")
        try:
            async with asyncio.timeout(timeout_s):
                upstream = await self._open("GET", url, b"", {}, refused)
                body = await upstream.read()
        except TimeoutError as exc:
            raise TransportError.of(exc) from exc
        return Answer(upstream.status, body if max_bytes is None else body[:max_bytes], upstream.content_type)

    async def get_json(self, url: str, timeout_s: float) -> Any:
        try:
            return _json_of(await self.get(url, timeout_s))
        except TransportError:
            return None

    async def post_json(self, url: str, body: Any, timeout_s: float) -> Any:
        try:
            async with asyncio.timeout(timeout_s):
                upstream = await self.post(url, json.dumps(body).encode(), {})
                answer = Answer(upstream.status, await upstream.read(), upstream.content_type)
        except (TransportError, TimeoutError):
            return None
        return _json_of(answer)

    async def aclose(self) -> None:
        """As a server stops: the answers still running are cut off, then each app's lifespan ends."""
        running = list(self._running)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        lifespans = list(self._lifespans.values())
        self._lifespans.clear()
        failures: list[BaseException] = []
        for lifespan in lifespans:  # each app's shutdown runs, whichever failed to start or to stop
            try:
                await (await lifespan).shutdown()
            except Exception as exc:  # raised below, after every app has stopped
                failures.append(exc)
        if failures:
            raise failures[0]

    async def _open(
        self, method: str, url: str, body: bytes, headers: Mapping[str, str], refused: TransportError
    ) -> MemoryUpstream:
        parts = urlsplit(url)
        base = f"{parts.scheme}://{parts.netloc}"
        app = self.apps.get(base)
        if app is None:
            raise refused
        lifespan = self._lifespans.get(base)
        if lifespan is None:
            lifespan = self._lifespans[base] = asyncio.ensure_future(_Lifespan.started(app))
        state = (await asyncio.shield(lifespan)).state
        self.requests.append((method, url))
        sent = [(b"host", parts.netloc.encode()), (b"content-length", str(len(body)).encode())]
        sent += [(k.lower().encode(), v.encode()) for k, v in headers.items() if k.lower() != "content-length"]
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
            "scheme": parts.scheme, "path": unquote(parts.path or "/"), "raw_path": (parts.path or "/").encode(),
            "query_string": parts.query.encode(), "root_path": "", "headers": sent, "client": ("router", 0),
            "server": (parts.hostname, parts.port), "state": dict(state),
        }  # fmt: skip
        upstream = MemoryUpstream(app, scope, body)
        self._running.add(upstream.task)
        upstream.task.add_done_callback(self._running.discard)
        try:
            await upstream.started()
        except BaseException:  # refused, or the caller gave up waiting: the app hears the client leave
            upstream.close()
            raise
        return upstream


class MemoryUpstream:
    """An in-process app's answer: the app runs as a task, its messages come through a queue. Closing it is the
    client leaving: the app hears ``http.disconnect``."""

    def __init__(self, app: ASGIApp, scope: dict[str, Any], body: bytes) -> None:
        self.status = 0
        self.content_type = "application/json"
        self._body: bytes | None = body
        self._messages: asyncio.Queue[Message | None] = asyncio.Queue()  # None: the app returned
        self._left = asyncio.Event()
        self.task = asyncio.create_task(self._run(app, scope))

    async def _run(self, app: ASGIApp, scope: dict[str, Any]) -> None:
        try:
            await app(scope, self._receive, self._messages.put)
        except Exception:  # a server logs it, and the client sees a 500 or a broken answer
            logger.exception("in-memory app failed on %s", scope["path"])
        finally:
            self._messages.put_nowait(None)

    async def _receive(self) -> Message:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self._left.wait()
        return {"type": "http.disconnect"}

    async def started(self) -> None:
        """Wait for the status line; :class:`TransportError` when the app ends without one."""
        message = await self._messages.get()
        while message is not None and message["type"] != "http.response.start":
            message = await self._messages.get()
        if message is None:
            raise TransportError("connect: ServerDisconnectedError")
        self.status = message["status"]
        headers = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
        self.content_type = headers.get("content-type", self.content_type)

    async def read(self) -> bytes:
        try:
            return b"".join([chunk async for chunk in self.chunks()])
        except TransportError as exc:
            raise TransportError("read: ClientPayloadError") from exc
        finally:
            self.close()

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            message = await self._messages.get()
            if message is None:
                raise TransportError("ClientPayloadError: the answer ended before its body did")
            if message["type"] != "http.response.body":
                continue
            if message.get("body"):
                yield bytes(message["body"])
            if not message.get("more_body", False):
                return

    def close(self) -> None:
        self._left.set()


class _Lifespan:
    """An app's ASGI lifespan, as a server runs it (an app without one is served all the same)."""

    def __init__(self, app: ASGIApp) -> None:
        self.state: dict[str, Any] = {}
        self._to_app: asyncio.Queue[Message] = asyncio.Queue()
        self._from_app: asyncio.Queue[Message | None] = asyncio.Queue()  # None: the app returned
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": self.state}
        self._task = asyncio.create_task(self._run(app, scope))

    @classmethod
    async def started(cls, app: ASGIApp) -> _Lifespan:
        lifespan = cls(app)
        await lifespan._to_app.put({"type": "lifespan.startup"})
        message = await lifespan._from_app.get()
        if message is not None and message["type"] == "lifespan.startup.failed":
            raise RuntimeError(f"the app did not start: {message.get('message')}")
        return lifespan

    async def _run(self, app: ASGIApp, scope: dict[str, Any]) -> None:
        try:
            await app(scope, self._to_app.get, self._from_app.put)
        except Exception:  # no lifespan support: uvicorn's "auto" serves the app without one
            logger.debug("an in-memory app has no lifespan", exc_info=True)
        finally:
            self._from_app.put_nowait(None)

    async def shutdown(self) -> None:
        if not self._task.done():
            await self._to_app.put({"type": "lifespan.shutdown"})
            await self._task


def _json_of(answer: Answer) -> Any:
    """As the router's client reads a small JSON answer: a 200 with a JSON content type, else None."""
    if answer.status != 200 or not answer.content_type.startswith("application/json"):
        return None
    try:
        return json.loads(answer.body)
    except ValueError:
        return None


def handler_app(handler: Callable[[Request], Awaitable[Response]]) -> ASGIApp:
    """An app that answers every path and method with ``handler`` (a worker as small as a test needs)."""
    methods = ["GET", "POST", "PUT", "DELETE"]
    return Starlette(routes=[Route("/{path:path}", handler, methods=methods)])


@contextmanager
def no_sockets(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Within it, opening a network connection or listening fails the test (an event loop's own wake-up pipe
    is a socketpair, which needs neither)."""

    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError("this test opened a socket")

    with monkeypatch.context() as patch:
        for name in ("connect", "connect_ex", "bind"):
            patch.setattr(socket.socket, name, refuse)
        yield


class FakeTransport(InMemoryTransport):
    """Answers forwarded requests from scripts: per worker URL, a list of upstreams (one per request, in order);
    a worker with no script left refuses the connection. ``/v1/models`` answers with one card, ``/detokenize``
    with each id as a character. Probes, scrapes and KV event polls (``get``) go to ``apps``, as in the base."""

    def __init__(self, scripts: dict[str, list[FakeUpstream]], apps: Mapping[str, ASGIApp] | None = None) -> None:
        super().__init__(apps)
        self.scripts = scripts
        self.sent: list[tuple[str, dict[str, Any]]] = []

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> Upstream:
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


def sse(*events: dict[str, Any] | str) -> list[bytes]:
    return [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events]


def completion_chunk(text: str, ids: list[int], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "finish_reason": finish, "token_ids": ids} | extra
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}

"""How the router talks to workers, behind a small interface so that tests can put anything behind it.

:class:`Transport` carries every request the router makes to a worker: the forwarder's and the
disaggregator's (``post`` gives an :class:`Upstream`, the worker's answer, read whole or as it streams in),
the health probes, the ``/metrics`` scrapes and the KV event long polls (``get`` gives an :class:`Answer`,
read whole), and the small JSON questions of migration and disaggregation (``get_json``, ``post_json``).
Every way a worker can fail to answer (no connection, a timeout, a connection that breaks mid-body) is one
exception, :class:`TransportError`, whichever client library is underneath.

:class:`AiohttpTransport` is the router's: one ``aiohttp`` session with keep-alive connections to every
worker, made on the running loop at first use; no other module of the router opens a connection. Unit tests
give the router an in-memory transport instead (``build_router(config, transport=...)``), as httpx's
``MockTransport`` lets a client run without sockets.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from splitserve.errors import SplitserveError


class TransportError(SplitserveError):
    """The worker could not be reached, did not answer in time, or its answer broke off.

    ``kind`` is the failure's name as the client library gave it (``ClientConnectorError``, ``TimeoutError``),
    for a log line that names the failure without its details."""

    def __init__(self, message: str, kind: str = "") -> None:
        super().__init__(message)
        self.kind = kind or type(self).__name__

    @classmethod
    def of(cls, exc: BaseException) -> TransportError:
        """The error for ``exc``: its class name, and its message where it has one."""
        kind = type(exc).__name__
        return cls(f"{kind}: {exc}" if str(exc) else kind, kind)


@dataclass(frozen=True, slots=True)
class Answer:
    """A worker's whole answer to a GET: its status and body."""

    status: int
    body: bytes
    content_type: str = ""

    def json(self) -> Any:
        """The body as JSON, whatever its content type; None for an empty body; ValueError if it is not JSON."""
        stripped = self.body.strip()
        return json.loads(stripped) if stripped else None


class Upstream(Protocol):
    """A worker's answer: its status line and headers have arrived, its body is read through this."""

    @property
    def status(self) -> int: ...

    @property
    def content_type(self) -> str: ...

    async def read(self) -> bytes:
        """The whole body (then released); :class:`TransportError` if it breaks off."""
        ...

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; :class:`TransportError` if it breaks off."""
        ...

    def close(self) -> None:
        """Drop the answer and its connection (a worker streaming to a client that left stops)."""
        ...


class Transport(Protocol):
    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> Upstream:
        """Send ``body`` (JSON) to ``url``; the answer once its headers arrived, or :class:`TransportError`."""
        ...

    async def get(self, url: str, timeout_s: float, max_bytes: int | None = None) -> Answer:
        """``GET url``: the status and the body (its first ``max_bytes`` when given), all within ``timeout_s``;
        a :class:`TransportError` (``"<kind>: <details>"``) when the worker cannot be reached, does not answer
        in time, or its body breaks off."""
        ...

    async def get_json(self, url: str, timeout_s: float) -> Any:
        """The JSON of a 200 answer to ``GET url`` within ``timeout_s``; None for anything else."""
        ...

    async def post_json(self, url: str, body: Any, timeout_s: float) -> Any:
        """The JSON of a 200 answer to ``POST url`` with ``body`` within ``timeout_s``; None for anything else."""
        ...

    async def aclose(self) -> None: ...


class _AiohttpUpstream:
    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    @property
    def status(self) -> int:
        return self._response.status

    @property
    def content_type(self) -> str:
        return self._response.headers.get("content-type", "application/json")

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise TransportError(f"read: {type(exc).__name__}", type(exc).__name__) from exc
        finally:
            self._response.release()

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}", type(exc).__name__) from exc

    def close(self) -> None:
        self._response.close()


class AiohttpTransport:
    """The router's client: one aiohttp session (made on first use, on the running loop), sending
    ``headers`` (the router's own credential) with every request."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float, headers: Mapping[str, str]) -> None:
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_read=read_timeout_s)
        self._headers = dict(headers)
        self._session: aiohttp.ClientSession | None = None

    @property
    def _client(self) -> aiohttp.ClientSession:
        """The router's one aiohttp session, made on first use (on the running loop)."""
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, auto_decompress=False, trust_env=False,
                headers=self._headers,
            )  # fmt: skip
        return self._session

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> Upstream:
        sent = dict(headers)
        if not any(name.lower() == "content-type" for name in sent):
            sent["Content-Type"] = "application/json"
        try:
            return _AiohttpUpstream(await self._client.post(url, data=body, headers=sent))
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise TransportError(f"connect: {type(exc).__name__}", type(exc).__name__) from exc

    async def get(self, url: str, timeout_s: float, max_bytes: int | None = None) -> Answer:
        try:
            async with self._client.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                body = await (response.read() if max_bytes is None else _read_at_most(response, max_bytes))
                return Answer(response.status, body, response.headers.get("content-type", ""))
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise TransportError.of(exc) from exc

    async def get_json(self, url: str, timeout_s: float) -> Any:
        return await self._json(self._client.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)))

    async def post_json(self, url: str, body: Any, timeout_s: float) -> Any:
        return await self._json(self._client.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)))

    @staticmethod
    async def _json(request: Any) -> Any:
        try:
            async with request as response:
                return await response.json() if response.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


async def _read_at_most(response: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    """The body's first ``max_bytes`` (a worker that sends more is cut off there)."""
    parts: list[bytes] = []
    size = 0
    while size < max_bytes:
        part = await response.content.read(max_bytes - size)
        if not part:
            break
        parts.append(part)
        size += len(part)
    return b"".join(parts)

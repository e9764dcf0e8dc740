"""What the worker's and the router's HTTP servers share against slow and greedy clients.

uvicorn bounds an idle keep-alive connection (``KEEP_ALIVE_S``) and, with ``limit_concurrency``, the
connections and requests at once (503 past ``LIMIT_CONCURRENCY``), but nothing bounds how long a client may
take to send its request headers: a client that opens connections and sends a header byte now and then
(slowloris) would hold them forever. :class:`HeaderTimeoutProtocol` closes a connection whose request
headers are not complete ``HEADER_TIMEOUT_S`` after the connection (or the previous response) began. Bodies
have their own bound, ``BODY_TIMEOUT_S``, checked where they are read (a 408).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# On a stream the router resumes on another worker (router/migrate.py): the original prompt's length in tokens,
# the rest of the resumed prompt being what the first worker generated. The worker's --verify-sample-rate
# check replays the stream from the original prompt with it.
RESUMED_PROMPT_TOKENS_HEADER = "x-splitserve-resumed-prompt-tokens"

HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
KEEP_ALIVE_S = 5
LIMIT_CONCURRENCY = 4096


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, closing connections whose request headers arrive too slowly."""

    _header_timer: asyncio.TimerHandle | None = None
    _in_headers = False  # a request's headers have begun and are not complete (a pipelined one, too)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = True
        if self._header_timer is None:
            self._arm()

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._disarm()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self._in_headers:  # an idle keep-alive connection is uvicorn's keep-alive timeout's to close
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def uvicorn_options() -> dict[str, Any]:
    """The ``uvicorn.Config`` settings both servers use."""
    return {"http": HeaderTimeoutProtocol, "limit_concurrency": LIMIT_CONCURRENCY, "timeout_keep_alive": KEEP_ALIVE_S}

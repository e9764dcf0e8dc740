"""A TCP balancer in a thread, as a Kubernetes Service or a local one in front of router replicas: each connection
goes to the next backend in turn that accepts it (one that refuses is skipped); bytes are relayed both ways."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Sequence

CONNECT_TIMEOUT_S = 1.0


class TCPBalancer:
    """``with TCPBalancer(["127.0.0.1:8001", ...]) as balancer:`` listens at ``balancer.url``."""

    def __init__(self, backends: Sequence[str]) -> None:
        self.backends = [(host, int(port)) for host, _, port in (b.rpartition(":") for b in backends)]
        self._turn = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: asyncio.AbstractServer | None = None
        self.port = 0
        self.num_skipped = 0  # connections a backend refused, sent to the next

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        start = next(self._turn)
        for i in range(len(self.backends)):
            host, port = self.backends[(start + i) % len(self.backends)]
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError):
                self.num_skipped += 1
                continue
            await asyncio.gather(self._pipe(client_reader, writer), self._pipe(reader, client_writer))
            return
        client_writer.close()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> TCPBalancer:
        threading.Thread(target=self._run, daemon=True).start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        def stop() -> None:
            if self._server is not None:
                self._server.close()
            self._loop.stop()

        self._loop.call_soon_threadsafe(stop)

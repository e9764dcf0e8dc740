"""A fault-injecting TCP proxy for tests: put it between two processes (router and worker, worker and Redis,
prefill and decode) and change what it does to the bytes while they talk.

Faults, settable at any time (they apply to the data forwarded from then on):
- ``latency_s``: every piece of data, either way, is forwarded this long after it arrived (pieces are not
  held back behind each other: a latency, not a bandwidth limit);
- ``bytes_per_s``: a bandwidth limit on each direction of each connection;
- ``slice_bytes``: data is forwarded in pieces of at most this many bytes, each flushed on its own;
- ``blackhole``: nothing more is forwarded either way; connections stay open and silent (a stalled peer);
- ``reset()``: every open connection is closed at once (a crashed peer, or a cut network); new ones work.
- ``refuse``: new connections are closed as soon as they are accepted.

With ``more_targets`` it is also a TCP balancer, as a Kubernetes Service in front of replicas
(:func:`balancer`): each connection goes to the next target in turn that accepts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

CONNECT_TIMEOUT_S = 1.0  # a target that does not accept within this is skipped


@dataclass
class FaultProxy:
    target_port: int
    target_host: str = "127.0.0.1"
    latency_s: float = 0.0
    bytes_per_s: float = 0.0
    slice_bytes: int = 0
    blackhole: bool = False
    refuse: bool = False
    more_targets: tuple[tuple[str, int], ...] = ()  # (host, port): connections take the targets in turn
    port: int = 0
    num_connections: int = 0
    _loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop, repr=False)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set, repr=False)
    _turn: itertools.count[int] = field(default_factory=itertools.count, repr=False)

    def __post_init__(self) -> None:
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), name="fault-proxy", daemon=True).start()
        ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)

        def quiet(loop: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
            if not isinstance(context.get("exception"), asyncio.CancelledError):  # connections cut at close()
                loop.default_exception_handler(context)

        self._loop.set_exception_handler(quiet)
        server = self._loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", self.port))
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        self._loop.run_forever()
        server.close()
        self._loop.close()

    def reset(self) -> None:
        """Close every open connection now (both sides see a reset or an early end)."""
        done = threading.Event()

        def close_all() -> None:
            for writer in list(self._writers):
                with contextlib.suppress(Exception):
                    writer.transport.abort()
            done.set()

        self._loop.call_soon_threadsafe(close_all)
        done.wait(5)

    def close(self) -> None:
        """Cut every connection, stop listening and end the proxy's thread."""

        async def shut() -> None:
            for writer in list(self._writers):
                writer.transport.abort()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        if self.refuse:
            client_writer.transport.abort()
            return
        opened = await self._connect()
        if opened is None:
            client_writer.transport.abort()
            return
        server_reader, server_writer = opened
        self.num_connections += 1
        self._writers |= {client_writer, server_writer}
        try:
            pipes = self._pipe(client_reader, server_writer), self._pipe(server_reader, client_writer)
            await asyncio.gather(*pipes, return_exceptions=True)
        finally:
            for writer in (client_writer, server_writer):
                self._writers.discard(writer)
                writer.close()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """A connection to the next target in turn that accepts one (None: none does)."""
        targets = [(self.target_host, self.target_port), *self.more_targets]
        first = next(self._turn)
        for i in range(len(targets)):
            host, port = targets[(first + i) % len(targets)]
            try:
                return await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError):
                continue
        return None

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        pending: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def forward() -> None:
            while (item := await pending.get()) is not None:
                due, data = item
                while self.blackhole:
                    await asyncio.sleep(0.05)
                if (wait_s := due - loop.time()) > 0:
                    await asyncio.sleep(wait_s)
                step = self.slice_bytes or len(data)
                for start in range(0, len(data), step):
                    writer.write(data[start : start + step])
                    await writer.drain()
                    if self.bytes_per_s:
                        await asyncio.sleep(min(step, len(data) - start) / self.bytes_per_s)

        forwarder = asyncio.create_task(forward())
        try:
            while data := await reader.read(1 << 16):
                pending.put_nowait((loop.time() + self.latency_s, data))
        finally:
            pending.put_nowait(None)
            with contextlib.suppress(Exception):
                await forwarder
                writer.write_eof()


def balancer(ports: Sequence[int]) -> FaultProxy:
    """A TCP balancer over local ``ports`` (connections in turn, a refusing port skipped); ``close()`` it."""
    return FaultProxy(ports[0], more_targets=tuple(("127.0.0.1", port) for port in ports[1:]))

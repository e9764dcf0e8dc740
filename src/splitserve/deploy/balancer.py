"""The TCP balancer in front of a local endpoint's router replicas (``spec.router.replicas`` above 1), as a
Kubernetes Service is in front of the router pods.

    python -m splitserve.deploy.balancer --port 8080 --target 127.0.0.1:41001 --target 127.0.0.1:41002

Each client connection goes to the next replica in turn that accepts it within ``CONNECT_TIMEOUT_S``, and its
bytes are relayed both ways until either side closes. A replica that refuses is skipped for ``DOWN_S`` (a killed
router refuses at once on this machine, so no client waits on it), and tried again after; when none accepts, the
client's connection is closed at once, so its HTTP client sees a failed connect it may retry, not a hang. The
routers need no shared state to be interchangeable (each follows every worker's KV events; ``router/events.py``),
so neither does the balancer: no stickiness, no parsing, nothing but bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import signal
import time
from collections.abc import Sequence

logger = logging.getLogger("splitserve.balancer")

CONNECT_TIMEOUT_S = 1.0
DOWN_S = 1.0  # a replica that refused is skipped this long
READ_BYTES = 1 << 16


class Balancer:
    """Connections to ``targets`` ((host, port) pairs) in turn, skipping those that do not accept."""

    def __init__(self, targets: Sequence[tuple[str, int]]) -> None:
        if not targets:
            raise ValueError("the balancer needs at least one target")
        self.targets = tuple(targets)
        self._turn = itertools.count()
        self._down_until = dict.fromkeys(self.targets, 0.0)

    async def handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        """One client connection: relayed to a replica, or closed at once when none accepts."""
        opened = await self.connect()
        if opened is None:
            client_writer.transport.abort()
            return
        server_reader, server_writer = opened
        try:
            await asyncio.gather(
                _pipe(client_reader, server_writer), _pipe(server_reader, client_writer), return_exceptions=True
            )
        finally:
            for writer in (client_writer, server_writer):
                writer.close()

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """A connection to the next replica in turn that accepts one; replicas down are tried last."""
        first, now = next(self._turn), time.monotonic()
        ordered = [self.targets[(first + i) % len(self.targets)] for i in range(len(self.targets))]
        ordered.sort(key=lambda target: self._down_until[target] > now)  # stable: the turn among the live ones
        for target in ordered:
            try:
                return await asyncio.wait_for(asyncio.open_connection(*target), CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError) as exc:
                if self._down_until[target] <= now:
                    logger.warning("router replica %s:%d does not accept connections: %s", *target, exc)
                self._down_until[target] = time.monotonic() + DOWN_S
        logger.error("no router replica accepts connections")
        return None


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Bytes from ``reader`` to ``writer`` until the end, then the end passed on (a half close)."""
    while data := await reader.read(READ_BYTES):
        writer.write(data)
        await writer.drain()
    with contextlib.suppress(OSError):
        if writer.can_write_eof():
            writer.write_eof()


def parse_target(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"a target is HOST:PORT, got {text!r}")
    return host, int(port)


async def serve(host: str, port: int, targets: Sequence[tuple[str, int]]) -> None:
    """Listen on ``host:port`` until SIGTERM or SIGINT."""
    balancer = Balancer(targets)
    server = await asyncio.start_server(balancer.handle, host, port, reuse_address=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    logger.info("balancing %s:%d over %s", host, port, ", ".join(f"{h}:{p}" for h, p in targets))
    async with server:
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--target", type=parse_target, action="append", required=True, help="a replica's HOST:PORT")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(args.host, args.port, args.target))


if __name__ == "__main__":
    main()

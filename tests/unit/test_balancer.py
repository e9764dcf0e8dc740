"""The TCP balancer in front of local router replicas: connections in turn, a replica that refuses skipped at once,
none accepting closed at once (never a hang), and bytes relayed both ways with half closes."""

from __future__ import annotations

import asyncio
import socket

import pytest

from splitserve.deploy.balancer import Balancer, parse_target


def closed_port() -> int:
    """A local port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def named_server(name: bytes) -> tuple[asyncio.Server, int]:
    """A replica that answers each connection with its name, then echoes what it reads until the end."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(name + b":")
        writer.write(await reader.read())  # until the client's half close
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def ask(port: int, data: bytes = b"hello") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    writer.write_eof()
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return answer


async def front(targets: list[tuple[str, int]]) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(Balancer(targets).handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_connections_take_the_replicas_in_turn_and_skip_one_that_refuses() -> None:
    async def scenario() -> None:
        a, port_a = await named_server(b"a")
        b, port_b = await named_server(b"b")
        dead = closed_port()
        balancer, port = await front([("127.0.0.1", port_a), ("127.0.0.1", dead), ("127.0.0.1", port_b)])
        answers = [await ask(port, b"x" * 100_000) for _ in range(6)]
        # the dead one's turns go to the next live one; once it has refused, it is tried last
        assert [answer[:2] for answer in answers] == [b"a:", b"b:", b"b:", b"a:", b"b:", b"b:"]
        assert all(answer[2:] == b"x" * 100_000 for answer in answers)  # relayed whole, both ways
        for server in (a, b, balancer):
            server.close()

    asyncio.run(scenario())


def test_with_no_replica_accepting_a_client_sees_its_connection_closed_at_once() -> None:
    async def scenario() -> None:
        balancer, port = await front([("127.0.0.1", closed_port()), ("127.0.0.1", closed_port())])
        loop = asyncio.get_running_loop()
        began = loop.time()
        assert await ask(port) == b""  # closed, no answer
        assert loop.time() - began < 1.0
        balancer.close()

    asyncio.run(scenario())


def test_a_target_is_host_and_port() -> None:
    assert parse_target("127.0.0.1:8080") == ("127.0.0.1", 8080)
    with pytest.raises(Exception, match="HOST:PORT"):
        parse_target("8080")
    with pytest.raises(ValueError, match="at least one"):
        Balancer([])

"""Throw-away redis-server processes for the tests: a plain one (``RedisServer``) and one configured from stdin
with a password, ACLs or TLS (``ConfiguredRedis``)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time

import redis

from tests.support.workers import free_port

REDIS_SERVER = shutil.which("redis-server")
PASSWORD = "redis-pass-0123456789"


class RedisServer:
    """A throw-away redis-server on a free port, no persistence."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert REDIS_SERVER is not None
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # in case a test left it stopped
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)


class ConfiguredRedis:
    """A redis-server reading ``config`` from stdin (so no secret is in its argv), on a free port."""

    def __init__(self, config: list[str], tls: bool = False) -> None:
        self.port = free_port()
        lines = ["bind 127.0.0.1", 'save ""', "appendonly no", *config]
        lines.append(f"tls-port {self.port}\nport 0" if tls else f"port {self.port}")
        assert REDIS_SERVER is not None
        self.process = subprocess.Popen(
            [REDIS_SERVER, "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        assert self.process.stdin is not None
        self.process.stdin.write("\n".join(lines).encode() + b"\n")
        self.process.stdin.close()
        deadline = time.monotonic() + 10
        while socket.socket().connect_ex(("127.0.0.1", self.port)) != 0:
            assert self.process.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(10)

"""Real ``splitserve worker`` and ``splitserve router`` subprocesses for end-to-end tests: start, wait for
health, stop, read their logs and metrics."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from splitserve.metrics import sum_samples

STARTUP_TIMEOUT_S = 240.0


_HANDED_OUT: set[int] = set()  # ports free_port gave this test process: it never gives one twice


def free_port() -> int:
    """A port nothing listens on now, and that this process has not handed out before (processes started
    together each get their own, though none has bound its port yet)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


@contextlib.contextmanager
def stopping_on_failure(stop: Callable[[], None]) -> Iterator[None]:
    """Run the block; if it fails (a process never got healthy), ``stop`` every process started before it raises:
    a fixture that fails while starting leaves no process behind."""
    try:
        yield
    except BaseException:
        stop()
        raise


class WorkerProcess:
    """``splitserve worker --model smollm2 --port <port> <args>``; stdout and stderr go to ``log_path``."""

    subcommand = "worker"

    def __init__(self, log_path: Path, args: Sequence[str], port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [sys.executable, "-c", "from splitserve.cli import main; main()", self.subcommand,
                   "--model", "smollm2", "--port", str(self.port), *args]  # fmt: skip
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)

    def complete(self, prompt: str, max_tokens: int = 8, **extra: object) -> httpx.Response:
        """A greedy completion (``temperature`` 0 unless ``extra`` says otherwise)."""
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
        return httpx.post(f"{self.url}/v1/completions", json=body, timeout=180)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples named ``name`` whose labels include ``labels``."""
        return sum_samples(httpx.get(f"{self.url}/metrics", timeout=10).text, name, **labels)

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self) -> None:
        """Return once ``/health`` is 200; fail with the log if the process exits or takes too long."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"worker exited early:\n{self.logs()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"worker not healthy after {STARTUP_TIMEOUT_S} s:\n{self.logs()}")

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> int:
        """``sig`` (SIGTERM), then SIGKILL after 20 s; returns the exit status (-9 when it had to be killed)."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return -9
        finally:
            self._log.close()


class RouterProcess(WorkerProcess):
    """``splitserve router --model smollm2 --port <port> --admin-port <free port> <args>`` (healthy once some
    worker is); ``admin_url`` is its admin listener (``/admin/*``)."""

    subcommand = "router"

    def __init__(self, log_path: Path, args: Sequence[str], port: int | None = None) -> None:
        self.admin_port = free_port()
        self.admin_url = f"http://127.0.0.1:{self.admin_port}"
        super().__init__(log_path, ["--admin-port", str(self.admin_port), *args], port)

    def worker_states(self) -> list[dict[str, Any]]:
        """The admin listing of the router's workers (url, role, healthy, in_flight, breaker, ...)."""
        return list(httpx.get(f"{self.admin_url}/admin/workers", timeout=5).json()["workers"])

    def wait_every_worker_healthy(self, timeout_s: float = 60.0) -> None:
        """Return once the router's probes have found every worker healthy. Its own ``/health`` is 200 as soon
        as one is, so a test that cares which worker serves (sessions, migration) waits for this first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(state["healthy"] is True for state in self.worker_states()):
                return
            time.sleep(0.1)
        raise AssertionError(f"router workers not all healthy after {timeout_s} s: {self.worker_states()}")

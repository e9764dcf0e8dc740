"""Helpers shared by the benchmark scripts: start servers, wait for health, run ``splitserve bench serve``."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
SPLITSERVE = [str(Path(sys.executable).parent / "splitserve")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_server(
    cmd: Sequence[str], port: int, log_path: Path, env: dict[str, str] | None = None, timeout_s: float = 600.0
) -> subprocess.Popen[bytes]:
    """Start a server process and wait until ``/health`` answers 200; raises if it dies or times out."""
    log = log_path.open("wb")
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.close()
            tail = log_path.read_text(errors="replace").splitlines()[-15:]
            raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}; {log_path} ends:\n" + "\n".join(tail))
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"server on port {port} not healthy after {timeout_s}s; see {log_path}")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def bench_serve(url: str, model: str, label: str, args: Sequence[str]) -> dict[str, Any]:
    """Run ``splitserve bench serve`` and return its JSON summary (with the label)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            *SPLITSERVE,
            "bench",
            "serve",
            "--url",
            url,
            "--model",
            model,
            "--label",
            label,
            "--no-progress",
            "--json",
            str(out),
            *args,
        ]
        subprocess.run(cmd, check=True)
        document: dict[str, Any] = json.loads(out.read_text())
    return document


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` (with ``labels``) on ``url``'s ``/metrics`` page."""
    from splitserve.metrics import sum_samples

    return sum_samples(httpx.get(f"{url}/metrics", timeout=10.0).text, name, **labels)


def time_calls(owner: Any, name: str, part: str, spent: dict[str, float]) -> None:
    """Replace ``owner.name`` by a wrapper that adds each call's seconds to ``spent[part]`` (profiling by part)."""
    inner = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[part] = spent.get(part, 0.0) + time.perf_counter() - began

    setattr(owner, name, wrapper)


def machine_description() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores, {cpu}"


def write_result(path: Path, benchmark: str, args: argparse.Namespace, results: Any) -> None:
    """Write a benchmark's JSON document (name, date, machine, its arguments, its results) and say where."""
    document = {
        "benchmark": benchmark,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_description(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "results": results,
    }
    path.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {path}")

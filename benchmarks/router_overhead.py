"""Router overhead, one run: latency a router adds and the requests/s it sustains, against a fast stub backend.

    .venv/bin/python benchmarks/router_overhead.py [--targets direct,splitserve,vllm-router]
        [--vllm-router-bin /work/vllm-router-venv/bin/vllm-router]

The backend is ``benchmarks/stub_openai_server.py`` (no model: a fixed 5-token completion at once), so what a
router adds is most of what there is to see. Targets, each measured against the same stub process:

- direct: straight to the stub.
- splitserve: ``splitserve router --routing-strategy roundrobin`` with the stub as its one backend.
- splitserve-no-migration: the same with ``--no-stream-migration``: what following each stream event by event
  (to resume it elsewhere should its worker fail) costs.
- splitserve-keys: the same with a client key (``--api-key``) and a cluster secret: what checking the key and
  sending the router's own credential instead of the client's costs.
- vllm-router: the Rust router from PyPI (``pip install vllm-router`` into a separate environment, never a
  splitserve dependency) with ``--policy round_robin``; skipped unless ``--vllm-router-bin`` names its
  ``vllm-router`` script (or the Python of its environment).

Per target: the latency of ``num_sequential`` small non-streaming completions sent one at a time on one
keep-alive connection (p50/p99; added latency = target p50 - direct p50 of the same run); the TTFT of
streaming completions sent the same way; and requests/s with ``concurrency`` keep-alive connections sending
back to back for ``duration_s``, with the CPU time each process spent per request meanwhile.

The load generator is this script's own process: a minimal HTTP/1.1 client on asyncio streams (uvloop when
installed), cheaper per request than httpx so that it takes less of the CPU from the servers. Stub, router and
load generator still share this machine's cores: on a 2-core machine the requests/s is that of the three
together, not the router's ceiling; the CPU microseconds per request are the figure that does not depend on
it. Results go to ``benchmarks/results/router_overhead.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

import httpx
from common import REPO, SPLITSERVE, free_port, machine_description, start_server, stop_server

MODEL = "smollm2"
HOST = "127.0.0.1"
STUB = Path(__file__).resolve().parent / "stub_openai_server.py"
COMPLETIONS_PATH = "/v1/completions"
COMPLETION = {"model": MODEL, "prompt": "Say hello.", "max_tokens": 5}
STREAMING_COMPLETION = {**COMPLETION, "stream": True}
EXPECTED_TEXT = "Hello from the stub."  # the stub's fixed completion
API_KEY = "bench-client-key-0123456789abcdef"  # every request carries it; only splitserve-keys checks it
AUTHORIZATION = {"Authorization": f"Bearer {API_KEY}"}
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
BLOCK_SIZE = 100  # sequential requests per turn when a router and its direct baseline alternate

T = TypeVar("T")


class TargetName(StrEnum):
    DIRECT = "direct"
    SPLITSERVE = "splitserve"
    SPLITSERVE_KEYS = "splitserve-keys"
    SPLITSERVE_NO_MIGRATION = "splitserve-no-migration"
    VLLM_ROUTER = "vllm-router"


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """How hard each target is driven; the same for every target."""

    num_sequential: int = 2000  # timed non-streaming requests, one at a time on one connection
    num_streaming: int = 500  # timed streaming requests, one at a time on one connection (TTFT)
    num_warmup: int = 200  # untimed requests before each sequential phase
    concurrency: int = 32  # connections of the throughput phase, each sending back to back
    duration_s: float = 5.0  # length of the throughput phase
    warmup_s: float = 1.0  # untimed throughput phase before it

    def __post_init__(self) -> None:
        values = asdict(self)
        if any(value <= 0 for value in values.values()):
            raise ValueError(f"every load setting must be positive, got {values}")


class TargetUnavailable(RuntimeError):
    """A router could not be started (not installed, or it exited or never became healthy)."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A running target: where to send requests and which process tree serves them (none for direct)."""

    name: TargetName
    port: int
    router_pid: int | None


@dataclass(slots=True)
class Reply:
    """One timed request: status, seconds to the first body bytes and to the whole response."""

    status: int
    first_byte_s: float
    total_s: float


class HttpConnection:
    """One keep-alive HTTP/1.1 connection that sends pre-built requests and times their responses.

    Understands ``content-length`` and ``chunked`` responses (enough for these servers) and reconnects when a
    response says ``connection: close``. One request at a time: the caller awaits each ``send``.
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self.num_connects = 0
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def send(self, request: bytes) -> Reply:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(HOST, self.port)
            self.num_connects += 1
        assert self._reader is not None  # opened together with the writer
        start = time.perf_counter()
        self._writer.write(request)
        status, headers = await _read_head(self._reader)
        first_byte_s = await _read_body(self._reader, headers) - start
        reply = Reply(status, first_byte_s, time.perf_counter() - start)
        if headers.get("connection", "").lower() == "close":
            await self.close()
        return reply

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            await self._writer.wait_closed()
        self._reader = self._writer = None


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status code and the headers (lower-case names) of one response."""
    status_line, *lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split(" ", 2)[1]), headers


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> float:
    """Read one response body; return the ``perf_counter`` time its first bytes (or its end) arrived."""
    if "content-length" in headers:
        await reader.readexactly(int(headers["content-length"]))
        return time.perf_counter()
    if headers.get("transfer-encoding", "").lower() != "chunked":
        raise RuntimeError(f"response without content-length or chunked encoding: {headers}")
    first_s = None
    while size := int((await reader.readline()).split(b";", 1)[0], 16):
        await reader.readexactly(size + 2)  # the chunk and its CRLF
        first_s = first_s or time.perf_counter()
    while await reader.readline() not in (b"\r\n", b""):  # trailers, then the blank line
        pass
    return first_s or time.perf_counter()


def build_request(port: int, payload: dict[str, Any]) -> bytes:
    body = json.dumps(payload).encode()
    head = (
        f"POST {COMPLETIONS_PATH} HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def run_async(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run on uvloop when it is installed (a cheaper load generator), else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def percentiles_ms(seconds: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(seconds, n=100, method="inclusive")
    return {"p50_ms": cuts[49] * 1000, "p99_ms": cuts[98] * 1000, "mean_ms": statistics.fmean(seconds) * 1000}


async def sequential(ports: list[int], payload: dict[str, Any], num: int, num_warmup: int) -> list[list[Reply]]:
    """``num_warmup`` untimed then ``num`` timed requests to each port, one at a time on one connection per port.

    The ports take turns in blocks of ``BLOCK_SIZE`` requests, so that a change in the machine's background load
    falls on all of them alike. Returns the replies per port, in the order of ``ports``; raises on a non-200.
    """
    connections = [HttpConnection(port) for port in ports]
    requests = [build_request(port, payload) for port in ports]
    replies: list[list[Reply]] = [[] for _ in ports]
    try:
        for connection, request in zip(connections, requests, strict=True):
            for _ in range(num_warmup):
                await connection.send(request)
        for start in range(0, num, BLOCK_SIZE):
            for connection, request, mine in zip(connections, requests, replies, strict=True):
                mine.extend([await connection.send(request) for _ in range(min(BLOCK_SIZE, num - start))])
    finally:
        await asyncio.gather(*(c.close() for c in connections))
    failed = [r.status for mine in replies for r in mine if r.status != 200]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, statuses {sorted(set(failed))}")
    return replies


@dataclass(slots=True)
class LoadRun:
    """What ``concurrency`` connections sending back to back achieved in one window."""

    elapsed_s: float
    latencies_s: list[float] = field(default_factory=list)
    num_errors: int = 0
    num_connects: int = 0


async def saturate(port: int, request: bytes, concurrency: int, duration_s: float) -> LoadRun:
    """Every connection sends until ``duration_s`` has passed; a request in flight then still completes."""
    connections = [HttpConnection(port) for _ in range(concurrency)]
    await asyncio.gather(*(c.send(request) for c in connections))  # connect and warm each one, untimed
    start = time.perf_counter()
    deadline = start + duration_s
    run = LoadRun(elapsed_s=0.0)

    async def client(connection: HttpConnection) -> None:
        while time.perf_counter() < deadline:
            reply = await connection.send(request)
            run.latencies_s.append(reply.total_s)
            run.num_errors += reply.status != 200

    await asyncio.gather(*(client(c) for c in connections))
    run.elapsed_s = time.perf_counter() - start
    run.num_connects = sum(c.num_connects for c in connections) - concurrency
    await asyncio.gather(*(c.close() for c in connections))
    return run


def tree_cpu_s(root_pid: int) -> float:
    """User + system CPU seconds of ``root_pid`` and its live descendants, from ``/proc``."""
    children: dict[int, list[int]] = {}
    cpu_s: dict[int, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # fields[0] is field 3 of proc(5)
        except (OSError, IndexError):
            continue  # the process ended meanwhile
        pid = int(stat.parent.name)
        children.setdefault(int(fields[1]), []).append(pid)
        cpu_s[pid] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S
    total, stack = 0.0, [root_pid]
    while stack:
        pid = stack.pop()
        total += cpu_s.get(pid, 0.0)
        stack.extend(children.get(pid, []))
    return total


def cpu_snapshot(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each named process tree, and of this process (the load generator)."""
    snapshot = {name: tree_cpu_s(pid) for name, pid in pids.items()}
    snapshot["load_generator"] = time.process_time()
    return snapshot


def measure_throughput(endpoint: Endpoint, stub_pid: int, config: LoadConfig) -> dict[str, Any]:
    request = build_request(endpoint.port, COMPLETION)
    run_async(saturate(endpoint.port, request, config.concurrency, config.warmup_s))
    pids = {"stub": stub_pid} | ({"router": endpoint.router_pid} if endpoint.router_pid else {})
    before = cpu_snapshot(pids)
    run = run_async(saturate(endpoint.port, request, config.concurrency, config.duration_s))
    after = cpu_snapshot(pids)
    num_requests = len(run.latencies_s)
    return {
        "requests_per_s": num_requests / run.elapsed_s,
        "num_requests": num_requests,
        "num_errors": run.num_errors,
        "num_reconnects": run.num_connects,
        "latency": percentiles_ms(run.latencies_s),
        "cpu_us_per_request": {name: (after[name] - before[name]) / num_requests * 1e6 for name in before},
    }


def measure(endpoint: Endpoint, stub_port: int, stub_pid: int, config: LoadConfig) -> dict[str, Any]:
    """Every figure of one target, in this order: sequential latency, streaming TTFT, throughput.

    A router's sequential requests alternate with requests straight to the stub (its paired baseline), and its
    ``added`` latency is measured against that baseline.
    """
    check_target(endpoint.port)
    ports = [endpoint.port] if endpoint.router_pid is None else [endpoint.port, stub_port]
    plain = run_async(sequential(ports, COMPLETION, config.num_sequential, config.num_warmup))
    streamed = run_async(sequential(ports, STREAMING_COMPLETION, config.num_streaming, config.num_warmup))
    figures = [latency_figures(p, s) for p, s in zip(plain, streamed, strict=True)]
    result = figures[0]
    if len(figures) == 2:
        result["added"] = added_latency(result, figures[1])
    result["load_average_1m"] = os.getloadavg()[0]  # other processes on the machine, before the saturation run
    result["throughput"] = measure_throughput(endpoint, stub_pid, config)
    return result


def latency_figures(plain: list[Reply], streamed: list[Reply]) -> dict[str, Any]:
    return {
        "latency": percentiles_ms([r.total_s for r in plain]),
        "ttft": percentiles_ms([r.first_byte_s for r in streamed]),
        "stream_total": percentiles_ms([r.total_s for r in streamed]),
    }


def added_latency(target: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """Target minus baseline, and the baseline itself (direct to the stub, interleaved with the target)."""
    return {
        "p50_ms": target["latency"]["p50_ms"] - baseline["latency"]["p50_ms"],
        "p99_ms": target["latency"]["p99_ms"] - baseline["latency"]["p99_ms"],
        "ttft_p50_ms": target["ttft"]["p50_ms"] - baseline["ttft"]["p50_ms"],
        "baseline": baseline,
    }


def check_target(port: int) -> None:
    """One non-streaming and one streaming completion through httpx: the stub's answer must come back whole."""
    url = f"http://{HOST}:{port}{COMPLETIONS_PATH}"
    reply = httpx.post(url, json=COMPLETION, headers=AUTHORIZATION, timeout=10)
    reply.raise_for_status()
    text = reply.json()["choices"][0]["text"]
    if text != EXPECTED_TEXT:
        raise RuntimeError(f"expected the stub's {EXPECTED_TEXT!r}, got {text!r}")
    with httpx.stream("POST", url, json=STREAMING_COMPLETION, headers=AUTHORIZATION, timeout=10) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    if events[-1] != "data: [DONE]" or len(events) < 2:
        raise RuntimeError(f"streaming answer does not end with [DONE]: {events}")


def router_command(
    name: TargetName, port: int, backend_url: str, vllm_router_bin: Path | None, logs: Path
) -> list[str]:
    if name in (TargetName.SPLITSERVE, TargetName.SPLITSERVE_KEYS, TargetName.SPLITSERVE_NO_MIGRATION):
        args = ["router", "--model", MODEL, "--host", HOST, "--port", str(port), "--backend", backend_url]
        if name is TargetName.SPLITSERVE_KEYS:
            secret = logs / "router-overhead-cluster-secret"
            secret.write_text("bench-cluster-secret\n")
            args += ["--api-key", API_KEY, "--cluster-secret-file", str(secret)]
        if name is TargetName.SPLITSERVE_NO_MIGRATION:
            args.append("--no-stream-migration")  # streams relayed byte for byte, not followed event by event
        return [*SPLITSERVE, *args, "--routing-strategy", "roundrobin"]
    assert vllm_router_bin is not None  # main() skips vllm-router without it
    # the environment's Python runs the same launcher as its ``vllm-router`` script
    launcher = ["-m", "vllm_router.launch_router"] if vllm_router_bin.name.startswith("python") else []
    args = ["--host", HOST, "--port", str(port), "--worker-urls", backend_url, "--policy", "round_robin"]
    return [str(vllm_router_bin), *launcher, *args, "--prometheus-port", str(free_port()), "--log-level", "warning"]


@contextmanager
def running(name: TargetName, stub_port: int, vllm_router_bin: Path | None, logs: Path) -> Iterator[Endpoint]:
    """The target ready to take requests; a router process is stopped on exit."""
    if name is TargetName.DIRECT:
        yield Endpoint(name, stub_port, None)
        return
    port = free_port()
    command = router_command(name, port, f"http://{HOST}:{stub_port}", vllm_router_bin, logs)
    log_path = logs / f"router-overhead-{name}.log"
    try:
        proc = start_server(command, port, log_path, timeout_s=120)
    except (OSError, RuntimeError) as error:
        raise TargetUnavailable(f"{error} ({last_log_line(log_path)})") from error
    try:
        yield Endpoint(name, port, proc.pid)
    finally:
        stop_server(proc)


def last_log_line(log_path: Path) -> str:
    """The last line of a server's log that has letters in it: usually why it exited."""
    lines = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
    wordy = [line.strip(" │╭╮╰╯─") for line in lines if any(c.isalpha() for c in line)]
    return wordy[-1] if wordy else "empty log"


def add_throughput_ratios(results: dict[str, Any]) -> None:
    """Each router's requests/s as a share of direct's, when direct was measured."""
    direct = results.get(TargetName.DIRECT)
    for name, result in results.items():
        if direct is not None and name != TargetName.DIRECT:
            ratio = result["throughput"]["requests_per_s"] / direct["throughput"]["requests_per_s"]
            result["added"]["requests_per_s_ratio"] = ratio


def print_tables(document: dict[str, Any]) -> None:
    print_latency_table(document["targets"])
    print_throughput_table(document["targets"], document["load"]["concurrency"])
    for name, reason in document["skipped"].items():
        print(f"skipped {name}: {reason}")
    print(f"\nNote: {document['note']}")


def print_latency_table(targets: dict[str, Any]) -> None:
    print(
        "\n| target | p50 ms | p99 ms | its direct p50 ms | added p50 ms | added p99 ms | TTFT p50 ms | added TTFT ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, result in targets.items():
        latency, added = result["latency"], result.get("added")
        cells = [f"{latency['p50_ms']:.3f}", f"{latency['p99_ms']:.3f}", "-", "-", "-"]
        if added:
            cells[2:] = [f"{added['baseline']['latency']['p50_ms']:.3f}", f"{added['p50_ms']:+.3f}"]
            cells.append(f"{added['p99_ms']:+.3f}")
        cells.append(f"{result['ttft']['p50_ms']:.3f}")
        cells.append(f"{added['ttft_p50_ms']:+.3f}" if added else "-")
        print(f"| {name} | {' | '.join(cells)} |")


def print_throughput_table(targets: dict[str, Any], concurrency: int) -> None:
    print(
        f"\n| target | req/s ({concurrency} conns) | p50 ms | p99 ms | errors | CPU µs/req: stub | router | load gen |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, result in targets.items():
        throughput = result["throughput"]
        latency, cpu = throughput["latency"], throughput["cpu_us_per_request"]
        router_cpu = f"{cpu['router']:.0f}" if "router" in cpu else "-"
        print(
            f"| {name} | {throughput['requests_per_s']:,.0f} | {latency['p50_ms']:.2f} | {latency['p99_ms']:.2f} | "
            f"{throughput['num_errors']} | {cpu['stub']:.0f} | {router_cpu} | {cpu['load_generator']:.0f} |"
        )


def parse_targets(text: str) -> list[TargetName]:
    try:
        return [TargetName(name.strip()) for name in text.split(",") if name.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{error}; choose from {', '.join(TargetName)}") from None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", type=parse_targets, default=list(TargetName), help="comma-separated")
    parser.add_argument("--vllm-router-bin", type=Path, help="its `vllm-router` script, or its env's Python")
    defaults = LoadConfig()
    parser.add_argument("--num-sequential", type=int, default=defaults.num_sequential)
    parser.add_argument("--num-streaming", type=int, default=defaults.num_streaming)
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)
    parser.add_argument("--duration-s", type=float, default=defaults.duration_s)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "router_overhead.json")
    return parser.parse_args()


def measure_all(args: argparse.Namespace, config: LoadConfig, logs: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """Start the stub, measure each target against it in turn; the results, and why targets were skipped."""
    skipped: dict[str, str] = {}
    if TargetName.VLLM_ROUTER in args.targets and args.vllm_router_bin is None:
        skipped[TargetName.VLLM_ROUTER] = "no --vllm-router-bin given"
    stub_port = free_port()
    stub_cmd = [sys.executable, str(STUB), "--port", str(stub_port), "--model", MODEL]
    stub = start_server(stub_cmd, stub_port, logs / "router-overhead-stub.log", timeout_s=60)
    results: dict[str, Any] = {}
    try:
        for name in (t for t in args.targets if t not in skipped):
            print(f"measuring {name} ...", flush=True)
            try:
                with running(name, stub_port, args.vllm_router_bin, logs) as endpoint:
                    results[name] = measure(endpoint, stub_port, stub.pid, config)
            except TargetUnavailable as error:
                skipped[name] = str(error)
    finally:
        stop_server(stub)
    add_throughput_ratios(results)
    return results, skipped


def note() -> str:
    return (
        f"stub, router and load generator (this script's process) share the machine's {os.cpu_count()} cores, so "
        "req/s is the three together (and other work on the machine takes its share: see load_average_1m), not a "
        "router's ceiling; CPU µs/request depends much less on that. Latencies: one request at a time on one "
        "keep-alive connection; added = router minus direct to the stub, measured interleaved with it in blocks "
        f"of {BLOCK_SIZE} requests."
    )


def main() -> None:
    args = parse_args()
    config = LoadConfig(
        num_sequential=args.num_sequential,
        num_streaming=args.num_streaming,
        concurrency=args.concurrency,
        duration_s=args.duration_s,
    )
    logs = args.out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    load_average_1m = os.getloadavg()[0]  # other work on the machine competes for the same cores
    results, skipped = measure_all(args, config, logs)
    document = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_description(),
        "python": sys.version.split()[0],
        "load": asdict(config),
        "load_average_1m_before": load_average_1m,
        "note": note(),
        "targets": results,
        "skipped": skipped,
    }
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    print_tables(document)


if __name__ == "__main__":
    main()

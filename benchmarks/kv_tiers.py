"""Tiered KV cache figures, one run: TTFT of a ~2,500-token prompt cold, from the engine's own prefix cache, from
L1, from L2 Redis and from L2 disk on another worker; and the tiers' read/write bandwidth.

    .venv/bin/python benchmarks/kv_tiers.py [--kv-cache-dtype int8]

Real ``splitserve worker`` processes (SmolLM2-135M, default dtype, ``--num-threads 2``), one running at a time,
and a ``redis-server`` the script starts on a free port. TTFT is measured with streaming, greedy requests
(``max_tokens`` 1 and 16), as the median over 3 distinct prompts; each prompt is asked once per source, and the
worker's ``/metrics`` tell how many of its tokens were computed, not loaded. Results go to
``benchmarks/results/kv_tiers.json``.

Sources:
- cold: worker A (L1 + L2 Redis), a prompt it never saw (nothing in any tier).
- engine prefix cache: worker A, the same prompt again at once.
- L2 Redis: worker B (fresh process, empty L1, the same Redis), the prompts A computed.
- L2 disk: worker D2 (fresh process, empty L1), the directory worker D1 filled by computing the prompts.
- L1: worker C, whose engine KV cache holds ~3,000 tokens (``--kv-cache-memory 68MiB``; 136MiB for a float32
  cache, 37MiB for an int8 one) and an L1 of 2 GiB;
  every prompt is computed once, and asked again after two other prompts have evicted it from the engine.

Bandwidth: each tier writes 40 records of a 256-token chunk and reads them 10 per call; beside them, what the
same bytes cost without a tier: a plain socket's SET/GET to the same Redis into buffers already in memory, and
``dd`` writing and reading a file of that size through the page cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import redis
import torch
from common import REPO, SPLITSERVE, free_port, machine_description, start_server, stop_server

from splitserve.bench.client import OpenAIStreamClient, RequestResult
from splitserve.bench.datasets import BenchRequest
from splitserve.keys import cache_key, kv_layout
from splitserve.kvcache import serde
from splitserve.kvcache.cpu import CPUTier
from splitserve.kvcache.disk import DiskTier
from splitserve.kvcache.redis import RedisTier
from splitserve.kvcache.tiers import KVTier
from splitserve.metrics import sum_samples

MODEL = "smollm2"
MAX_TOKENS = (1, 16)
NUM_PROMPTS = 3  # per max_tokens value
NUM_FACTS = 130  # about 2,500 tokens
TOPICS = ("apricot", "basalt", "cobalt", "dune", "ember", "fjord", "glacier", "harbor")
COLORS = ("red", "blue", "green", "amber", "violet", "teal", "ochre", "grey")
BASE_ARGS = ["--model", MODEL, "--num-threads", "2"]  # the default dtype: bfloat16 on this machine
# 193 blocks of 16 tokens in bfloat16, twice the bytes for a float32 KV cache (the AVX2 class), 68 bytes per 128
# for an int8 one (--kv-cache-dtype int8)
SMALL_ENGINE_CACHE_MIB = 68
KV_BYTES_VS_BF16 = {"bfloat16": 1.0, "float32": 2.0, "int8": 68 / 128, "fp8_e4m3": 68 / 128}

# the record of one 256-token chunk of SmolLM2 (30 layers, 3 KV heads of 64) in bfloat16: 5.9 MB
CHUNK_SHAPE = (30, 2, 256, 3, 64)
LAYOUT = kv_layout("bfloat16", 30, 3, 64, 16)
NUM_BANDWIDTH_RECORDS = 40
RECORDS_PER_READ = 10  # one lookup of a ~2,500-token prompt


def long_prompt(topic: str, num_facts: int = NUM_FACTS) -> str:
    """A prompt whose first words (its first KV block) differ for every topic."""
    facts = [f"Fact {i}: the {COLORS[i % 8]} {topic} number {i} holds {i * 7 % 50} marbles." for i in range(num_facts)]
    return f"{topic.title()} inventory. " + " ".join(facts) + f" Question: how many marbles does {topic} 3 hold?"


@dataclass(slots=True)
class Sample:
    """One timed request."""

    max_tokens: int
    ttft_ms: float
    num_prompt_tokens: int
    num_from_engine: int  # prompt tokens found in the engine's own prefix cache
    num_loaded: int  # prompt tokens loaded from L1/L2
    num_computed: int  # the rest


class Worker:
    """A running ``splitserve worker``; ``ask`` times one streaming request and counts what it computed."""

    def __init__(self, extra_args: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [*SPLITSERVE, "worker", *BASE_ARGS, "--port", str(self.port), *extra_args]
        self.log_path = log_path
        self.proc = start_server(cmd, self.port, log_path)

    def ask(self, prompt: str, max_tokens: int) -> Sample:
        engine_before, loaded_before = self._cached_tokens()
        result = asyncio.run(_stream(self.url, BenchRequest(max_tokens=max_tokens, prompt=prompt)))
        if not result.success or result.ttft_s is None:
            raise RuntimeError(f"request failed: {result.error}; see {self.log_path}")
        time.sleep(0.2)  # the engine thread publishes its stats right after the step that answered
        engine_after, loaded_after = self._cached_tokens()
        num_engine, num_loaded = engine_after - engine_before, loaded_after - loaded_before
        num_computed = result.prompt_tokens - num_engine - num_loaded
        return Sample(max_tokens, result.ttft_s * 1000, result.prompt_tokens, num_engine, num_loaded, num_computed)

    def warm_up(self) -> None:
        """One unrelated ~1,200-token request, so the first timed one pays no one-time costs."""
        self.ask(long_prompt("lantern", num_facts=70), 2)

    def _cached_tokens(self) -> tuple[int, int]:
        """Prompt tokens so far found in the engine's prefix cache, and loaded from L1/L2."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return (
            round(sum_samples(text, "vllm:prefix_cache_hits_total")),
            round(sum_samples(text, "lmcache:num_hit_tokens_total")),
        )

    def stop(self) -> None:
        stop_server(self.proc)


async def _stream(url: str, request: BenchRequest) -> RequestResult:
    async with httpx.AsyncClient(timeout=600) as http:
        return await OpenAIStreamClient(http, base_url=url, model=MODEL).send(request)


@contextmanager
def worker(extra_args: list[str], log_path: Path) -> Iterator[Worker]:
    w = Worker(extra_args, log_path)
    try:
        w.warm_up()
        yield w
    finally:
        w.stop()


@contextmanager
def redis_server() -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not on PATH (`make setup` installs it)")
    port = free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    try:
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)


def each_prompt(prompts: dict[int, list[str]], ask: Callable[[str, int], Sample]) -> list[Sample]:
    return [ask(prompt, max_tokens) for max_tokens, group in prompts.items() for prompt in group]


def wait_for_l2_writes(redis_url: str, min_keys: int, timeout_s: float = 60.0) -> None:
    """Wait until Redis holds ``min_keys`` keys and stops growing (the workers write L2 asynchronously)."""
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    last = -1
    while (size := int(client.dbsize())) < min_keys or size != last:
        if time.monotonic() > deadline:
            raise RuntimeError(f"Redis holds {size} keys after {timeout_s:.0f} s, expected at least {min_keys}")
        last = size
        time.sleep(0.5)
    client.close()


def measure_ttft(redis_url: str, logs: Path, disk_dir: Path) -> dict[str, list[Sample]]:
    topics = iter(TOPICS)
    prompts = {mt: [long_prompt(next(topics)) for _ in range(NUM_PROMPTS)] for mt in MAX_TOKENS}
    redis_l2 = ["--max-model-len", "4096", "--l1-cache", "--l2-backend", "redis", "--l2-url", redis_url]
    disk_l2 = ["--max-model-len", "4096", "--l1-cache", "--l2-backend", "tieredstorage", "--l2-path", str(disk_dir)]
    samples: dict[str, list[Sample]] = {"cold": [], "engine": []}
    with worker(redis_l2, logs / "kv-tiers-a.log") as a:
        for max_tokens, group in prompts.items():
            for prompt in group:
                samples["cold"].append(a.ask(prompt, max_tokens))
                samples["engine"].append(a.ask(prompt, max_tokens))
        num_records = sum(-(-(s.num_prompt_tokens // 16 * 16) // 256) for s in samples["cold"])  # chunks + tails
        wait_for_l2_writes(redis_url, min_keys=num_records)
    with worker(redis_l2, logs / "kv-tiers-b.log") as b:
        samples["l2_redis"] = each_prompt(prompts, b.ask)
    with worker(disk_l2, logs / "kv-tiers-d1.log") as d1:
        samples["cold_disk_worker"] = each_prompt(prompts, d1.ask)
    with worker(disk_l2, logs / "kv-tiers-d2.log") as d2:
        samples["l2_disk"] = each_prompt(prompts, d2.ask)
    small_mib = math.ceil(SMALL_ENGINE_CACHE_MIB * KV_BYTES_VS_BF16[logged_kv_cache(logs / "kv-tiers-a.log")])
    small_cache = ["--max-model-len", "3072", "--kv-cache-memory", f"{small_mib}MiB"]
    with worker([*small_cache, "--l1-cache", "--l1-cache-bytes", "2GiB"], logs / "kv-tiers-c.log") as c:
        samples["cold_small_cache_worker"] = each_prompt(prompts, c.ask)
        samples["l1"] = each_prompt(prompts, c.ask)  # two prompts later, nothing of it is left in the engine
    return samples


def logged_dtype(log_path: Path) -> str:
    """The KV dtype a worker reported in its "engine ready" line."""
    found = re.search(r"engine ready: .* dtype (\S+), device", log_path.read_text(errors="replace"))
    return found.group(1) if found else "unknown"


def logged_kv_cache(log_path: Path) -> str:
    """The KV cache format a worker reported in its "engine ready" line."""
    found = re.search(r"engine ready: .*, KV cache (\S+)", log_path.read_text(errors="replace"))
    return found.group(1) if found else "unknown"


def chunk_records(num: int) -> list[tuple[str, bytes]]:
    """``num`` distinct records of a realistic 256-token bf16 chunk, with their keys."""
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(CHUNK_SHAPE, generator=gen).to(torch.bfloat16)
    records = []
    for i in range(num):
        kv[0, 0, 0, 0, 0] = i  # distinct payloads (and checksums)
        records.append((cache_key(MODEL, LAYOUT, i), serde.encode(kv, CHUNK_SHAPE[2], LAYOUT)))
    return records


def tier_bandwidth(tier: KVTier, records: list[tuple[str, bytes]]) -> dict[str, float]:
    """Write every record once, then read them back ``RECORDS_PER_READ`` per call; GB/s of record bytes."""
    num_bytes = sum(len(v) for _, v in records)
    start = time.perf_counter()
    for key, value in records:
        tier.put(key, value)
    write_s = time.perf_counter() - start
    keys = [k for k, _ in records]
    start = time.perf_counter()
    got = [v for i in range(0, len(keys), RECORDS_PER_READ) for v in tier.get_many(keys[i : i + RECORDS_PER_READ])]
    read_s = time.perf_counter() - start
    if any(v is None for v in got):
        raise RuntimeError(f"{tier.name}: records missing on read-back")
    return {"write_gb_s": num_bytes / write_s / 1e9, "read_gb_s": num_bytes / read_s / 1e9}


def serde_bandwidth(records: list[tuple[str, bytes]]) -> dict[str, float]:
    """What the connector adds around a tier: encode a chunk's KV (save), verify + decode a record (load)."""
    kv = serde.decode(records[0][1], LAYOUT).clone()
    num_bytes = sum(len(v) for _, v in records)
    start = time.perf_counter()
    for _ in records:
        serde.encode(kv, CHUNK_SHAPE[2], LAYOUT)
    write_s = time.perf_counter() - start
    start = time.perf_counter()
    for _, value in records:
        serde.decode(value, LAYOUT, CHUNK_SHAPE)
    read_s = time.perf_counter() - start
    return {"write_gb_s": num_bytes / write_s / 1e9, "read_gb_s": num_bytes / read_s / 1e9}


def raw_redis_bandwidth(redis_url: str, records: list[tuple[str, bytes]]) -> dict[str, float]:
    """The wire's speed for the same bytes: SET each record, then GET them over one plain socket, each reply read
    into a buffer already in memory (no client library, no fresh pages)."""
    client = redis.Redis.from_url(redis_url)
    host, port = client.connection_pool.connection_kwargs["host"], client.connection_pool.connection_kwargs["port"]
    client.close()
    buffers = [bytearray(len(v) + 64) for _, v in records]
    with socket.create_connection((host, port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def command(*parts: bytes) -> bytes:
            return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)

        def reply_into(view: memoryview) -> int:
            got = sock.recv_into(view, 64)
            end = bytes(view[:got]).index(b"\r\n")
            total = end + 2 + (int(bytes(view[1:end])) + 2 if view[0] == ord("$") else 0)
            while got < total:
                got += sock.recv_into(view[got:], min(total - got, 1 << 20))
            return total

        scratch = memoryview(bytearray(64))
        num_bytes = sum(len(v) for _, v in records)
        start = time.perf_counter()
        for key, value in records:
            sock.sendall(command(b"SET", key.encode(), value))
            reply_into(scratch)
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        for (key, _), buf in zip(records, buffers, strict=True):
            sock.sendall(command(b"GET", key.encode()))
            reply_into(memoryview(buf))
        read_s = time.perf_counter() - start
        for key, _ in records:
            sock.sendall(command(b"DEL", key.encode()))
            reply_into(scratch)
    return {"write_gb_s": num_bytes / write_s / 1e9, "read_gb_s": num_bytes / read_s / 1e9}


def dd_bandwidth(records: list[tuple[str, bytes]], directory: Path) -> dict[str, float]:
    """``dd`` of the same bytes, 4 MiB at a time: written to a file (no sync, as the disk tier writes), then read
    back from the page cache (where the disk tier's mapped reads come from)."""
    path = directory / "dd-records.bin"
    num_bytes = sum(len(v) for _, v in records)
    count = -(-num_bytes // (4 << 20))
    start = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=4M", f"count={count}"], check=True, capture_output=True)
    write_s = time.perf_counter() - start
    start = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=4M"], check=True, capture_output=True)
    read_s = time.perf_counter() - start
    path.unlink()
    return {"write_gb_s": count * (4 << 20) / write_s / 1e9, "read_gb_s": count * (4 << 20) / read_s / 1e9}


def measure_bandwidth(redis_url: str, disk_dir: Path) -> dict[str, dict[str, float]]:
    """Median of 3 passes per tier (a fresh tier each time, its records deleted after)."""
    torch.set_num_threads(2)
    records = chunk_records(NUM_BANDWIDTH_RECORDS)
    result: dict[str, dict[str, float]] = {}
    makers: dict[str, Callable[[], KVTier]] = {
        "cpu (L1)": lambda: CPUTier(4 << 30),
        "disk (L2 tieredstorage)": lambda: DiskTier(disk_dir, 4 << 30),
        "redis (L2)": lambda: RedisTier(redis_url),
    }
    for name, make in makers.items():
        runs = []
        for _ in range(3):
            tier = make()
            runs.append(tier_bandwidth(tier, records))
            for key, _ in records:
                tier.delete(key)
            tier.close()
        result[name] = _median_of(runs)
    result["serde (encode / verify + decode)"] = _median_of([serde_bandwidth(records) for _ in range(3)])
    result["raw Redis SET/GET (one socket, warm buffers)"] = _median_of(
        [raw_redis_bandwidth(redis_url, records) for _ in range(3)]
    )
    disk_dir.mkdir(parents=True, exist_ok=True)
    result["dd, 4 MiB blocks (page cache)"] = _median_of([dd_bandwidth(records, disk_dir) for _ in range(3)])
    return result


def _median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def summarize(samples: dict[str, list[Sample]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for source, group in samples.items():
        entry: dict[str, Any] = {}
        for max_tokens in MAX_TOKENS:
            mine = [s for s in group if s.max_tokens == max_tokens]
            entry[f"ttft_ms_max_tokens_{max_tokens}"] = statistics.median(s.ttft_ms for s in mine)
        entry["num_computed"] = [s.num_computed for s in group]
        entry["num_prompt_tokens"] = [s.num_prompt_tokens for s in group]
        entry["samples"] = [asdict(s) for s in group]
        summary[source] = entry
    return summary


ROWS = (
    ("cold", "cold (worker A, nothing cached)"),
    ("engine", "engine prefix cache (worker A, same prompt again)"),
    ("l1", "L1 CPU memory (worker C, evicted from its engine)"),
    ("l2_redis", "L2 Redis (worker B, another process)"),
    ("l2_disk", "L2 disk (worker D2, another process)"),
    ("cold_disk_worker", "cold, again (worker D1)"),
    ("cold_small_cache_worker", "cold, again (worker C)"),
)


def print_tables(results: dict[str, Any]) -> None:
    ttft = results["ttft"]
    cold = ttft["cold"]
    print("\n| TTFT source | max_tokens=1 (ms) | cold ÷ it | max_tokens=16 (ms) | cold ÷ it | tokens computed |")
    print("|---|---|---|---|---|---|")
    for key, label in ROWS:
        row = ttft[key]
        cells = []
        for mt in MAX_TOKENS:
            ms = row[f"ttft_ms_max_tokens_{mt}"]
            cells.append(f"{ms:,.0f} | {cold[f'ttft_ms_max_tokens_{mt}'] / ms:.1f}x")
        computed = f"{min(row['num_computed'])}–{max(row['num_computed'])}"
        print(f"| {label} | {' | '.join(cells)} | {computed} |")
    print("\n| tier | write GB/s | read GB/s |")
    print("|---|---|---|")
    for name, figures in results["bandwidth"].items():
        print(f"| {name} | {figures['write_gb_s']:,.2f} | {figures['read_gb_s']:,.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "kv_tiers.json")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the workers' --kv-cache-dtype (auto, int8, fp8)")
    args = parser.parse_args()
    if args.kv_cache_dtype != "auto":
        BASE_ARGS.extend(["--kv-cache-dtype", args.kv_cache_dtype])
    logs = args.out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_description(),
        "model": MODEL,
        "worker_args": BASE_ARGS,
    }
    with redis_server() as redis_url, tempfile.TemporaryDirectory() as tmp:
        samples = measure_ttft(redis_url, logs, Path(tmp) / "l2")
        results["dtype"] = logged_dtype(logs / "kv-tiers-a.log")
        results["kv_cache"] = logged_kv_cache(logs / "kv-tiers-a.log")
        results["ttft"] = summarize(samples)
        redis.Redis.from_url(redis_url).flushdb()
        results["bandwidth"] = measure_bandwidth(redis_url, Path(tmp) / "bandwidth")
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print_tables(results)


if __name__ == "__main__":
    main()

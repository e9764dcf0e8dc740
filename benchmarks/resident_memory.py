"""A worker's resident memory per model: start ``splitserve worker`` on each GGUF, send one request of a long
prompt, and read the process's resident set (``VmRSS``) and its peak (``VmHWM``) from ``/proc``.

    S=~/.cache/splitserve/sized
    .venv/bin/python benchmarks/resident_memory.py --models smollm2 $S/llama-3.2-1b/llama-3.2-1b-Q4_K_M.gguf

The KV cache is given a fixed size (``--kv-cache-memory``, default 1GiB), allocated at start, so the figures
are the weights, the runtime and that cache; the script prints the model's share with the cache taken out.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import httpx
from common import REPO, SPLITSERVE, free_port, start_server, stop_server, write_result

from splitserve.config import parse_bytes


def status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def measure(model: str, kv_cache_memory: str, logs: Path) -> dict[str, Any]:
    port = free_port()
    cmd = [*SPLITSERVE, "worker", "--model", model, "--port", str(port), "--kv-cache-memory", kv_cache_memory]
    proc = start_server(cmd, port, logs / f"resident_{Path(model).stem}.log", timeout_s=900)
    try:
        prompt = " ".join(f"word{i % 97}" for i in range(1500))
        body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0}
        httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600).raise_for_status()
        rss, peak = status_kib(proc.pid, "VmRSS") << 10, status_kib(proc.pid, "VmHWM") << 10
    finally:
        stop_server(proc)
    kv = parse_bytes(kv_cache_memory)
    gib = 1 << 30
    print(f"{model}: resident {rss / gib:.2f} GiB (peak {peak / gib:.2f}), without the KV cache {(rss - kv) / gib:.2f}")
    return {"model": model, "rss_bytes": rss, "peak_bytes": peak, "kv_cache_bytes": kv, "rss_without_kv": rss - kv}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", required=True, help="registry names or GGUF paths")
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "resident_memory.json")
    args = parser.parse_args()
    logs = args.out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    write_result(args.out, "resident_memory", args, [measure(m, args.kv_cache_memory, logs) for m in args.models])


if __name__ == "__main__":
    main()

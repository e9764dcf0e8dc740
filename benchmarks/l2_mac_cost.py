"""What the records' MAC costs an L2 hit (the target: under 5% of the hit's TTFT).

    .venv/bin/python benchmarks/l2_mac_cost.py [--prompt-tokens 2000] [--repeats 5]

One real worker (bfloat16 where the CPU has it, as ``--dtype auto`` picks) with a Redis L2, no L1 and no
engine prefix cache, with a cluster secret. Each round sends a new prompt twice: the first computes it and
writes its records to Redis, the second loads them all from Redis (an L2 hit; ``max_tokens`` 1, so its
latency is its TTFT). Then the same records are read back here and their MACs checked with the worker's key
(``serde.RecordSigner.verify``, which is what the worker adds to each L2 read). The share is the median
verification time over the median L2-hit TTFT. Results go to ``benchmarks/results/l2_mac_cost.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, free_port, start_server, stop_server, write_result
from kv_tiers import redis_server, wait_for_l2_writes

from splitserve.kvcache import serde

SECRET = "bench-l2-mac-secret"


def prompt(i: int, num_tokens: int) -> str:
    return f"Round {i}. " + " ".join(f"w{i}x{j}" for j in range(num_tokens // 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "l2_mac_cost.json")
    args = parser.parse_args()
    ttfts, verifies, num_records = [], [], []
    with redis_server() as url:
        client = redis.Redis.from_url(url)
        port = free_port()
        secret_file = Path("/tmp/l2-mac-cost-secret")
        secret_file.write_text(SECRET)
        command = [sys.executable, "-c", "from splitserve.cli import main; main()", "worker", "--model", "smollm2",
                   "--port", str(port), "--l2-backend", "redis", "--l2-url", url, "--no-enable-prefix-caching",
                   "--cluster-secret-file", str(secret_file)]  # fmt: skip
        proc = start_server(command, port, Path("/tmp/l2_mac_cost_worker.log"))
        try:
            for i in range(args.repeats + 1):  # the first round warms up
                body = {"model": "smollm2", "prompt": prompt(i, args.prompt_tokens), "max_tokens": 1}
                before = set(client.keys("splitserve:*"))
                httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600).raise_for_status()
                wait_for_l2_writes(url, len(before) + 1)  # written asynchronously: until they stop coming
                keys = [k for k in client.keys("splitserve:*") if k not in before]
                began = time.perf_counter()
                httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600).raise_for_status()
                ttft_s = time.perf_counter() - began
                values = [client.get(k) or b"" for k in keys]
                header = serde.read_header(values[0])
                signer = serde.RecordSigner.for_secret(SECRET, header.model_id, header.layout)
                began = time.perf_counter()
                for key, value in zip(keys, values, strict=True):
                    signer.verify(key.decode(), value)
                verify_s = time.perf_counter() - began
                if i:
                    ttfts.append(ttft_s * 1000)
                    verifies.append(verify_s * 1000)
                    num_records.append(len(keys))
        finally:
            stop_server(proc)
    ttft, verify = statistics.median(ttfts), statistics.median(verifies)
    results = {
        "prompt_tokens": args.prompt_tokens,
        "records_per_prompt": num_records,
        "l2_hit_ttft_ms": round(ttft, 1),
        "mac_verify_ms": round(verify, 2),
        "mac_share_of_ttft": round(verify / ttft, 4),
        "all_ttft_ms": [round(v, 1) for v in ttfts],
        "all_verify_ms": [round(v, 2) for v in verifies],
    }
    print(results)
    write_result(args.out, "l2_mac_cost", args, results)


if __name__ == "__main__":
    main()

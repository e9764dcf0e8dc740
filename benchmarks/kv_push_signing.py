"""What signing KV pushes costs: one push of a prompt's KV over loopback, open against signed (issue 13, item 3).

    .venv/bin/python benchmarks/kv_push_signing.py [--tokens 2000] [--repeats 9]

A real receiver and ``pd.sender.push``, as a prefill and a decode worker use them, with SmolLM2's KV layout
in bfloat16 (30 layers, 3 KV heads of 64): 2,000 tokens are a 46 MB record. Pushes alternate open and signed
(the cluster secret: HMAC on the reservation request, a keyed BLAKE3 MAC over the payload computed on both
sides as it goes by), and the medians are compared. Results go to
``benchmarks/results/kv_push_signing.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, write_result

from splitserve.kvcache import serde
from splitserve.pd.buffer import PDBuffer
from splitserve.pd.receiver import KVReceiver
from splitserve.pd.sender import push

LAYOUT = "bfloat16-L30-H3-D64-B16"
SECRET = "bench-cluster-secret"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "kv_push_signing.json")
    args = parser.parse_args()
    kv = torch.randn(30, 2, args.tokens, 3, 64).to(torch.bfloat16)
    record = serde.encode(kv, args.tokens, LAYOUT)
    receivers = {name: KVReceiver(PDBuffer(len(record) * 2), LAYOUT, secret=secret)
                 for name, secret in (("open", None), ("signed", SECRET))}  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in receivers}
    for receiver in receivers.values():
        receiver.start()
    try:
        for i in range(args.repeats + 1):  # the first round warms up
            for name, receiver in receivers.items():
                secret = SECRET if name == "signed" else None
                result = push(receiver.addr, f"{name}-{i}", record, args.tokens, 0, LAYOUT, 10, secret)
                if not result.ok:
                    raise SystemExit(f"{name} push failed: {result.reason}")
                receiver.buffer.claim(f"{name}-{i}")
                receiver.buffer.release(f"{name}-{i}")
                if i:
                    times[name].append(result.elapsed_s * 1000)
    finally:
        for receiver in receivers.values():
            receiver.close()
    medians = {name: statistics.median(values) for name, values in times.items()}
    results = {
        "record_mb": round(len(record) / 1e6, 1),
        "median_ms": {name: round(value, 1) for name, value in medians.items()},
        "signed_minus_open_ms": round(medians["signed"] - medians["open"], 1),
        "all_ms": {name: [round(v, 1) for v in values] for name, values in times.items()},
    }
    print(results)
    write_result(args.out, "kv_push_signing", args, results)


if __name__ == "__main__":
    main()

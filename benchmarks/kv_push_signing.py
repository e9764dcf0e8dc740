"""What signing KV pushes costs: one push of a prompt's KV over loopback, open against signed, and both against
a raw loopback socket moving the same bytes (the target: signed must keep 80% of the raw throughput).

    .venv/bin/python benchmarks/kv_push_signing.py [--tokens 2000] [--repeats 9]

A real receiver and ``pd.sender.push``, as a prefill and a decode worker use them, with SmolLM2's KV layout
in bfloat16 (30 layers, 3 KV heads of 64): 2,000 tokens are a 46 MB record. Pushes alternate open and signed
(the cluster secret: HMAC on the reservation request, a keyed BLAKE3 MAC over the payload computed on both
sides as it goes by), and the medians are compared. The raw socket is a thread that ``recv_into``s the record
into a buffer allocated once and acknowledges it with one byte. Results go to
``benchmarks/results/kv_push_signing.json``.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import threading
import time
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


class RawSink:
    """A loopback TCP server that takes whole records of ``nbytes`` into one buffer and acks each with a byte."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.server = socket.create_server(("127.0.0.1", 0))
        self.addr = self.server.getsockname()
        self.room = memoryview(bytearray(nbytes))
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            conn, _ = self.server.accept()
            with conn:
                got = 0
                while got < self.nbytes:
                    n = conn.recv_into(self.room[got:], self.nbytes - got)
                    if not n:
                        break
                    got += n
                conn.sendall(b"k")

    def push(self, record: bytes) -> float:
        """Seconds from connecting to the ack, as ``push`` counts them."""
        began = time.perf_counter()
        with socket.create_connection(self.addr) as sock:
            sock.sendall(record)
            sock.recv(1)
        return time.perf_counter() - began


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
    times: dict[str, list[float]] = {name: [] for name in (*receivers, "raw")}
    raw = RawSink(len(record))
    for receiver in receivers.values():
        receiver.start()
    try:
        for i in range(args.repeats + 1):  # the first round warms up
            raw_s = raw.push(record)
            if i:
                times["raw"].append(raw_s * 1000)
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
        "gb_per_s": {name: round(len(record) / value / 1e6, 2) for name, value in medians.items()},
        "signed_share_of_raw": round(medians["raw"] / medians["signed"], 3),
        "all_ms": {name: [round(v, 1) for v in values] for name, values in times.items()},
    }
    print(results)
    write_result(args.out, "kv_push_signing", args, results)


if __name__ == "__main__":
    main()

"""Record real vLLM KV event batches, as vLLM publishes them, for ``tests/data/vllm_0_32_kv_events.json``.

Run it with the peer venv's interpreter (``scripts/setup_vllm_cpu.sh`` installs vLLM there); it loads no model.
vLLM's own ``BlockPool`` (events on, vLLM's default sha256 block hashing, int block hashes as vLLM publishes
them by default) caches the blocks of three requests, one with a ``cache_salt``, evicts some and resets the
prefix cache; each step's ``take_events()`` goes out as a ``KVEventBatch`` through vLLM's ``ZmqEventPublisher``
(PUB and replay sockets), and a plain ZMQ SUB socket records the frames. A replay request for every batch
from sequence 1 on records the ROUTER socket's answer too::

    ~/.cache/splitserve/peers/vllm-venv/bin/python scripts/record_vllm_kv_events.py \\
        > tests/data/vllm_0_32_kv_events.json

The file holds the frames (topic, sequence number, payload as hex), the requests' token ids and salts, and
each payload as vLLM's own msgspec decoder reads it (``expected``), for the tests to hold splitserve's decoder
against.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from typing import Any

BLOCK_SIZE = 4
REQUESTS = [  # (request id, prompt token ids, cache_salt)
    ("a", [101, 102, 103, 104, 105, 106, 107, 108, 109, 110], None),  # 2 full blocks and a tail
    ("b", [101, 102, 103, 104, 205, 206, 207, 208, 209, 210, 211, 212], None),  # shares a's first block
    ("c", [101, 102, 103, 104, 105, 106, 107, 108], "tenant-1"),  # a's blocks under a salt: other hashes
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _event_steps() -> list[list[Any]]:
    """vLLM's events, one list per step: the three requests cached, an eviction, a prefix-cache reset."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    pool = BlockPool(num_gpu_blocks=9, enable_caching=True, hash_block_size=BLOCK_SIZE, enable_kv_cache_events=True)
    steps: list[list[Any]] = []
    held = []
    for request_id, token_ids, salt in REQUESTS:
        request = Request(request_id, token_ids, SamplingParams(max_tokens=1), None, cache_salt=salt,
                          block_hasher=hasher)  # fmt: skip
        hits = []  # the leading blocks already cached, as vLLM's KV cache manager finds them
        for block_hash in request.block_hashes:
            found = pool.get_cached_block(block_hash, [0])
            if found is None:
                break
            hits.append(found[0])
        pool.touch(hits)
        blocks = hits + pool.get_new_blocks(-(-len(token_ids) // BLOCK_SIZE) - len(hits))
        num_full = len(token_ids) // BLOCK_SIZE
        pool.cache_full_blocks(request, blocks, len(hits), num_full, BLOCK_SIZE, kv_cache_group_id=0)
        held.append(blocks)
        steps.append(pool.take_events())
    for blocks in held:
        pool.free_blocks(reversed(blocks))
    taken = pool.get_new_blocks(pool.get_num_free_blocks())  # takes every block back: evicts the cached ones
    steps.append(pool.take_events())
    pool.free_blocks(taken)
    pool.reset_prefix_cache()
    steps.append(pool.take_events())
    return steps


def _record(steps: list[list[Any]], topic: str) -> tuple[list[list[Any]], list[list[Any]]]:
    import zmq
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

    pub_port, replay_port = _free_port(), _free_port()
    publisher = ZmqEventPublisher(0, f"tcp://*:{pub_port}", f"tcp://*:{replay_port}", topic=topic)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    time.sleep(0.5)  # a SUB socket misses what is published before it has joined
    for events in steps:
        publisher.publish(KVEventBatch(ts=time.time(), events=events))
    live = [sub.recv_multipart() for _ in steps]
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    dealer.send_multipart([b"", (1).to_bytes(8, "big")])
    replay: list[list[bytes]] = []
    while True:
        frames = dealer.recv_multipart()
        replay.append(frames)
        if frames[2] == ZmqEventPublisher.END_SEQ:
            break
    publisher.shutdown()
    sub.close(0)
    dealer.close(0)
    return [[f.hex() for f in frames] for frames in live], [[f.hex() for f in frames] for frames in replay]


def main() -> None:
    import msgspec
    import vllm
    from vllm.distributed.kv_events import KVEventBatch

    topic = "kv@pod-1@smollm2"
    live, replay = _record(_event_steps(), topic)
    expected = [
        msgspec.to_builtins(msgspec.msgpack.decode(bytes.fromhex(frames[2]), type=KVEventBatch)) for frames in live
    ]
    json.dump(
        {
            "note": "Made by scripts/record_vllm_kv_events.py: vLLM's BlockPool and ZmqEventPublisher, frames "
            "recorded by a ZMQ SUB socket (live) and a DEALER replay request from sequence 1 (replay); "
            "frames as hex: topic, 8-byte big-endian sequence number, msgpack payload (replay: empty "
            "delimiter first). expected: each live payload as vLLM's msgspec decoder reads it.",
            "vllm_version": vllm.__version__,
            "block_size": BLOCK_SIZE,
            "topic": topic,
            "requests": [{"request_id": r, "token_ids": t, "cache_salt": s} for r, t, s in REQUESTS],
            "live": live,
            "replay": replay,
            "expected": expected,
        },
        sys.stdout,
        indent=1,
    )
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()

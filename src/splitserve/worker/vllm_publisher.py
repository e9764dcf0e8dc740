"""A worker's KV events in vLLM's format on a ZMQ PUB socket, as vLLM's ``--kv-events-config`` publishes them.

Consumers built for vLLM (llm-d's KV indexer, Dynamo's router, a splitserve router with ``--backend-kind
vllm``) can then follow a splitserve worker. The publisher listens to the worker's ``KVEventLog``, engine tier
only (the prefix cache, vLLM's ``GPU`` medium): blocks the engine caches become ``BlockStored`` with their
parent hash, token ids and block size (a prompt's first block has no parent, and carries its ``cache_salt`` in
``extra_keys``, as vLLM's does), evicted blocks ``BlockRemoved``. Block hashes are splitserve's
(``splitserve.keys``, unsigned 64-bit, like vLLM's int hashes): opaque to consumers, who rebuild their own keys
from the token ids. L1/L2 records stay in splitserve's own events (``GET /kv/events``).

Recording only appends to a bounded queue (the engine never waits); a sender thread takes what arrived, sends
it as one batch with the next sequence number (from 0), and keeps the last ``buffer_steps`` batches for the
replay socket. The first batch is an ``AllBlocksCleared``: whatever a consumer held of an earlier process at
this address is gone. Past ``max_queue_size`` queued events, new ones are dropped and the next batch starts
with ``AllBlocksCleared`` again, so consumers forget this worker's blocks rather than keep a wrong picture.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import zmq

from splitserve.config import KVEventsConfig
from splitserve.protocol.kv_events import EventKind, Tier
from splitserve.protocol.vllm_events import (
    MEDIUM_GPU,
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
    encode_batch,
    encode_frames,
)

logger = logging.getLogger(__name__)

WAIT_S = 0.05  # the sender thread's longest wait: how late a replay request may be answered


class VLLMEventPublisher:
    """Implements ``worker.kv_events.KVEventListener``; :meth:`start` once, :meth:`close` at the end.

    Args:
        config: vLLM's ``--kv-events-config`` (``is_enabled``).
        block_size: the engine's tokens per block.
        context: the ZMQ context (tests pass their own); the process-wide one by default.
    """

    def __init__(self, config: KVEventsConfig, block_size: int, context: zmq.Context | None = None) -> None:
        self.config = config
        self.block_size = block_size
        self._topic = config.topic
        self._lock = threading.Condition()
        self._queue: deque[KVCacheEvent] = deque()
        self._num_dropped = 0
        self._must_clear = True  # the first batch tells consumers to forget this address's blocks
        self._history: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._closed = threading.Event()
        context = context or zmq.Context.instance()
        self._pub = context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = _attach(self._pub, config.endpoint)
        self._replay: zmq.Socket | None = None
        self.replay_endpoint: str | None = None
        if config.replay_endpoint is not None:
            self._replay = context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = _attach(self._replay, config.replay_endpoint, always_bind=True)
        self._thread = threading.Thread(target=self._run, name="vllm-kv-events", daemon=True)
        for address in (self.endpoint, self.replay_endpoint):
            if address is not None and _reachable_from_outside(address):
                logger.warning(
                    "SECURITY: vLLM-format KV events on %s carry prompts' token ids and cache salts to anyone who "
                    "connects (ZMQ, unauthenticated, as vLLM's): keep this port on the cluster network "
                    "(bind 127.0.0.1, or a NetworkPolicy)", address,
                )  # fmt: skip

    def start(self) -> None:
        self._thread.start()
        logger.info("KV events in vLLM's format on %s (replay: %s)", self.endpoint, self.replay_endpoint or "none")

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued and stop (the thread closes the sockets); waits up to ``timeout_s``."""
        self._closed.set()
        with self._lock:
            self._lock.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        elif not self._pub.closed:  # never started
            self._close_sockets()

    # -- KVEventListener (the recording threads) ----------------------------------------------------------------

    def recorded(self, tier: Tier, kind: EventKind, hashes: list[int]) -> None:
        if tier == Tier.ENGINE and kind == EventKind.REMOVED:
            self._put(BlockRemoved(list(hashes), MEDIUM_GPU))
        # a stored engine block arrives with its tokens through blocks_cached; L1 and L2 are not vLLM's

    def blocks_cached(
        self, parent_hash: int | None, block_hashes: list[int], token_ids: list[int], cache_salt: str | None
    ) -> None:
        extra_keys = [(cache_salt,)] + [None] * (len(block_hashes) - 1) if cache_salt else None
        event = BlockStored(list(block_hashes), parent_hash, list(token_ids), self.block_size, extra_keys=extra_keys)
        self._put(event)

    def _put(self, event: KVCacheEvent) -> None:
        with self._lock:
            if len(self._queue) >= self.config.max_queue_size:
                self._num_dropped += 1
                if self._num_dropped == 1:
                    logger.warning("vLLM-format KV events: the queue is full; dropping, then clearing consumers")
                return
            self._queue.append(event)
            self._lock.notify()

    # -- the sender thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None:
                    self._serve_replays(self._replay)
                events = self._take(WAIT_S)
                if events:
                    self._send(events)
                elif self._closed.is_set():
                    return
        finally:
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)

    def _take(self, timeout_s: float) -> list[KVCacheEvent]:
        """What is queued, waiting up to ``timeout_s`` for something; led by ``AllBlocksCleared`` when due."""
        with self._lock:
            if not self._queue and not self._must_clear and not self._closed.is_set():
                self._lock.wait(timeout_s)
            events = list(self._queue)
            self._queue.clear()
            if self._num_dropped:
                self._num_dropped = 0
                self._must_clear = True
                events = []  # what stayed queued is older than what was dropped: the clear supersedes it
            if self._must_clear:
                self._must_clear = False
                events.insert(0, AllBlocksCleared())
            return events

    def _send(self, events: list[KVCacheEvent]) -> None:
        payload = encode_batch(EventBatch(time.time(), events, data_parallel_rank=0))
        seq = self._seq
        self._seq += 1
        # a PUB socket never blocks: a subscriber past its high-water mark misses the batch (replay still has it)
        self._pub.send_multipart(encode_frames(self._topic, seq, payload))
        self._history.append((seq, payload))

    def _serve_replays(self, replay: zmq.Socket) -> None:
        """Answer waiting replay requests: ``[identity, "", start]`` gets every kept batch from ``start`` on,
        then the end marker."""
        while replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("vLLM-format KV events: an invalid replay request (%d frames)", len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self._history):
                if seq >= start:
                    replay.send_multipart([identity, b"", *encode_frames(self._topic, seq, payload)])
            replay.send_multipart([identity, b"", b"", REPLAY_END_SEQ.to_bytes(8, "big", signed=True), b""])


def _reachable_from_outside(address: str) -> bool:
    """A TCP address on a wildcard or any host but the loopback one (ipc and inproc stay on this machine)."""
    if not address.startswith("tcp://"):
        return False
    host = address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    return host not in ("127.0.0.1", "localhost", "::1")


def _attach(sock: zmq.Socket, endpoint: str, always_bind: bool = False) -> str:
    """Bind ``sock`` (a ``*`` or ``::`` host, an ipc or inproc address, or ``always_bind``) or connect it, as
    vLLM does; returns the address it is on (the port the system chose for a ``:0`` one)."""
    if always_bind or "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        sock.bind(endpoint)
        return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    sock.connect(endpoint)
    return endpoint

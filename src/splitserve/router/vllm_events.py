"""KV events from vLLM workers: the router subscribes to each one's ZMQ publisher and indexes what it reports.

A vLLM worker started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557"}'`` publishes its prefix cache's events (``splitserve.protocol.vllm_events``). The router
reaches it at ``tcp://<worker host>:<--vllm-kv-events-port>`` (a port, or ``+N``: the worker's HTTP port plus
N) with a SUB socket, and at ``--vllm-kv-replay-port`` for the replay socket when there is one.

vLLM's block hashes are its own (sha256 by default): :class:`VLLMBlockKeys` names each stored block with the
router's keys instead, ``keys.hash_blocks`` over the token ids the event carries, at the router's block size,
chained from the parent block's key (a prompt's first block from its ``cache_salt``, which ``extra_keys``
carries), so a prompt matches as it would on a splitserve worker. It remembers vLLM's hash -> the router's
keys for ``BlockRemoved`` and for later blocks' parents. Blocks whose hashes depend on more than tokens and a
salt (LoRA, images) are not indexed; neither is a block whose parent it never saw. ``GPU`` blocks are the
engine tier. A connector's blocks are records the worker loads whole: one on a ``REMOTE`` store (splitserve's
connector publishes its L2 so) counts as the shared L2, one elsewhere (``CPU``: an offloading connector's, or
splitserve's L1) as the worker's L1; the index names such a record by its last router block, as it does a
splitserve worker's records (``KVIndex.match``).

:class:`VLLMEventFollower` keeps the index in step: sequence numbers count from 0 per vLLM process; after a gap
it asks the replay socket for the missed batches, and where it has none (or they are gone from its buffer) it
drops what the index held for that worker and carries on from the next batch. The same happens when the
connection drops (vLLM restarted: its cache is empty). With a replay socket, the router also asks for vLLM's
buffered history as soon as it connects, so it knows what an idle worker already holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from splitserve.config import RouterConfig, port_of
from splitserve.keys import hash_blocks, salt_root
from splitserve.protocol.kv_events import EventKind, Tier
from splitserve.protocol.vllm_events import (
    LOCALITY_REMOTE,
    MEDIUM_GPU,
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    cache_salt_of,
    decode_batch,
    decode_frames,
    has_foreign_keys,
)
from splitserve.router.kv_index import KVIndex

logger = logging.getLogger("splitserve.router")

REPLAY_TIMEOUT_S = 2.0  # for the whole answer to a replay request
SILENT_AFTER_S = 30.0  # a publisher not connected this long gets its warning
POLL_MS = 200

Update = tuple[Tier, EventKind, list[int]]


@dataclass(frozen=True)
class VLLMSource:
    """Where vLLM workers' KV events are, and how the router names their blocks (from ``RouterConfig``)."""

    events_port: str | None = None  # --vllm-kv-events-port; None: the worker's /kv_event_sources, else 5557
    replay_port: str | None = None  # --vllm-kv-replay-port; None: the worker's /kv_event_sources, if any
    block_size: int = 16
    max_blocks: int = 1_000_000

    @classmethod
    def from_config(cls, config: RouterConfig) -> VLLMSource:
        return cls(config.vllm_kv_events_port, config.vllm_kv_replay_port, config.block_size,
                   config.kv_index_max_blocks)  # fmt: skip

    def endpoints(self, worker_url: str, sources: object = None) -> tuple[str, str | None]:
        """The ZMQ addresses of the worker's publisher and replay socket: the flags', else those its answer
        to ``GET /kv_event_sources`` (``sources``, vLLM's ``{rank: KVEventsConfig}``) names for rank 0 (their
        ports, at the worker's host), else port 5557 and no replay socket."""
        host, http_port = host_and_port(worker_url)
        named = _rank0_endpoints(sources, host)
        events = f"tcp://{host}:{port_of(self.events_port, http_port)}" if self.events_port else None
        replay = f"tcp://{host}:{port_of(self.replay_port, http_port)}" if self.replay_port else None
        return events or named[0] or f"tcp://{host}:5557", replay or named[1]


def host_and_port(worker_url: str) -> tuple[str, int]:
    """A worker URL's host (an IPv6 address in brackets) and HTTP port (the scheme's when it names none)."""
    parts = urlsplit(worker_url)
    host = f"[{parts.hostname}]" if parts.hostname and ":" in parts.hostname else str(parts.hostname)
    return host, parts.port or (443 if parts.scheme == "https" else 80)


def _rank0_endpoints(sources: object, host: str) -> tuple[str | None, str | None]:
    config = sources.get("0") if isinstance(sources, dict) else None
    if not isinstance(config, dict) or config.get("publisher") != "zmq":
        return None, None
    found = []
    for key in ("endpoint", "replay_endpoint"):
        endpoint = config.get(key)
        port = endpoint.rsplit(":", 1)[1] if isinstance(endpoint, str) and endpoint.startswith("tcp://") else ""
        found.append(f"tcp://{host}:{port}" if port.isdigit() and int(port) else None)
    return found[0], found[1]


class VLLMBlockKeys:
    """vLLM's block hashes -> the router's block keys, for one worker (see the module's doc)."""

    def __init__(self, block_size: int, max_blocks: int) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._keys: OrderedDict[BlockHash, tuple[int, ...]] = OrderedDict()
        self.num_unindexed = 0  # stored blocks the router could not name
        self._warned_block_size: int | None = None

    def translate(self, event: BlockStored | BlockRemoved) -> list[Update]:
        """What ``event`` means in the router's keys: a stored or removed run, or nothing."""
        tier = _tier_of(event)
        if isinstance(event, BlockRemoved):
            runs = [self._keys[h] for h in event.block_hashes if h in self._keys]
        else:
            runs = self._store(event)
        keys = [key for run in runs for key in (run if tier == Tier.ENGINE else run[-1:])]
        if not keys:
            return []
        return [(tier, EventKind.REMOVED if isinstance(event, BlockRemoved) else EventKind.STORED, keys)]

    def _store(self, event: BlockStored) -> list[tuple[int, ...]]:
        """The router's keys of each of the event's blocks (remembered under vLLM's hash)."""
        per_block = self._tokens_per_block(event)
        if per_block is None or has_foreign_keys(event):
            self.num_unindexed += len(event.block_hashes)
            return []
        if event.parent_block_hash is None:
            parent = salt_root(cache_salt_of(event))
        elif event.parent_block_hash in self._keys:
            parent = self._keys[event.parent_block_hash][-1]
        else:
            self.num_unindexed += len(event.block_hashes)
            return []
        runs: list[tuple[int, ...]] = []
        for i, vllm_hash in enumerate(event.block_hashes):
            keys = tuple(hash_blocks(event.token_ids[i * per_block : (i + 1) * per_block], self.block_size, parent))
            self._remember(vllm_hash, keys)
            runs.append(keys)
            parent = keys[-1]
        return runs

    def _tokens_per_block(self, event: BlockStored) -> int | None:
        """vLLM's block size, when its blocks split into whole router blocks and the tokens are all there."""
        size = event.block_size
        if size % self.block_size:
            if self._warned_block_size != size:
                self._warned_block_size = size
                logger.warning(
                    "vLLM blocks of %d tokens do not split into the router's blocks of %d (--block-size): "
                    "their KV events cannot be indexed; give the router a --block-size dividing %d",
                    size, self.block_size, size,
                )  # fmt: skip
            return None
        if not event.block_hashes or len(event.token_ids) != size * len(event.block_hashes):
            return None
        return size

    def _remember(self, vllm_hash: BlockHash, keys: tuple[int, ...]) -> None:
        self._keys[vllm_hash] = keys
        self._keys.move_to_end(vllm_hash)
        while len(self._keys) > self.max_blocks:
            self._keys.popitem(last=False)


def _tier_of(event: BlockStored | BlockRemoved) -> Tier:
    """The engine's prefix cache (``GPU``), a shared store (``REMOTE``), or the worker's own store (the rest)."""
    if event.medium in (None, MEDIUM_GPU):
        return Tier.ENGINE
    return Tier.L2 if event.locality == LOCALITY_REMOTE else Tier.L1


class VLLMEventFollower:
    """Follows one vLLM worker's KV events into ``index`` until cancelled.

    Args:
        index: the router's KV index; the worker is registered there under its URL.
        worker_url: the worker's HTTP base URL (its name in the index).
        endpoint, replay_endpoint: its publisher's and replay socket's ZMQ addresses (``VLLMSource.endpoints``).
        keys: names its blocks in the router's keys.
        context: an asyncio ZMQ context.
        on_batch: called after each batch applied (the subscriber's freshness clock).
        on_register: called once registered, with ``(url, worker_id, meta)``.
    """

    def __init__(
        self,
        index: KVIndex,
        worker_url: str,
        endpoint: str,
        replay_endpoint: str | None,
        keys: VLLMBlockKeys,
        context: zmq.asyncio.Context,
        on_batch: Callable[[], None] = lambda: None,
        on_register: Callable[[str, str, dict[str, object]], None] = lambda url, worker_id, meta: None,
    ) -> None:
        self.index = index
        self.url = worker_url
        self.worker_id = urlsplit(worker_url).netloc
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.keys = keys
        self._context = context
        self._on_batch = on_batch
        self._on_register = on_register
        self.last_seq: int | None = None  # the last batch applied
        self.is_connected = False
        self.num_resets = 0  # times the worker's entries were dropped (gaps without replay, restarts)
        self._catch_up_due = False

    async def run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoint)
        self._reset("subscribed")
        try:
            await asyncio.gather(self._receive(sub), self._watch(monitor))
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(0)
            sub.close(0)

    async def _receive(self, sub: zmq.asyncio.Socket) -> None:
        while True:
            if self._catch_up_due:
                self._catch_up_due = False
                await self._catch_up(0 if self.last_seq is None else self.last_seq + 1, None)
            if not await sub.poll(POLL_MS):
                continue
            frames = await sub.recv_multipart()
            try:
                _, seq, payload = decode_frames(frames)
                batch = decode_batch(payload)
            except ValueError as exc:
                logger.warning("an invalid KV event message from %s (%s): dropping its entries", self.endpoint, exc)
                self._reset("an invalid message")
                continue
            await self._on_message(seq, batch)

    async def _on_message(self, seq: int, batch: EventBatch) -> None:
        """Apply a batch from the PUB socket, first catching up on what came before it when that is missing."""
        last = self.last_seq
        if last is not None and seq <= last:
            if seq != 0:
                return  # already applied (from a replay)
            self._reset("the publisher restarted")  # vLLM counts from 0 again
        elif last is None and seq > 0:
            await self._catch_up(0, seq)  # what the worker cached before the router subscribed
        elif last is not None and seq > last + 1:
            await self._catch_up(last + 1, seq)  # missed batches
        self._apply(seq, batch)

    async def _catch_up(self, start: int, until: int | None) -> None:
        """Apply the replayed batches from ``start`` (up to ``until``, exclusive, when given); where the replay
        does not reach back to ``start`` (or there is no replay socket), what the index held of the worker is
        dropped first."""
        replayed = await self._replay(self.replay_endpoint, start) if self.replay_endpoint is not None else []
        wanted = [(seq, payload) for seq, payload in replayed if until is None or seq < until]
        # complete: the replay reaches back to start, or has nothing from start on while nothing was expected there
        is_complete = replayed[0][0] == start if replayed else until is None or until == start
        if not is_complete and self.last_seq is not None:  # a hole in what the index was told
            self._reset(f"batches from {start} on are missing")
        for seq, payload in wanted:
            if self.last_seq is None or seq > self.last_seq:
                try:
                    self._apply(seq, decode_batch(payload))
                except ValueError as exc:
                    logger.warning("an invalid replayed batch from %s (%s)", self.replay_endpoint, exc)

    async def _replay(self, endpoint: str, start: int) -> list[tuple[int, bytes]]:
        """The replay socket's batches from ``start`` on; empty when it does not answer in time."""
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        batches: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(REPLAY_TIMEOUT_S):
                while True:
                    frames = await dealer.recv_multipart()
                    _, seq, payload = decode_frames(frames[1:])
                    if seq == REPLAY_END_SEQ:
                        return batches
                    batches.append((seq, payload))
        except (TimeoutError, ValueError) as exc:
            logger.warning("replay from %s failed (%s)", endpoint, type(exc).__name__)
            return []
        finally:
            dealer.close(0)

    def _apply(self, seq: int, batch: EventBatch) -> None:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.index.clear(self.url, Tier.ENGINE)
            else:
                self.index.apply(self.url, self.worker_id, False, self.keys.translate(event))
        self.last_seq = seq
        self._on_batch()

    def _reset(self, reason: str) -> None:
        """Drop what the index held of the worker (and register it, the first time); batches start afresh."""
        is_first = self.last_seq is None and not self.index.is_registered(self.url)
        self.index.apply(self.url, self.worker_id, True, [], {"kind": "vllm", "events": self.endpoint})
        self.last_seq = None
        if is_first:
            self._on_register(self.url, self.worker_id, {"kind": "vllm"})
        else:
            self.num_resets += 1
            logger.info("KV events from %s: %s; starting afresh", self.endpoint, reason)

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        """Follow the connection: warn once while it is down too long; on connecting, catch up (replay);
        on losing it, drop the worker's entries (a restarted vLLM holds nothing)."""
        down_since, warned = time.monotonic(), False
        while True:
            try:
                async with asyncio.timeout(1.0):
                    event = parse_monitor_message(await monitor.recv_multipart())["event"]
            except TimeoutError:
                if not self.is_connected and not warned and time.monotonic() - down_since >= SILENT_AFTER_S:
                    warned = True
                    logger.warning(
                        "no KV events from vLLM worker %s: cannot reach %s (is vLLM started with --kv-events-config "
                        "and this port?); kvaware routes it by the router's prefix index", self.url, self.endpoint,
                    )  # fmt: skip
                continue
            if event == zmq.EVENT_CONNECTED:
                self.is_connected, warned = True, False
                self._catch_up_due = self.replay_endpoint is not None
                logger.info("KV events: subscribed to vLLM worker %s at %s", self.url, self.endpoint)
            elif event == zmq.EVENT_DISCONNECTED and self.is_connected:
                self.is_connected, down_since = False, time.monotonic()
                self._reset("the connection dropped")

"""A worker's KV events: what its caches hold, per tier, kept for routers that pull it (``GET /kv/events``)
and pushed to one that asked (``--kv-events-url``). The batches' format is ``splitserve.protocol.kv_events``.

The publisher sends a snapshot (a ``reset`` batch) first, and again after any failed send, so a router that
restarted or missed events is resynchronised without replaying history. The router answers 409 to a plain
batch from a worker it does not know, which also triggers a reset. Sending never blocks the engine: events
are buffered under a lock and sent by a background thread; an overfull buffer is dropped for a reset.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import httpx

from splitserve.protocol.kv_events import (
    BlockContentSink,
    EventKind,
    KVEventsBatch,
    Tier,
    TierEvent,
    events_batch,
    tier_event,
)

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 0.1
MAX_BACKOFF_S = 5.0
MAX_PENDING_HASHES = 200_000  # hashes of history kept; a reader further behind gets a snapshot
MAX_L2_HASHES = 200_000  # L2 holdings remembered for snapshots (the L2 tier evicts on its own)


class KVEventListener(BlockContentSink, Protocol):
    """Hears a :class:`KVEventLog`'s events as they are recorded, on the recording thread: cheap, never blocking."""

    def recorded(self, tier: Tier, kind: EventKind, hashes: list[int]) -> None: ...


class KVEventLog:
    """What a worker holds, per tier, and the events since: the one source for the push (:class:`KVEventPublisher`)
    and the pull (the worker's ``GET /kv/events``, which a router subscribes to). Implements ``KVEventSink`` and
    ``BlockContentSink`` (``splitserve.protocol.kv_events``), passing block contents on to its listeners
    (``add_listener``).

    Each event gets the next sequence number. :meth:`batch_after` answers with the events after a given number,
    or with a snapshot (``reset``) when the caller has none, or asks about events the log no longer keeps (it
    keeps at most ``MAX_PENDING_HASHES`` hashes of history), or about a number it never gave (the worker
    restarted). Thread-safe; recording never blocks for long.
    """

    def __init__(self, worker_id: str, worker_url: str, meta: Mapping[str, Any] | None = None) -> None:
        self.worker_id = worker_id
        self.worker_url = worker_url
        self.meta = dict(meta or {})
        self.epoch = f"{time.time_ns():x}"  # changes when the worker restarts: a subscriber's numbers are void
        self._lock = threading.Condition()
        self._held: dict[Tier, OrderedDict[int, None]] = {tier: OrderedDict() for tier in Tier}
        self._log: deque[tuple[int, Tier, EventKind, list[int]]] = deque()
        self._num_logged = 0  # hashes in the log
        self._seq = 0
        self._listeners: list[KVEventListener] = []

    def add_listener(self, listener: KVEventListener) -> None:
        """Pass every event from now on to ``listener`` too (call before the engine starts)."""
        self._listeners.append(listener)

    def blocks_cached(
        self, parent_hash: int | None, block_hashes: list[int], token_ids: list[int], cache_salt: str | None
    ) -> None:
        """The tokens behind engine blocks (``KVCacheManager.on_blocks_cached``): for the listeners only; the
        log keeps hashes, which :meth:`stored` records."""
        for listener in self._listeners:
            listener.blocks_cached(parent_hash, block_hashes, token_ids, cache_salt)

    @property
    def seq(self) -> int:
        return self._seq

    def stored(self, tier: Tier, hashes: Iterable[int]) -> None:
        self._record(tier, EventKind.STORED, hashes)

    def removed(self, tier: Tier, hashes: Iterable[int]) -> None:
        self._record(tier, EventKind.REMOVED, hashes)

    def _record(self, tier: Tier, kind: EventKind, hashes: Iterable[int]) -> None:
        hashes = list(hashes)
        if not hashes:
            return
        with self._lock:
            held = self._held[tier]
            for h in hashes:
                if kind == EventKind.STORED:
                    held[h] = None
                    held.move_to_end(h)
                else:
                    held.pop(h, None)
            if tier == Tier.L2:
                while len(held) > MAX_L2_HASHES:
                    held.popitem(last=False)
            self._seq += 1
            self._log.append((self._seq, tier, kind, hashes))
            self._num_logged += len(hashes)
            while self._num_logged > MAX_PENDING_HASHES and len(self._log) > 1:
                self._num_logged -= len(self._log.popleft()[3])
            self._lock.notify_all()
        for listener in self._listeners:
            listener.recorded(tier, kind, hashes)

    def wait_after(self, seq: int, timeout_s: float) -> bool:
        """Block until there is an event after ``seq`` (True), or ``timeout_s`` passed (False)."""
        with self._lock:
            return self._lock.wait_for(lambda: self._seq > seq, timeout_s)

    def no_events(self) -> KVEventsBatch:
        """A batch with no events at the log's position: the answer to a reader that follows the load alone."""
        with self._lock:
            return events_batch(self.worker_id, self.worker_url, self._seq, self.epoch, [])

    def batch_after(self, seq: int | None, epoch: str | None = None) -> KVEventsBatch:
        """The batch that brings a reader who has seen everything up to ``seq`` (of ``epoch``) up to date."""
        with self._lock:
            oldest = self._log[0][0] if self._log else self._seq + 1
            if seq is None or epoch not in (None, self.epoch) or seq > self._seq or seq < oldest - 1:
                snapshot = [tier_event(tier, EventKind.STORED, list(held)) for tier, held in self._held.items() if held]
                return events_batch(self.worker_id, self.worker_url, self._seq, self.epoch, snapshot, self.meta)
            events: list[TierEvent] = []
            for number, tier, kind, hashes in self._log:
                if number <= seq:
                    continue
                last = events[-1] if events else None
                if last is not None and last["tier"] == tier.value and last["kind"] == kind.value:
                    last["hashes"] = [*last["hashes"], *hashes]
                else:
                    events.append(tier_event(tier, kind, hashes))
            return events_batch(self.worker_id, self.worker_url, self._seq, self.epoch, events)


class KVEventPublisher:
    """Sends a :class:`KVEventLog`'s events in batches to ``url`` (the router's ``/kv/events``): a snapshot
    first, and again after any failed send, then what happened since the last batch that was accepted.

    Args:
        url: the router's events endpoint, e.g. ``http://127.0.0.1:8080/kv/events``.
        log: the worker's events.
        interval_s: how often a batch is sent while events arrive.
        transport: replaces the network (tests).
        headers: sent with every batch (the cluster secret, ``splitserve.auth.bearer_header``).
    """

    def __init__(
        self,
        url: str,
        log: KVEventLog,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        transport: httpx.BaseTransport | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.url = url
        self.log = log
        self.interval_s = interval_s
        self._client = httpx.Client(
            transport=transport, timeout=httpx.Timeout(5.0), trust_env=False, headers=dict(headers or {})
        )
        self._closed = threading.Event()
        self._sent: int | None = None  # the log's number up to which the router has everything; None: resend all
        self._is_registered = False
        self._num_failures = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)

    @property
    def worker_id(self) -> str:
        return self.log.worker_id

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is buffered (best effort, bounded) and stop."""
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._client.close()

    @property
    def is_registered(self) -> bool:
        """True once the router accepted a snapshot, until a send fails."""
        return self._is_registered

    def _run(self) -> None:
        """The sender thread: a batch per ``interval_s`` while events arrive; back-off while sends fail."""
        delay_s = 0.0
        while True:
            if delay_s and self._closed.wait(delay_s) and self._sent is None:
                return  # closing, and nothing worth sending
            if self._sent is not None:
                while not self.log.wait_after(self._sent, 0.1):
                    if self._closed.is_set():
                        return
            batch = self.log.batch_after(self._sent)
            if self._send(batch):
                self._sent = batch["seq"]
                delay_s = self.interval_s
                continue
            self._sent = None
            if self._closed.is_set():
                return
            delay_s = min(max(delay_s * 2, 0.25), MAX_BACKOFF_S)

    def _send(self, body: KVEventsBatch) -> bool:
        try:
            response = self._client.post(self.url, json=body)
        except httpx.HTTPError as exc:
            self._failed(f"{type(exc).__name__}: {exc}")
            return False
        if response.status_code != 200:
            self._failed(f"HTTP {response.status_code}: {response.text[:200]}")
            return False
        if body["reset"]:
            logger.info("KV events: registered with %s as %s (%s)", self.url, self.worker_id, self.log.worker_url)
        elif self._num_failures:
            logger.info("KV events: %s reachable again", self.url)
        self._is_registered = True
        self._num_failures = 0
        return True

    def _failed(self, reason: str) -> None:
        self._is_registered = False
        self._num_failures += 1
        if self._num_failures == 1:
            logger.warning("KV events: sending to %s failed (%s); retrying with back-off", self.url, reason)

"""KV events: each worker tells the router which KV it holds, per tier, so routing can follow the cache.

Wire format: the worker POSTs JSON batches to ``--kv-events-url`` (the router's ``/kv/events``)::

    {"worker_id": "w-8001", "worker_url": "http://127.0.0.1:8001", "seq": 7, "reset": false,
     "meta": {...},                      # only when reset is true: model, block_size, chunk_size, layout, role
     "events": [{"tier": "engine", "kind": "stored", "hashes": [123, ...]}, ...]}

Hashes are ``keys.hash_blocks`` block hashes (unsigned 64-bit ints): for the ``engine`` tier every cached
block; for ``l1`` and ``l2`` the name of each stored record (the hash of its last block, see ``keys``). The
``l2`` tier is shared, so an ``l2`` event tells the router about every worker.

A batch with ``reset`` true is the worker's registration: a full snapshot that replaces whatever the router
knew of that worker. The publisher sends one first, and again after any failed send, so a router that
restarted or missed events is resynchronised without replaying history. The router answers 409 to a plain
batch from a worker it does not know, which also triggers a reset. Sending never blocks the engine: events
are buffered under a lock and sent by a background thread; an overfull buffer is dropped for a reset.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Any, Protocol

import httpx

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 0.1
MAX_BACKOFF_S = 5.0
MAX_PENDING_HASHES = 200_000  # past this the buffer is dropped and the next batch is a snapshot
MAX_L2_HASHES = 200_000  # L2 holdings remembered for snapshots (the L2 tier evicts on its own)


class Tier(StrEnum):
    ENGINE = "engine"  # the engine's prefix cache (KV blocks in the engine)
    L1 = "l1"  # this worker's CPU-memory tier
    L2 = "l2"  # the shared tier (Redis or disk)


class EventKind(StrEnum):
    STORED = "stored"
    REMOVED = "removed"


class KVEventSink(Protocol):
    """Where the engine and the KV store report what they hold. Calls must be cheap and never block."""

    def stored(self, tier: Tier, hashes: Iterable[int]) -> None: ...

    def removed(self, tier: Tier, hashes: Iterable[int]) -> None: ...


class KVEventPublisher:
    """Buffers KV events and sends them in batches to the router; implements :class:`KVEventSink`.

    Args:
        url: the router's events endpoint, e.g. ``http://127.0.0.1:8080/kv/events``.
        worker_id: a stable name for this worker (the router logs ``Worker registered: <worker_id>``).
        worker_url: the base URL the router reaches this worker at (it must match a router backend).
        meta: sent with every snapshot (model, block size, chunk size, KV layout, role).
        interval_s: how often a batch is sent while events arrive.
        transport: replaces the network (tests).
        headers: sent with every batch (the cluster secret, ``splitserve.auth.bearer_header``).
    """

    def __init__(
        self,
        url: str,
        worker_id: str,
        worker_url: str,
        meta: Mapping[str, Any] | None = None,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        transport: httpx.BaseTransport | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.url = url
        self.worker_id = worker_id
        self.worker_url = worker_url
        self.meta = dict(meta or {})
        self.interval_s = interval_s
        self._client = httpx.Client(
            transport=transport, timeout=httpx.Timeout(5.0), trust_env=False, headers=dict(headers or {})
        )
        self._lock = threading.Condition()
        self._held: dict[Tier, OrderedDict[int, None]] = {tier: OrderedDict() for tier in Tier}
        self._pending: list[dict[str, Any]] = []
        self._num_pending = 0
        self._needs_reset = True
        self._seq = 0
        self._is_closed = False
        self._is_registered = False
        self._num_failures = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is buffered (best effort, bounded) and stop."""
        with self._lock:
            self._is_closed = True
            self._lock.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._client.close()

    @property
    def is_registered(self) -> bool:
        """True once the router accepted a snapshot, until a send fails."""
        return self._is_registered

    # -- the sink -----------------------------------------------------------------------------------------

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
            if self._needs_reset:
                return  # the next snapshot carries it
            last = self._pending[-1] if self._pending else None
            if last is not None and last["tier"] == tier and last["kind"] == kind:
                last["hashes"].extend(hashes)
            else:
                self._pending.append({"tier": tier.value, "kind": kind.value, "hashes": hashes})
            self._num_pending += len(hashes)
            if self._num_pending > MAX_PENDING_HASHES:
                self._needs_reset = True
                self._pending, self._num_pending = [], 0
            self._lock.notify()

    # -- sending ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        """The sender thread: a batch per ``interval_s`` while events arrive; back-off while sends fail."""
        delay_s = 0.0
        while True:
            with self._lock:
                if delay_s:
                    self._lock.wait_for(lambda: self._is_closed, delay_s)  # pacing, cut short by close()
                self._lock.wait_for(lambda: self._is_closed or bool(self._pending) or self._needs_reset)
                is_closing = self._is_closed
                batch = None if is_closing and self._needs_reset else self._take_batch()
            if batch is None:
                return  # closing, and nothing worth sending
            if self._send(batch):
                delay_s = self.interval_s
                continue
            with self._lock:
                self._needs_reset = True
                self._pending, self._num_pending = [], 0
            if is_closing:
                return
            delay_s = min(max(delay_s * 2, 0.25), MAX_BACKOFF_S)

    def _take_batch(self) -> dict[str, Any] | None:
        """The next body to send (caller holds the lock), or None when there is nothing to say."""
        is_reset = self._needs_reset
        if not is_reset and not self._pending:
            return None
        self._seq += 1
        body: dict[str, Any] = {
            "worker_id": self.worker_id,
            "worker_url": self.worker_url,
            "seq": self._seq,
            "reset": is_reset,
        }
        if is_reset:
            body["meta"] = self.meta
            body["events"] = [
                {"tier": tier.value, "kind": EventKind.STORED.value, "hashes": list(held)}
                for tier, held in self._held.items()
                if held
            ]
            self._needs_reset = False
        else:
            body["events"] = self._pending
        self._pending, self._num_pending = [], 0
        return body

    def _send(self, body: dict[str, Any]) -> bool:
        try:
            response = self._client.post(self.url, json=body)
        except httpx.HTTPError as exc:
            self._failed(f"{type(exc).__name__}: {exc}")
            return False
        if response.status_code != 200:
            self._failed(f"HTTP {response.status_code}: {response.text[:200]}")
            return False
        if body["reset"]:
            logger.info("KV events: registered with %s as %s (%s)", self.url, self.worker_id, self.worker_url)
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


def parse_batch(body: Any) -> tuple[str, str, bool, list[tuple[Tier, EventKind, list[int]]]]:
    """Validate an events body: ``(worker_id, worker_url, reset, [(tier, kind, hashes)])``.

    Raises ``ValueError`` naming the first problem.
    """
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    worker_id, worker_url = body.get("worker_id"), body.get("worker_url")
    if not isinstance(worker_id, str) or not worker_id or not isinstance(worker_url, str) or not worker_url:
        raise ValueError("'worker_id' and 'worker_url' must be non-empty strings")
    reset = body.get("reset", False)
    if not isinstance(reset, bool):
        raise ValueError("'reset' must be a boolean")
    events = body.get("events", [])
    if not isinstance(events, list):
        raise ValueError("'events' must be a list")
    parsed: list[tuple[Tier, EventKind, list[int]]] = []
    for i, event in enumerate(events):
        try:
            tier, kind, hashes = Tier(event["tier"]), EventKind(event["kind"]), event["hashes"]
        except (TypeError, KeyError, ValueError) as exc:
            raise ValueError(f"events[{i}] needs 'tier' (engine, l1, l2), 'kind' (stored, removed), 'hashes'") from exc
        if not isinstance(hashes, list) or not all(type(h) is int and 0 <= h < 2**64 for h in hashes):
            raise ValueError(f"events[{i}].hashes must be a list of unsigned 64-bit integers")
        parsed.append((tier, kind, hashes))
    return worker_id, worker_url, reset, parsed

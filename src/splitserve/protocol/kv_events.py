"""KV events: each worker tells the router which KV it holds, per tier, so routing can follow the cache.

Wire format: a JSON batch, pulled from the worker's ``GET /kv/events`` or POSTed to ``--kv-events-url`` (the
router's ``/kv/events``)::

    {"worker_id": "w-8001", "worker_url": "http://127.0.0.1:8001", "seq": 7, "epoch": "17f3...", "reset": false,
     "meta": {...},                      # only when reset is true: model, block_size, chunk_size, layout, role
     "events": [{"tier": "engine", "kind": "stored", "hashes": [123, ...]}, ...]}

Hashes are ``keys.hash_blocks`` block hashes (unsigned 64-bit ints): for the ``engine`` tier every cached
block; for ``l1`` and ``l2`` the name of each stored record (the hash of its last block, see ``keys``). The
``l2`` tier is shared, so an ``l2`` event tells the router about every worker.

A batch with ``reset`` true is the worker's registration: a full snapshot that replaces whatever the router
knew of that worker. ``epoch`` changes when the worker restarts, so a reader's sequence numbers are void then.

A pulled batch also carries the worker's engine load (``"load": {"waiting": 2, "prefilling": 1, "running": 9,
"prefill_tokens": 1800}``, :class:`WorkerLoad`), and the long poll answers as soon as that load changes, events
or not: every router replica then sees the requests the others sent (``router/discovery.py``, ``Worker.unseen``).

Inside a worker, the engine and the KV store report what they hold to a :class:`KVEventSink` (the worker's
``KVEventLog``, ``splitserve.worker.kv_events``), which turns it into these batches.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NotRequired, Protocol, TypedDict, runtime_checkable


class Tier(StrEnum):
    ENGINE = "engine"  # the engine's prefix cache (KV blocks in the engine)
    L1 = "l1"  # this worker's CPU-memory tier
    L2 = "l2"  # the shared tier (Redis or disk)


class EventKind(StrEnum):
    STORED = "stored"
    REMOVED = "removed"


class TierEvent(TypedDict):
    """Hashes one tier stored or removed, in the order it happened."""

    tier: str  # a Tier's value
    kind: str  # an EventKind's value
    hashes: list[int]


class KVEventsBatch(TypedDict):
    """One batch: a reset's snapshot (with ``meta``) or the events after the reader's ``seq``."""

    worker_id: str
    worker_url: str
    seq: int  # the number of the batch's last event
    epoch: str
    reset: bool
    meta: NotRequired[dict[str, Any]]  # reset batches only
    events: list[TierEvent]
    load: NotRequired[dict[str, int]]  # pulled batches: WorkerLoad.to_json()


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's engine load as it reports it with its KV events."""

    waiting: int = 0  # requests without a seat in the running batch yet
    prefilling: int = 0  # requests with a seat whose prompt is not all computed
    running: int = 0  # requests with a seat: prefilling or decoding
    prefill_tokens: int = 0  # prompt tokens still to compute, of those waiting or prefilling

    def to_json(self) -> dict[str, int]:
        return {"waiting": self.waiting, "prefilling": self.prefilling, "running": self.running,
                "prefill_tokens": self.prefill_tokens}  # fmt: skip

    @property
    def changes(self) -> tuple[int, int, int]:
        """What a long poll answers early for: the requests in each state."""
        return self.waiting, self.prefilling, self.running


def parse_load(batch: Mapping[str, Any]) -> WorkerLoad | None:
    """A batch's ``load``; None when it has none (a pushed batch, an older worker) or it is malformed."""
    load = batch.get("load")
    if not isinstance(load, dict):
        return None
    values = [load.get(name) for name in ("waiting", "prefilling", "running", "prefill_tokens")]
    if not all(type(v) is int and v >= 0 for v in values):
        return None
    return WorkerLoad(*values)  # type: ignore[arg-type]


def tier_event(tier: Tier, kind: EventKind, hashes: list[int]) -> TierEvent:
    return {"tier": tier.value, "kind": kind.value, "hashes": hashes}


def events_batch(
    worker_id: str,
    worker_url: str,
    seq: int,
    epoch: str,
    events: list[TierEvent],
    meta: Mapping[str, Any] | None = None,
) -> KVEventsBatch:
    """A batch; with ``meta`` it is a reset (a snapshot that replaces what the reader knew of the worker)."""
    if meta is None:
        return {"worker_id": worker_id, "worker_url": worker_url, "seq": seq, "epoch": epoch, "reset": False,
                "events": events}  # fmt: skip
    return {"worker_id": worker_id, "worker_url": worker_url, "seq": seq, "epoch": epoch, "reset": True,
            "meta": dict(meta), "events": events}  # fmt: skip


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


class KVEventSink(Protocol):
    """Where the engine and the KV store report what they hold. Calls must be cheap and never block."""

    def stored(self, tier: Tier, hashes: Iterable[int]) -> None: ...

    def removed(self, tier: Tier, hashes: Iterable[int]) -> None: ...


@runtime_checkable
class BlockContentSink(Protocol):
    """A sink that also wants the tokens behind the engine's cached blocks (the worker's ``KVEventLog`` does,
    for its listeners): the engine then reports them too. Must be cheap and never block."""

    def blocks_cached(
        self, parent_hash: int | None, block_hashes: list[int], token_ids: list[int], cache_salt: str | None
    ) -> None:
        """Blocks the engine just cached, with their tokens; a prompt's first block has no parent, and its
        ``cache_salt`` if it has one."""
        ...

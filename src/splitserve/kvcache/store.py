"""TieredStore: L1 (this process's memory) in front of an optional shared L2 (Redis or disk).

Reads are by contiguous prefix: a prompt's chunks form a hash chain, so a chunk is only useful when every
chunk before it is available too. Writes go to L1 at once and to L2 from a background thread through a queue
bounded in bytes; when it is full the write is dropped and counted, so the engine thread never waits on L2.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from splitserve.keys import hash_of_key
from splitserve.kvcache.tiers import KVTier, KVValue, TierStats
from splitserve.protocol.kv_events import KVEventSink, Tier

logger = logging.getLogger(__name__)

DEFAULT_MAX_PENDING_WRITE_BYTES = 256 * 1024 * 1024

RecordValidator = Callable[[str, KVValue], object]
"""Given the key a value was read under and the value: raises ValueError (e.g. ``serde.RecordError``) for a
record that must not be served."""


class PrefixHit(NamedTuple):
    """How many leading chunks of a request are held; ``num_in_l1 <= num_in_l1_or_l2``."""

    num_in_l1: int
    num_in_l1_or_l2: int


@dataclass(slots=True)
class StoreStats:
    """Counters of the store itself, plus a copy of each tier's."""

    num_l2_writes_queued: int = 0
    num_l2_writes_dropped: int = 0  # queue full, or store closing
    num_l2_writes_done: int = 0  # handed to the L2 tier (which counts its own failures)
    num_promotions: int = 0  # L2 hits copied into L1
    num_invalid_records: int = 0  # L2 values rejected by the validator, then deleted from L2
    pending_write_bytes: int = 0
    l1: TierStats | None = None
    l2: TierStats | None = None


class TieredStore:
    """Lookup, read with promotion, and write-through over an L1 tier and an optional L2 tier.

    Args:
        l1: the fast local tier (normally ``CPUTier``); values in it are trusted (written by this process).
        l2: the shared tier (``RedisTier`` or ``DiskTier``), or None for L1 only.
        validate: run on every value read from L2 (with its key) before it is served or promoted; a ValueError
            makes it a miss and counts it, and deletes it from L2 unless the error says ``is_foreign`` (a record
            of another secret, model, layout or format version is someone else's). Typically
            ``serde.RecordSigner.verify``.
        max_pending_write_bytes: bound on the bytes waiting to be written to L2.
        events: told what L1 stores and drops, and what L2 confirmed it holds after a write (for the
            router's KV index). L1 evictions reach it only through the L1 tier's own ``on_evict``.

    The store owns both tiers: :meth:`close` stops the writer thread and closes them.
    """

    def __init__(
        self,
        l1: KVTier,
        l2: KVTier | None = None,
        *,
        validate: RecordValidator | None = None,
        max_pending_write_bytes: int = DEFAULT_MAX_PENDING_WRITE_BYTES,
        events: KVEventSink | None = None,
    ) -> None:
        if max_pending_write_bytes <= 0:
            raise ValueError(f"max_pending_write_bytes must be positive, got {max_pending_write_bytes}")
        self.l1 = l1
        self.l2 = l2
        self.max_pending_write_bytes = max_pending_write_bytes
        self._validate = validate
        self._events = events
        self._stats = StoreStats()
        self._cond = threading.Condition()
        self._pending: deque[tuple[str, KVValue]] = deque()
        self._num_in_flight = 0
        self._is_closed = False
        self._writer: threading.Thread | None = None
        if l2 is not None:
            self._writer = threading.Thread(
                target=self._drain_writes, args=(l2,), name="kvcache-l2-writer", daemon=True
            )
            self._writer.start()

    # -- reads --------------------------------------------------------------------------------------------

    def lookup(self, chunk_keys: Sequence[str]) -> PrefixHit:
        """Leading chunks held in L1, and in L1 or L2 (each chunk in either tier). Reads no values."""
        in_l1 = self.l1.contains_many(chunk_keys)
        num_in_l1 = _num_leading(in_l1)
        if self.l2 is None or num_in_l1 == len(chunk_keys):
            return PrefixHit(num_in_l1, num_in_l1)
        in_l2 = self.l2.contains_many(chunk_keys[num_in_l1:])
        num_after = _num_leading(a or b for a, b in zip(in_l1[num_in_l1:], in_l2, strict=True))
        return PrefixHit(num_in_l1, num_in_l1 + num_after)

    def first_held(self, keys: Sequence[str]) -> tuple[int, bool] | None:
        """The index of the first of ``keys`` held in L1 or L2 and whether it is in L1; None when none is.

        Reads no values; L2 is asked only about the keys before the first one held in L1.
        """
        in_l1 = self.l1.contains_many(keys)
        num_before_l1 = in_l1.index(True) if True in in_l1 else len(keys)
        if self.l2 is not None and num_before_l1:
            for i, is_held in enumerate(self.l2.contains_many(keys[:num_before_l1])):
                if is_held:
                    return i, False
        return (num_before_l1, True) if num_before_l1 < len(keys) else None

    def get_prefix(self, chunk_keys: Sequence[str]) -> list[KVValue]:
        """Values of the longest available leading run of ``chunk_keys`` (L1 first, then L2).

        L2 hits within the returned run are validated and copied into L1 (promotion). The result may be
        shorter than what :meth:`lookup` reported if records were evicted, invalid or L2 failed in between.
        """
        values = self.l1.get_many(chunk_keys)
        num_l1 = _num_leading(v is not None for v in values)
        if num_l1 == len(chunk_keys) or self.l2 is None:
            return [v for v in values[:num_l1] if v is not None]
        missing = [i for i in range(num_l1, len(chunk_keys)) if values[i] is None]
        for i, value in zip(missing, self.l2.get_many([chunk_keys[i] for i in missing]), strict=True):
            values[i] = self._checked(self.l2, chunk_keys[i], value)
        from_l2 = set(missing)
        prefix: list[KVValue] = []
        for i, value in enumerate(values):
            if value is None:
                break
            prefix.append(value)
            if i in from_l2:
                self._promote(chunk_keys[i], value)
        return prefix

    # -- writes -------------------------------------------------------------------------------------------

    def put(self, key: str, value: KVValue) -> bool:
        """Store in L1 now and queue for L2; never blocks (a full queue drops the L2 write, counted). True when
        the record was queued for L2."""
        self._put_l1(key, value)
        if self.l2 is None:
            return False
        with self._cond:
            if self._is_closed or self._stats.pending_write_bytes + len(value) > self.max_pending_write_bytes:
                self._stats.num_l2_writes_dropped += 1
                return False
            self._pending.append((key, value))
            self._stats.pending_write_bytes += len(value)
            self._stats.num_l2_writes_queued += 1
            self._cond.notify()
            return True

    def discard(self, key: str) -> None:
        """Delete a key from every tier (e.g. a record that failed to decode)."""
        self.l1.delete(key)
        if self.l2 is not None:
            self.l2.delete(key)
        if self._events is not None:
            self._events.removed(Tier.L1, (hash_of_key(key),))
            self._events.removed(Tier.L2, (hash_of_key(key),))

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued L2 write was handed to L2; False if ``timeout_s`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and self._num_in_flight == 0, timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop accepting L2 writes, finish the queued ones (up to ``timeout_s``), then close both tiers."""
        with self._cond:
            self._is_closed = True
            self._cond.notify_all()
        if self._writer is not None:
            self._writer.join(timeout_s)
            if self._writer.is_alive():
                logger.warning("KV store: L2 writer still busy after %.1f s; abandoning queued writes", timeout_s)
        self.l1.close()
        if self.l2 is not None:
            self.l2.close()

    def stats(self) -> StoreStats:
        with self._cond:
            stats = replace(self._stats)
        stats.l1 = self.l1.stats()
        stats.l2 = self.l2.stats() if self.l2 is not None else None
        return stats

    # -- internals ----------------------------------------------------------------------------------------

    def _checked(self, tier: KVTier, key: str, value: KVValue | None) -> KVValue | None:
        """The L2 value if it passes the validator; otherwise None, and the record is deleted from L2."""
        if value is None or self._validate is None:
            return value
        try:
            self._validate(key, value)
        except ValueError as exc:
            with self._cond:
                self._stats.num_invalid_records += 1
            if getattr(exc, "is_foreign", False):  # another secret's, model's or version's: not ours to delete
                logger.warning("KV store: record %s in %s is not this worker's; a miss: %s", key, tier.name, exc)
                return None
            logger.warning("KV store: dropping invalid record %s from %s: %s", key, tier.name, exc)
            tier.delete(key)
            return None
        return value

    def _put_l1(self, key: str, value: KVValue) -> None:
        self.l1.put(key, value)
        if self._events is not None and self.l1.contains_many((key,))[0]:
            self._events.stored(Tier.L1, (hash_of_key(key),))

    def _promote(self, key: str, value: KVValue) -> None:
        self._put_l1(key, value)
        with self._cond:
            self._stats.num_promotions += 1

    def _drain_writes(self, l2: KVTier) -> None:
        """The writer thread: hand queued writes to L2 in order until closed and empty."""
        while (item := self._next_write()) is not None:
            key, value = item
            try:
                l2.put(key, value)
                if self._events is not None and l2.contains_many((key,))[0]:  # tiers drop failed writes silently
                    self._events.stored(Tier.L2, (hash_of_key(key),))
            except Exception:  # tiers never raise; a bug must not kill the writer and stall every later write
                logger.exception("KV store: L2 put of %s raised", key)
            with self._cond:
                self._num_in_flight = 0
                self._stats.num_l2_writes_done += 1
                self._cond.notify_all()

    def _next_write(self) -> tuple[str, KVValue] | None:
        with self._cond:
            self._cond.wait_for(lambda: self._pending or self._is_closed)
            if not self._pending:
                return None
            key, value = self._pending.popleft()
            self._stats.pending_write_bytes -= len(value)
            self._num_in_flight = 1
            return key, value


def _num_leading(flags: Iterable[bool]) -> int:
    """Length of the leading run of True values."""
    num = 0
    for flag in flags:
        if not flag:
            break
        num += 1
    return num

"""The decode worker's PD buffer: KV pushed by prefill workers, held until the request claims it.

Bounded in bytes. A push first reserves its size (refused when it does not fit: the sender retries with
back-off); the reservation becomes an entry when the bytes arrived and were verified. Reservations that are
never filled and entries that are never claimed expire, so an abandoned transfer frees its bytes.
Thread-safe: the receiver's connection threads and the engine thread share it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class BufferEntry:
    record: bytearray  # a kvcache.serde record
    num_tokens: int
    tokens_hash: int  # keys.hash_tokens of the prompt tokens the KV belongs to
    layout: str
    stored_at: float = 0.0


@dataclass
class BufferStats:
    capacity_bytes: int
    used_bytes: int = 0
    num_entries: int = 0
    num_reservations: int = 0
    num_refused: int = 0  # reservations refused for lack of room (the sender retries)
    num_expired: int = 0
    num_claimed: int = 0


@dataclass
class _Reservation:
    num_bytes: int
    since: float
    entry: BufferEntry | None = field(default=None)


class PDBuffer:
    def __init__(
        self,
        capacity_bytes: int,
        *,
        reservation_ttl_s: float = 30.0,
        entry_ttl_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"the PD buffer needs a positive size, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.reservation_ttl_s = reservation_ttl_s
        self.entry_ttl_s = entry_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._slots: dict[str, _Reservation] = {}
        self._used = 0
        self._stats = BufferStats(capacity_bytes)

    def reserve(self, transfer_id: str, num_bytes: int) -> bool:
        """Hold ``num_bytes`` for ``transfer_id``; False when they do not fit (or the id is taken)."""
        with self._lock:
            self._expire()
            if transfer_id in self._slots or self._used + num_bytes > self.capacity_bytes:
                self._stats.num_refused += 1
                return False
            self._slots[transfer_id] = _Reservation(num_bytes, self._clock())
            self._used += num_bytes
            return True

    def commit(self, transfer_id: str, entry: BufferEntry) -> bool:
        """Turn a reservation into an entry; False if the reservation expired meanwhile."""
        with self._lock:
            slot = self._slots.get(transfer_id)
            if slot is None or slot.entry is not None:
                return False
            entry.stored_at = self._clock()
            slot.entry = entry
            return True

    def release(self, transfer_id: str) -> None:
        """Drop a reservation or entry (a failed transfer, a rejected or finished request)."""
        with self._lock:
            slot = self._slots.pop(transfer_id, None)
            if slot is not None:
                self._used -= slot.num_bytes

    def peek(self, transfer_id: str) -> BufferEntry | None:
        with self._lock:
            slot = self._slots.get(transfer_id)
            return slot.entry if slot is not None else None

    def take(self, transfer_id: str) -> BufferEntry | None:
        """The entry, removed from the buffer (its bytes are free again); None if absent."""
        with self._lock:
            slot = self._slots.get(transfer_id)
            if slot is None or slot.entry is None:
                return None
            del self._slots[transfer_id]
            self._used -= slot.num_bytes
            self._stats.num_claimed += 1
            return slot.entry

    def stats(self) -> BufferStats:
        with self._lock:
            self._expire()
            stats = BufferStats(**vars(self._stats))
            stats.used_bytes = self._used
            stats.num_entries = sum(s.entry is not None for s in self._slots.values())
            stats.num_reservations = len(self._slots) - stats.num_entries
            return stats

    def _expire(self) -> None:
        now = self._clock()
        for transfer_id, slot in list(self._slots.items()):
            age = now - (slot.entry.stored_at if slot.entry is not None else slot.since)
            if age > (self.entry_ttl_s if slot.entry is not None else self.reservation_ttl_s):
                del self._slots[transfer_id]
                self._used -= slot.num_bytes
                self._stats.num_expired += 1

"""The decode worker's PD buffer: KV pushed by prefill workers, held until the request claims it.

One arena of ``capacity_bytes``, allocated (and touched) once at start, so a transfer writes into memory that
is already mapped instead of paying page faults for every new record. A push first reserves its size, first
fit (refused when no free range is large enough: the sender retries with back-off); the receiver writes the
bytes into the reserved range and commits an entry once they are verified (or aborts it: a reservation is only
ever freed by the thread filling it, whose socket has a timeout). The decode side claims the entry, copies it
into its KV cache and releases it. Entries never claimed expire, so an abandoned transfer frees its bytes.
Thread-safe: the receiver's connection threads and the engine thread share it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class BufferEntry:
    record: memoryview  # a kvcache.serde record, inside the arena
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
class _Slot:
    offset: int
    num_bytes: int
    since: float
    entry: BufferEntry | None = field(default=None)
    is_claimed: bool = False
    is_abandoned: bool = False  # released while still being filled: the filling thread frees it


class PDBuffer:
    def __init__(
        self,
        capacity_bytes: int,
        *,
        entry_ttl_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"the PD buffer needs a positive size, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.entry_ttl_s = entry_ttl_s
        self._clock = clock
        self._arena = memoryview(bytearray(capacity_bytes))
        self._free: list[tuple[int, int]] = [(0, capacity_bytes)]  # (offset, size), sorted, coalesced
        self._lock = threading.Lock()
        self._slots: dict[str, _Slot] = {}
        self._used = 0
        self._stats = BufferStats(capacity_bytes)

    def reserve(self, transfer_id: str, num_bytes: int) -> memoryview | None:
        """Room for ``num_bytes`` for ``transfer_id``, to be filled and committed; None when it does not fit
        (or the id is taken)."""
        with self._lock:
            self._expire()
            offset = self._allocate(num_bytes) if transfer_id not in self._slots and num_bytes > 0 else None
            if offset is None:
                self._stats.num_refused += 1
                return None
            self._slots[transfer_id] = _Slot(offset, num_bytes, self._clock())
            self._used += num_bytes
            return self._arena[offset : offset + num_bytes]

    def count_refusal(self) -> None:
        """A reservation refused before it reached the buffer (a peer over its quota): counted as one."""
        with self._lock:
            self._stats.num_refused += 1

    def commit(self, transfer_id: str, num_tokens: int, tokens_hash: int, layout: str) -> bool:
        """The reserved bytes are filled and verified: make them an entry. False (and the room freed) if the
        reservation was abandoned meanwhile."""
        with self._lock:
            slot = self._slots.get(transfer_id)
            if slot is None or slot.entry is not None:
                return False
            if slot.is_abandoned:
                del self._slots[transfer_id]
                self._free_range(slot)
                return False
            record = self._arena[slot.offset : slot.offset + slot.num_bytes]
            slot.entry = BufferEntry(record, num_tokens, tokens_hash, layout, self._clock())
            return True

    def peek(self, transfer_id: str) -> BufferEntry | None:
        with self._lock:
            slot = self._slots.get(transfer_id)
            return slot.entry if slot is not None and not slot.is_claimed else None

    def claim(self, transfer_id: str) -> BufferEntry | None:
        """The entry, no longer expiring; the caller copies it out, then calls :meth:`release`."""
        with self._lock:
            slot = self._slots.get(transfer_id)
            if slot is None or slot.entry is None or slot.is_claimed:
                return None
            slot.is_claimed = True
            self._stats.num_claimed += 1
            return slot.entry

    def release(self, transfer_id: str) -> None:
        """Free an entry (copied out, rejected, or its request ended). A reservation still being filled is
        only marked: its receiving thread frees it (:meth:`abort` or :meth:`commit`), so no one else gets
        the room while bytes still arrive in it."""
        with self._lock:
            slot = self._slots.get(transfer_id)
            if slot is None:
                return
            if slot.entry is None:
                slot.is_abandoned = True
                return
            del self._slots[transfer_id]
            self._free_range(slot)

    def abort(self, transfer_id: str) -> None:
        """The receiving thread gives up on its reservation (the sender broke off, or the bytes are bad)."""
        with self._lock:
            slot = self._slots.get(transfer_id)
            if slot is not None and slot.entry is None:
                del self._slots[transfer_id]
                self._free_range(slot)

    def stats(self) -> BufferStats:
        with self._lock:
            self._expire()
            stats = BufferStats(**vars(self._stats))
            stats.used_bytes = self._used
            stats.num_entries = sum(s.entry is not None for s in self._slots.values())
            stats.num_reservations = len(self._slots) - stats.num_entries
            return stats

    # -- internals (lock held) ----------------------------------------------------------------------------

    def _allocate(self, num_bytes: int) -> int | None:
        for i, (offset, size) in enumerate(self._free):
            if size >= num_bytes:
                if size == num_bytes:
                    del self._free[i]
                else:
                    self._free[i] = (offset + num_bytes, size - num_bytes)
                return offset
        return None

    def _free_range(self, slot: _Slot) -> None:
        self._used -= slot.num_bytes
        ranges = sorted([*self._free, (slot.offset, slot.num_bytes)])
        merged: list[tuple[int, int]] = []
        for offset, size in ranges:
            if merged and merged[-1][0] + merged[-1][1] == offset:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((offset, size))
        self._free = merged

    def _expire(self) -> None:
        now = self._clock()
        for transfer_id, slot in list(self._slots.items()):
            if slot.is_claimed or slot.entry is None:
                continue  # being copied out, or being filled (its thread's socket timeout bounds that)
            if now - slot.entry.stored_at > self.entry_ttl_s:
                del self._slots[transfer_id]
                self._free_range(slot)
                self._stats.num_expired += 1

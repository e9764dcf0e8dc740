"""L1: KV records in this process's memory, least recently used evicted first, bounded in bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from splitserve.kvcache.tiers import EvictionListener, KVValue, TierStats


class CPUTier:
    """A thread-safe, byte-bounded LRU map of key -> record.

    Invariant: ``_stored_bytes == sum(len(v) for v in entries) <= max_bytes``. A value larger than
    ``max_bytes`` is not stored (counted in ``num_skipped``). ``get_many`` hits refresh recency;
    ``contains_many`` does not.
    """

    def __init__(self, max_bytes: int, on_evict: EvictionListener | None = None, name: str = "cpu") -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.name = name
        self.max_bytes = max_bytes
        self._on_evict = on_evict
        self._entries: OrderedDict[str, KVValue] = OrderedDict()
        self._lock = threading.Lock()
        self._stats = TierStats()
        self._stored_bytes = 0

    def get_many(self, keys: Sequence[str]) -> list[KVValue | None]:
        values: list[KVValue | None] = []
        with self._lock:
            for key in keys:
                value = self._entries.get(key)
                if value is not None:
                    self._entries.move_to_end(key)
                values.append(value)
            num_hits = sum(v is not None for v in values)
            self._stats.num_hits += num_hits
            self._stats.num_misses += len(values) - num_hits
        return values

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [key in self._entries for key in keys]

    def put(self, key: str, value: KVValue) -> None:
        with self._lock:
            if len(value) > self.max_bytes:
                self._stats.num_skipped += 1
                return
            self._remove(key)
            evicted = self._evict_for(len(value))
            self._entries[key] = value
            self._stored_bytes += len(value)
            self._stats.num_puts += 1
            self._stats.written_bytes += len(value)
        self._notify(evicted)

    def delete(self, key: str) -> None:
        with self._lock:
            self._remove(key)

    def stats(self) -> TierStats:
        with self._lock:
            stats = self._stats.snapshot()
            stats.stored_bytes, stats.num_entries = self._stored_bytes, len(self._entries)
        return stats

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._stored_bytes = 0

    def _remove(self, key: str) -> None:
        value = self._entries.pop(key, None)
        if value is not None:
            self._stored_bytes -= len(value)

    def _evict_for(self, num_bytes: int) -> list[str]:
        """Drop least recently used entries until ``num_bytes`` more fit; returns the evicted keys."""
        evicted: list[str] = []
        while self._entries and self._stored_bytes + num_bytes > self.max_bytes:
            key, value = self._entries.popitem(last=False)
            self._stored_bytes -= len(value)
            self._stats.num_evictions += 1
            evicted.append(key)
        return evicted

    def _notify(self, evicted: list[str]) -> None:
        if self._on_evict is not None:
            for key in evicted:
                self._on_evict(key)

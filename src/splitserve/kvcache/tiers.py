"""The contract every KV tier keeps (CPU memory, disk, Redis), and the pieces they share.

A tier is a byte store keyed by ``keys.cache_key(...)`` strings; values are records from ``serde.encode``. A
value read back is ``bytes``, or a ``memoryview`` over the tier's own memory (the disk tier maps its files
rather than copying them into fresh memory); treat it as read-only. Tiers never raise for I/O trouble: a failed
read is a miss, a failed write is dropped, and both are counted in ``stats()`` and logged once per burst. Every
method is safe to call from several threads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

KVValue = bytes | memoryview
"""A record as a tier hands it back (see the module's doc)."""

EvictionListener = Callable[[str], None]
"""Called with a key after the tier evicted it to make room (not on an explicit ``delete``)."""


@dataclass(slots=True)
class TierStats:
    """Counters of one tier since it was created. ``stored_bytes``/``num_entries`` are None when unknown."""

    num_hits: int = 0
    num_misses: int = 0
    num_errors: int = 0
    num_evictions: int = 0
    num_puts: int = 0
    num_skipped: int = 0  # calls not made because the tier is unavailable (circuit breaker open)
    written_bytes: int = 0
    stored_bytes: int | None = 0
    num_entries: int | None = 0

    def snapshot(self) -> TierStats:
        return replace(self)


class KVTier(Protocol):
    """A store of KV records. Implementations: CPUTier, DiskTier, RedisTier."""

    name: str

    def get_many(self, keys: Sequence[str]) -> list[KVValue | None]:
        """Values in key order, None for each miss (or any failure). Counts hits and misses."""
        ...

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is held, without reading values or counting hits; False on any failure."""
        ...

    def put(self, key: str, value: KVValue) -> None:
        """Store (or replace) a value; may evict others. Failures are counted, never raised."""
        ...

    def delete(self, key: str) -> None:
        """Forget a key if present (e.g. a record that failed its checks)."""
        ...

    def stats(self) -> TierStats:
        """A consistent copy of the counters."""
        ...

    def close(self) -> None:
        """Release connections or handles; the tier must not be used afterwards."""
        ...


class ErrorBurstLog:
    """Logs the first error of a burst and the recovery after it, not every error in between.

    A burst starts at an error after a success (or at the first error) and ends at the next success.
    """

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self._logger = logger
        self._what = what
        self._lock = threading.Lock()
        self._num_in_burst = 0

    def error(self, action: str, exc: BaseException) -> None:
        with self._lock:
            self._num_in_burst += 1
            is_first = self._num_in_burst == 1
        if is_first:
            self._logger.warning(
                "%s: %s failed (%s: %s); further errors are counted, not logged, until it recovers",
                self._what,
                action,
                type(exc).__name__,
                exc,
            )

    def success(self) -> None:
        if self._num_in_burst == 0:  # fast path, racy read is fine: worst case one late recovery line
            return
        with self._lock:
            num_errors, self._num_in_burst = self._num_in_burst, 0
        if num_errors:
            self._logger.warning("%s: recovered after %d errors", self._what, num_errors)


class NullTier:
    """A tier that holds nothing: L1 when ``--no-l1-cache`` leaves L2 alone (every read a miss, writes dropped)."""

    def __init__(self, name: str = "none") -> None:
        self.name = name

    def get_many(self, keys: Sequence[str]) -> list[KVValue | None]:
        return [None] * len(keys)

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return [False] * len(keys)

    def put(self, key: str, value: KVValue) -> None:
        pass

    def delete(self, key: str) -> None:
        pass

    def stats(self) -> TierStats:
        return TierStats()

    def close(self) -> None:
        pass

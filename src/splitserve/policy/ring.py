"""The consistent-hash ring of ``session`` routing: a session's key lands on the same worker while others come
and go. xxh3 with a fixed seed (never Python's ``hash()``, which differs between processes), and 64 virtual
nodes per worker."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator

import xxhash

RING_SEED = 0x5E55_1011
VNODES_PER_WORKER = 64


def ring_hash(text: str) -> int:
    return xxhash.xxh3_64_intdigest(text.encode(), seed=RING_SEED)


class HashRing:
    """The ring over workers' names (URLs for the router)."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = tuple(sorted(set(names)))
        self._points = sorted((ring_hash(f"{name}#{i}"), name) for name in self.names for i in range(VNODES_PER_WORKER))

    def walk(self, key: str) -> Iterator[str]:
        """Every virtual node's worker from ``key``'s place on, once round the ring: the owner first, then who
        takes over when it cannot serve."""
        start = bisect.bisect_left(self._points, (ring_hash(key), ""))
        for i in range(len(self._points)):
            yield self._points[(start + i) % len(self._points)][1]

    def owner(self, key: str) -> str:
        return next(self.walk(key))

"""TieredStore: contiguous-prefix lookup, reads with promotion into L1, and write-through to L2 that never
blocks the caller (a full queue drops and counts)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import pytest

from splitserve.kvcache.cpu import CPUTier
from splitserve.kvcache.store import PrefixHit, TieredStore
from splitserve.kvcache.tiers import TierStats


def key(i: int) -> str:
    return f"splitserve:v1:m:layout:{i:016x}"


def value(i: int) -> bytes:
    return bytes([i]) * 100


KEYS = [key(i) for i in range(6)]


class BlockingTier(CPUTier):
    """An L2 whose ``put`` waits until released, like a slow Redis; records the order of writes."""

    def __init__(self) -> None:
        super().__init__(max_bytes=10**6, name="slow")
        self.release = threading.Event()
        self.entered = threading.Event()
        self.put_keys: list[str] = []

    def put(self, key: str, value: bytes) -> None:
        self.entered.set()
        self.release.wait(timeout=5)
        self.put_keys.append(key)
        super().put(key, value)


class RaisingTier(CPUTier):
    def put(self, key: str, value: bytes) -> None:
        raise RuntimeError("a bug in a tier")


class AskedTier(CPUTier):
    """An L2 that records which keys ``contains_many`` was asked about."""

    def __init__(self) -> None:
        super().__init__(max_bytes=10**6, name="l2")
        self.asked: list[str] = []

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        self.asked.extend(keys)
        return super().contains_many(keys)


@pytest.fixture
def tiers() -> Iterator[tuple[TieredStore, CPUTier, CPUTier]]:
    l1, l2 = CPUTier(10**6, name="l1"), CPUTier(10**6, name="l2")
    store = TieredStore(l1, l2)
    yield store, l1, l2
    store.close()


def fill(tier: CPUTier, indices: Sequence[int]) -> None:
    for i in indices:
        tier.put(key(i), value(i))


class TestLookup:
    def test_counts_only_the_contiguous_prefix_per_tier(self, tiers: tuple[TieredStore, CPUTier, CPUTier]) -> None:
        store, l1, l2 = tiers
        fill(l1, [0, 1, 3])
        fill(l2, [2, 4])
        assert store.lookup(KEYS) == PrefixHit(num_in_l1=2, num_in_l1_or_l2=5)  # key 5 is nowhere

    def test_a_gap_ends_the_prefix_even_if_later_chunks_are_held(
        self, tiers: tuple[TieredStore, CPUTier, CPUTier]
    ) -> None:
        store, l1, l2 = tiers
        fill(l1, [1, 2])
        fill(l2, [3])
        assert store.lookup(KEYS) == (0, 0)

    def test_without_l2(self) -> None:
        l1 = CPUTier(10**6)
        fill(l1, [0, 1])
        store = TieredStore(l1)
        assert store.lookup(KEYS) == (2, 2)
        assert store.lookup([]) == (0, 0)
        store.close()

    def test_lookup_reads_no_values(self, tiers: tuple[TieredStore, CPUTier, CPUTier]) -> None:
        store, l1, l2 = tiers
        fill(l2, [0])
        store.lookup(KEYS)
        assert l2.stats().num_hits == 0 and l1.stats().num_misses == 0


class TestFirstHeld:
    """The first of several candidate keys held anywhere (a prompt's tail: its longest shorter record)."""

    def test_an_earlier_key_in_l2_wins_over_a_later_one_in_l1(
        self, tiers: tuple[TieredStore, CPUTier, CPUTier]
    ) -> None:
        store, l1, l2 = tiers
        fill(l1, [3])
        fill(l2, [1, 4])
        assert store.first_held(KEYS) == (1, False)
        assert store.first_held(KEYS[2:]) == (1, True)  # key 3, in L1

    def test_l2_is_asked_only_about_the_keys_before_the_first_l1_hit(self) -> None:
        l1, l2 = CPUTier(10**6, name="l1"), AskedTier()
        store = TieredStore(l1, l2)
        fill(l1, [2])
        assert store.first_held(KEYS) == (2, True) and l2.asked == KEYS[:2]
        l2.asked.clear()
        fill(l1, [0])
        assert store.first_held(KEYS) == (0, True) and l2.asked == []
        store.close()

    def test_none_when_no_key_is_held(self, tiers: tuple[TieredStore, CPUTier, CPUTier]) -> None:
        store, _, _ = tiers
        assert store.first_held(KEYS) is None and store.first_held([]) is None


class TestGetPrefix:
    def test_mixes_tiers_and_promotes_l2_hits_into_l1(self, tiers: tuple[TieredStore, CPUTier, CPUTier]) -> None:
        store, l1, l2 = tiers
        fill(l1, [0, 2])
        fill(l2, [1, 3, 5])
        assert store.get_prefix(KEYS) == [value(i) for i in range(4)]
        assert l1.contains_many(KEYS) == [True, True, True, True, False, False]  # 5 is past the gap
        assert store.stats().num_promotions == 2
        assert store.lookup(KEYS) == (4, 4)

    def test_invalid_l2_records_are_misses_deleted_and_counted(self) -> None:
        l1, l2 = CPUTier(10**6), CPUTier(10**6)
        fill(l2, [0, 1])
        l2.put(key(1), b"corrupt")

        def validate(_key: str, record: bytes) -> None:
            if record == b"corrupt":
                raise ValueError("bad checksum")

        store = TieredStore(l1, l2, validate=validate)
        assert store.get_prefix(KEYS) == [value(0)]
        assert l2.contains_many([key(1)]) == [False] and l1.contains_many([key(1)]) == [False]
        assert store.stats().num_invalid_records == 1
        store.close()

    def test_discard_removes_a_key_from_every_tier(self, tiers: tuple[TieredStore, CPUTier, CPUTier]) -> None:
        store, l1, l2 = tiers
        fill(l1, [0])
        fill(l2, [0])
        store.discard(key(0))
        assert store.lookup(KEYS) == (0, 0)


class TestWriteThrough:
    def test_put_lands_in_l1_at_once_and_in_l2_in_order(self) -> None:
        l1, l2 = CPUTier(10**6), BlockingTier()
        store = TieredStore(l1, l2)
        for i in range(4):
            store.put(key(i), value(i))
        assert store.lookup(KEYS[:4]) == (4, 4)  # served from L1 while L2 is still writing
        l2.release.set()
        assert store.flush(timeout_s=5)
        assert l2.put_keys == KEYS[:4]
        stats = store.stats()
        assert (stats.num_l2_writes_queued, stats.num_l2_writes_done, stats.pending_write_bytes) == (4, 4, 0)
        store.close()

    def test_a_full_queue_drops_and_counts_without_blocking(self) -> None:
        l1, l2 = CPUTier(10**6), BlockingTier()
        store = TieredStore(l1, l2, max_pending_write_bytes=250)
        store.put(key(0), value(0))
        assert l2.entered.wait(timeout=5)  # the writer holds key 0; the queue is empty again
        for i in range(1, 5):
            store.put(key(i), value(i))  # 1 and 2 fit in 250 bytes; 3 and 4 are dropped, not waited for
        assert store.stats().num_l2_writes_dropped == 2
        assert l1.contains_many(KEYS[:5]) == [True] * 5
        l2.release.set()
        store.close()
        assert l2.put_keys == KEYS[:3]

    def test_writes_after_close_are_dropped(self) -> None:
        store = TieredStore(CPUTier(10**6), CPUTier(10**6))
        store.close()
        store.put(key(0), value(0))
        assert store.stats().num_l2_writes_dropped == 1

    def test_a_raising_tier_does_not_kill_the_writer(self) -> None:
        store = TieredStore(CPUTier(10**6), RaisingTier(10**6))
        store.put(key(0), value(0))
        store.put(key(1), value(1))
        assert store.flush(timeout_s=5)
        assert store.stats().num_l2_writes_done == 2
        store.close()

    def test_stats_include_both_tiers(self, tiers: tuple[TieredStore, CPUTier, CPUTier]) -> None:
        store, _, _ = tiers
        store.put(key(0), value(0))
        store.flush(timeout_s=5)
        stats = store.stats()
        assert isinstance(stats.l1, TierStats) and isinstance(stats.l2, TierStats)
        assert stats.l1.stored_bytes == 100 and stats.l2.stored_bytes == 100

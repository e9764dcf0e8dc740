from __future__ import annotations

import pytest

from splitserve.engine.block_pool import BlockPool


def test_allocate_free_roundtrip() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert pool.num_free_blocks == 1 and pool.usage == 0.75
    pool.free(reversed(blocks))
    assert pool.num_free_blocks == 4
    with pytest.raises(ValueError, match="asked for 5 blocks, 4 free"):
        pool.allocate(5)


def test_cached_blocks_survive_free_until_reused() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, 111)
    pool.free([c, b, a])
    assert pool.lookup(111) is a
    # uncached blocks are handed out before cached ones
    got = pool.allocate(2)
    assert a not in got and pool.lookup(111) is a
    # the last free block is the cached one: handing it out evicts it
    evicted: list[int] = []
    pool.on_evict = evicted.append
    (last,) = pool.allocate(1)
    assert last is a and pool.lookup(111) is None and evicted == [111]


def test_touch_takes_a_free_cached_block_back() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache(a, 7)
    pool.free([a])
    pool.touch([a])
    assert a.ref_count == 1 and pool.num_free_blocks == 1
    pool.touch([a])  # a second request shares it
    pool.free([a])
    assert pool.num_free_blocks == 1
    pool.free([a])
    assert pool.num_free_blocks == 2


def test_first_writer_wins_and_caching_can_be_off() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, 5)
    pool.cache(b, 5)
    assert pool.lookup(5) is a and b.block_hash is None
    off = BlockPool(1, enable_caching=False)
    (c,) = off.allocate(1)
    off.cache(c, 9)
    assert off.lookup(9) is None


def test_prompt_tails_outlive_free_like_cached_blocks_and_never_raise_events() -> None:
    pool = BlockPool(3)
    events: list[int] = []
    pool.on_cache = events.append
    pool.on_evict = events.append
    a, b, c = pool.allocate(3)
    pool.cache_tail(a, 7)
    pool.cache_tail(b, 7)  # first writer wins
    assert pool.lookup_tail(7) is a and b.tail_hash is None and pool.lookup(7) is None
    pool.free([c, b, a])
    got = pool.allocate(2)  # blocks holding nothing are handed out first
    assert a not in got and pool.lookup_tail(7) is a
    (last,) = pool.allocate(1)
    assert last is a and pool.lookup_tail(7) is None and a.tail_hash is None
    assert events == []  # tails stay inside the engine: no KV events
    pool.free([a])
    pool.cache_tail(a, 8)
    pool.reset_prefix_cache()
    assert pool.lookup_tail(8) is None

"""The router's two indexes of where KV lives, both keyed by the block hashes of ``splitserve.keys``.

- :class:`PrefixIndex` (``prefixaware``): what the router itself sent where. Each routed prompt's block
  hashes are recorded as held by the worker it went to (every worker sent a block holds it: a shared system
  prompt is held by all of them). Bounded: least recently used hashes are dropped past ``max_blocks``.
- :class:`KVIndex` (``kvaware``): what the workers report holding (``splitserve.protocol.kv_events``): per worker its
  engine prefix cache (block hashes) and L1 (record names), plus the shared L2 (record names). Exact as far
  as events are; bounded per tier.

Hash chains make prefix matching a walk: a block hash names its whole prefix, so the first miss ends it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from splitserve.protocol.kv_events import EventKind, Tier

logger = logging.getLogger(__name__)


class PrefixIndex:
    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self.max_blocks = max_blocks
        # each block's holders, the newest last
        self._holders: OrderedDict[int, dict[str, None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def match(self, block_hashes: Sequence[int]) -> tuple[str | None, int]:
        """The newest holder of the deepest block of the leading run held, and the run's length in blocks."""
        owner, num = None, 0
        for block_hash in block_hashes:
            found = self._holders.get(block_hash)
            if not found:
                break
            owner, num = next(reversed(found)), num + 1
        return owner, num

    def matches(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """The leading blocks each worker holds (workers holding none are left out)."""
        held: dict[str, int] = {}
        alive: set[str] | None = None
        for num, block_hash in enumerate(block_hashes):
            holders = self._holders.get(block_hash)
            alive = set(holders or ()) if alive is None else alive.intersection(holders or ())
            for url in alive:
                held[url] = num + 1
            if not alive:
                break
        return held

    def insert(self, block_hashes: Sequence[int], worker_url: str) -> None:
        """Record the blocks as held by ``worker_url`` (its newest holder) and refresh their recency.

        The deepest block is refreshed first, so eviction takes a prompt's tail before its head: a head that
        outlives its tail still matches, a tail without its head never would.
        """
        index = self._holders
        for block_hash in reversed(block_hashes):
            holders = index.get(block_hash)
            if holders is None:
                holders = index[block_hash] = {}
            holders.pop(worker_url, None)
            holders[worker_url] = None
            index.move_to_end(block_hash)
        while len(index) > self.max_blocks:
            index.popitem(last=False)

    def forget_worker(self, worker_url: str) -> None:
        for block_hash in [h for h, holders in self._holders.items() if worker_url in holders]:
            holders = self._holders[block_hash]
            del holders[worker_url]
            if not holders:
                del self._holders[block_hash]


class TierMatch(NamedTuple):
    """Leading tokens of a prompt a worker can use without computing them, by where they are."""

    engine: int = 0
    l1: int = 0
    l2: int = 0

    @property
    def total(self) -> int:
        return self.engine + self.l1 + self.l2


@dataclass
class _Holdings:
    worker_id: str
    meta: dict[str, object] = field(default_factory=dict)
    engine: set[int] = field(default_factory=set)
    l1: set[int] = field(default_factory=set)


class KVIndex:
    """Event-fed holdings of every registered worker (by URL) and of the shared L2."""

    def __init__(self, block_size: int, chunk_size: int, max_blocks: int) -> None:
        if chunk_size % block_size:
            raise ValueError(f"chunk size {chunk_size} is not a multiple of block size {block_size}")
        self.block_size = block_size
        self.blocks_per_chunk = chunk_size // block_size
        self.max_blocks = max_blocks
        self._workers: dict[str, _Holdings] = {}
        self._l2: OrderedDict[int, None] = OrderedDict()
        self._num_ignored = 0

    def __len__(self) -> int:
        return sum(len(h.engine) + len(h.l1) for h in self._workers.values()) + len(self._l2)

    def sizes(self) -> dict[str, int]:
        """Blocks held, by tier: every worker's engine and L1 blocks, and the shared L2's."""
        return {
            "engine": sum(len(h.engine) for h in self._workers.values()),
            "l1": sum(len(h.l1) for h in self._workers.values()),
            "l2": len(self._l2),
        }

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def is_registered(self, worker_url: str) -> bool:
        return worker_url in self._workers

    def worker_id(self, worker_url: str) -> str | None:
        holdings = self._workers.get(worker_url)
        return holdings.worker_id if holdings is not None else None

    def apply(
        self,
        worker_url: str,
        worker_id: str,
        reset: bool,
        events: Iterable[tuple[Tier, EventKind, list[int]]],
        meta: dict[str, object] | None = None,
    ) -> bool:
        """Apply one batch; False (nothing applied) for a plain batch from a worker that never registered."""
        holdings = self._workers.get(worker_url)
        if reset:
            holdings = self._workers[worker_url] = _Holdings(worker_id, dict(meta or {}))
        elif holdings is None:
            return False
        for tier, kind, hashes in events:
            if tier == Tier.L2:
                self._apply_l2(kind, hashes)
                continue
            held = holdings.engine if tier == Tier.ENGINE else holdings.l1
            if kind == EventKind.REMOVED:
                held.difference_update(hashes)
            elif len(held) + len(hashes) <= self.max_blocks:
                held.update(hashes)
            else:
                self._ignored(len(hashes), worker_id, tier)
        return True

    def forget_worker(self, worker_url: str) -> None:
        self._workers.pop(worker_url, None)

    def clear(self, worker_url: str, tier: Tier) -> None:
        """Forget what ``worker_url`` holds in ``tier`` (engine or l1): that cache was reset."""
        holdings = self._workers.get(worker_url)
        if holdings is not None:
            (holdings.engine if tier == Tier.ENGINE else holdings.l1).clear()

    def match(self, block_hashes: Sequence[int], worker_url: str) -> TierMatch:
        """What ``worker_url`` could take of a prompt with these block hashes: its prefix cache first, then
        stored records chunk by chunk (L1 before L2), exactly as the worker's connector would load them."""
        holdings = self._workers.get(worker_url)
        engine_set = holdings.engine if holdings is not None else set()
        l1_set = holdings.l1 if holdings is not None else set()
        num = len(block_hashes)
        pos = 0
        while pos < num and block_hashes[pos] in engine_set:
            pos += 1
        engine_blocks, tier_blocks = pos, {Tier.L1: 0, Tier.L2: 0}
        per_chunk = self.blocks_per_chunk
        while pos < num:
            chunk_last = min((pos // per_chunk + 1) * per_chunk, num) - 1
            found: tuple[int, Tier] | None = None
            for j in range(chunk_last, pos - 1, -1):  # the longest record of this chunk reaching past pos
                if block_hashes[j] in l1_set:
                    found = (j, Tier.L1)
                elif block_hashes[j] in self._l2:
                    found = (j, Tier.L2)
                if found is not None:
                    break
            if found is None:
                break
            end, tier = found
            tier_blocks[tier] += end + 1 - pos
            pos = end + 1
            if (end + 1) % per_chunk:
                break  # a shorter record: nothing follows it
        bs = self.block_size
        return TierMatch(engine_blocks * bs, tier_blocks[Tier.L1] * bs, tier_blocks[Tier.L2] * bs)

    def _apply_l2(self, kind: EventKind, hashes: list[int]) -> None:
        if kind == EventKind.REMOVED:
            for block_hash in hashes:
                self._l2.pop(block_hash, None)
            return
        for block_hash in hashes:
            self._l2[block_hash] = None
            self._l2.move_to_end(block_hash)
        while len(self._l2) > self.max_blocks:
            self._l2.popitem(last=False)

    def _ignored(self, num: int, worker_id: str, tier: Tier) -> None:
        self._num_ignored += num
        if self._num_ignored == num:
            logger.warning(
                "KV index: %s reports more than %d %s blocks; further ones are ignored (raise the cap)",
                worker_id, self.max_blocks, tier.value,
            )  # fmt: skip

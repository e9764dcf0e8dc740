"""KV blocks with reference counts, an LRU of free blocks, and the prefix cache (block hash -> block).

A block is in exactly one of two states: in use (``ref_count > 0``, owned by one or more requests) or free
(``ref_count == 0``, in ``_free``). A free block may still hold a cached prefix (``block_hash`` set); it is
evicted, and its hash forgotten, only when it is handed out again. Free blocks without a hash are handed
out first, then cached blocks from least recently freed.

Besides full blocks, the pool remembers prompt tails: the partial last block of a prompt whose prefill
finished, named by ``tail_hash`` (its parent's block hash chained with the tail's tokens). A later request
with the same prompt copies that block instead of recomputing the tail, so a fully cached prompt computes
only its last token. Tails never leave the engine: they are not published as KV events or stored in tiers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    tail_hash: int | None = None  # a prompt tail this (partial) block holds, if any


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVBlock] = {}
        self._tails: dict[int, KVBlock] = {}
        self.on_cache: Callable[[int], None] | None = None  # called with a hash when a block starts holding it
        self.on_evict: Callable[[int], None] | None = None  # called with a hash when its block is reused

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self._cached.get(block_hash)

    def lookup_tail(self, tail_hash: int) -> KVBlock | None:
        return self._tails.get(tail_hash)

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Hand out ``num_blocks`` free blocks with ``ref_count`` 1, evicting cached contents as needed.

        Raises ``ValueError`` if fewer are free; callers check ``num_free_blocks`` first.
        """
        if num_blocks > len(self._free):
            raise ValueError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        out = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_count = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks found by ``lookup`` (removing free ones from the LRU)."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block; blocks reaching zero become free.

        Pass a request's blocks in reverse order so that its tail blocks are evicted before its head, which
        other requests are more likely to share.
        """
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block
                if block.block_hash is None and block.tail_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def cache(self, block: KVBlock, block_hash: int) -> None:
        """Record that ``block`` holds the KV of the block named ``block_hash`` (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block
        if self.on_cache is not None:
            self.on_cache(block_hash)

    def cache_tail(self, block: KVBlock, tail_hash: int) -> None:
        """Record that ``block``'s leading slots hold the prompt tail named ``tail_hash`` (first writer wins)."""
        if not self.enable_caching or block.tail_hash is not None or tail_hash in self._tails:
            return
        block.tail_hash = tail_hash
        self._tails[tail_hash] = block

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash held by a free block."""
        for block in self._free.values():
            self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        if block.tail_hash is not None:
            if self._tails.get(block.tail_hash) is block:
                del self._tails[block.tail_hash]
            block.tail_hash = None
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
            if self.on_evict is not None:
                self.on_evict(block.block_hash)
        block.block_hash = None

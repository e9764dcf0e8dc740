"""Which KV blocks each request holds: prefix matching on admission, growth as tokens are scheduled."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.block_pool import BlockPool, KVBlock
from splitserve.engine.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    num_queries: int = 0  # prompt tokens looked up
    num_hits: int = 0  # of those, tokens found cached


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.stats = PrefixCacheStats()
        self._blocks: dict[str, list[KVBlock]] = {}
        self._num_published: dict[str, int] = {}  # leading blocks already offered to the prefix cache

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, [])]

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """The longest run of leading full blocks already cached, leaving at least one token to compute.

        At least one token must be computed to produce logits, so a fully cached prompt matches one block
        less. Does not count in ``stats`` (a request may be looked up again while it waits for blocks).
        """
        if not self.pool.enable_caching:
            return []
        hashes = request.update_block_hashes(self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        found: list[KVBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one request's prefix-cache lookup; the scheduler calls it once, at first admission."""
        self.stats.num_queries += num_tokens
        self.stats.num_hits += num_hit_tokens

    def allocate(self, request: Request, num_new_tokens: int, cached: list[KVBlock] | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the request's computed (and ``cached``) ones.

        ``cached`` are blocks from ``find_cached_prefix`` for a request holding none yet. Returns False, with
        nothing changed, when the pool has too few free blocks.
        """
        cached = cached or []
        held = self._blocks.setdefault(request.request_id, [])
        num_tokens = request.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        num_needed = -(-num_tokens // self.block_size) - len(held) - len(cached)
        num_cached_free = sum(1 for b in cached if b.ref_count == 0)
        if num_needed > self.pool.num_free_blocks - num_cached_free:
            return False
        self.pool.touch(cached)
        held.extend(cached)
        if num_needed > 0:
            held.extend(self.pool.allocate(num_needed))
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Publish the request's full, computed blocks in the prefix cache."""
        if not self.pool.enable_caching:
            return
        held = self._blocks.get(request.request_id, [])
        num_full = request.num_computed_tokens // self.block_size
        start = self._num_published.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = request.update_block_hashes(self.block_size)
        end = min(num_full, len(hashes), len(held))
        for i in range(start, end):
            if held[i].block_hash is None:
                self.pool.cache(held[i], hashes[i])
        self._num_published[request.request_id] = end

    def free(self, request: Request) -> None:
        """Release every block the request holds (tail first)."""
        blocks = self._blocks.pop(request.request_id, [])
        self._num_published.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    @property
    def usage(self) -> float:
        return self.pool.usage

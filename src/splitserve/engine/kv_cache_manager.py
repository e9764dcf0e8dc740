"""Which KV blocks each request holds: prefix matching on admission, growth as tokens are scheduled."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.engine.block_pool import BlockPool, KVBlock
from splitserve.engine.request import Request
from splitserve.keys import hash_block

# (parent hash or None for a prompt's first block, block hashes, their token ids, the cache_salt of a first block)
BlocksCached = Callable[[int | None, list[int], list[int], str | None], None]
ENGINE_SOURCE = "engine"  # Request.cached_tokens_by_source: tokens the engine's own prefix cache held


@dataclass(slots=True)
class PrefixCacheStats:
    """Cache lookups at each request's first admission (a preempted request's readmission is not counted)."""

    num_queries: int = 0  # prompt tokens looked up in the engine's prefix cache
    num_hits: int = 0  # of those, tokens found cached
    num_external_queries: int = 0  # tokens past the engine's match, asked of the KV connector
    num_external_hits: int = 0  # of those, tokens it loaded
    hits_by_source: dict[str, int] = field(default_factory=dict)  # num_hits + num_external_hits, by source


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.stats = PrefixCacheStats()
        self._blocks: dict[str, list[KVBlock]] = {}
        self._num_published: dict[str, int] = {}  # leading blocks already offered to the prefix cache
        self._tail_published: set[str] = set()  # requests whose prompt tail was offered to the pool
        self._pinned: list[KVBlock] = []  # tail sources copied by the step being run: kept from eviction
        # told the tokens behind each run of blocks this manager offers the prefix cache; vLLM-format KV events
        # carry them (splitserve.worker.vllm_publisher)
        self.on_blocks_cached: BlocksCached | None = None

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, [])]

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """The longest run of leading full blocks already cached, leaving at least one token to compute.

        At least one token must be computed to produce logits, so a fully cached prompt matches one block
        less. Does not count in ``stats`` (a request may be looked up again while it waits for blocks).
        """
        if not self.pool.enable_caching or request.params.prompt_logprobs is not None:
            return []  # prompt logprobs: every prompt position's logits are computed
        hashes = request.update_block_hashes(self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        found: list[KVBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def find_cached_tail(self, request: Request, num_cached_blocks: int) -> KVBlock | None:
        """A block holding the request's last, partly computed block but its last token, or None.

        Applies when ``find_cached_prefix`` found every full block before it (``num_cached_blocks``). The
        block is a cached full block when the tokens end on a block boundary, else the tail a request with
        the same tokens left (``cache_prompt_tail``). Its leading slots are copied into the request's own
        block (``SchedulerOutput.block_copies``), and only the last token is computed.
        """
        num_tokens = request.num_tokens
        last = (num_tokens - 1) // self.block_size
        start = last * self.block_size
        if not self.pool.enable_caching or request.params.prompt_logprobs is not None:
            return None
        if num_cached_blocks != last or num_tokens - start < 2:
            return None
        hashes = request.update_block_hashes(self.block_size)
        if num_tokens - start == self.block_size:
            return self.pool.lookup(hashes[last])
        parent = hashes[last - 1] if last else request.root_hash
        return self.pool.lookup_tail(hash_block(parent, request.all_token_ids[start:num_tokens]))

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one request's prefix-cache lookup; the scheduler calls it once, at first admission."""
        self.stats.num_queries += num_tokens
        self.stats.num_hits += num_hit_tokens
        self._count_hits(ENGINE_SOURCE, num_hit_tokens)

    def record_external_query(self, num_tokens: int) -> None:
        """Count the tokens past the engine's match that one request asks of the KV connectors; once, at first
        admission, and only with a connector."""
        self.stats.num_external_queries += num_tokens

    def record_external_hits(self, loaded_by_source: tuple[tuple[str, int], ...]) -> None:
        """Count what a first admission's KV load copied, by source, once the runner has done it."""
        for source, num in loaded_by_source:
            self.stats.num_external_hits += num
            self._count_hits(source, num)

    def _count_hits(self, source: str, num_tokens: int) -> None:
        by_source = self.stats.hits_by_source
        by_source[source] = by_source.get(source, 0) + num_tokens

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        cached: list[KVBlock] | None = None,
        tail: KVBlock | None = None,
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the request's computed (and ``cached``) ones.

        ``cached`` are blocks from ``find_cached_prefix`` for a request holding none yet, and ``tail`` the one
        from ``find_cached_tail``, which stays pinned until ``release_pins`` (after the step copied it).
        Returns False, with nothing changed, when the pool has too few free blocks.
        """
        cached = cached or []
        held = self._blocks.setdefault(request.request_id, [])
        num_tokens = request.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        num_needed = -(-num_tokens // self.block_size) - len(held) - len(cached)
        borrowed = [*cached, tail] if tail is not None else cached
        num_cached_free = sum(1 for b in borrowed if b.ref_count == 0)
        if num_needed > self.pool.num_free_blocks - num_cached_free:
            return False
        if tail is not None:
            self.pool.touch([tail])
            self._pinned.append(tail)
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
        offered = [i for i in range(start, end) if held[i].block_hash is None]
        for i in offered:
            self.pool.cache(held[i], hashes[i])
        self._num_published[request.request_id] = end
        if offered and self.on_blocks_cached is not None:
            self._report_cached(self.on_blocks_cached, request, hashes, offered)

    def _report_cached(self, report: BlocksCached, request: Request, hashes: list[int], offered: list[int]) -> None:
        """Tell ``report`` about the blocks ``offered`` (ascending indexes): one call per consecutive run."""
        runs: list[list[int]] = []
        for i in offered:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        bs = self.block_size
        for run in runs:
            first, end = run[0], run[-1] + 1
            parent, salt = (hashes[first - 1], None) if first else (None, request.params.cache_salt)
            report(parent, hashes[first:end], request.all_token_ids[first * bs : end * bs], salt)

    def cache_prompt_tail(self, request: Request) -> None:
        """Once its prompt is computed, offer the request's partial last prompt block as a tail (see pool)."""
        rid = request.request_id
        num_prompt = request.num_prompt_tokens
        if not self.pool.enable_caching or rid in self._tail_published or request.num_computed_tokens < num_prompt:
            return
        self._tail_published.add(rid)
        last, num_tail = divmod(num_prompt, self.block_size)
        held = self._blocks.get(rid, [])
        if num_tail < 2 or last >= len(held):  # one token is recomputed anyway; nothing to gain
            return
        hashes = request.update_block_hashes(self.block_size)
        parent = hashes[last - 1] if last else request.root_hash
        tokens = request.all_token_ids[last * self.block_size : num_prompt]
        self.pool.cache_tail(held[last], hash_block(parent, tokens))

    def release_pins(self) -> None:
        """Drop the references ``allocate`` took on tail sources; call once the step that copied them ran."""
        self.pool.free(self._pinned)
        self._pinned = []

    def free(self, request: Request) -> None:
        """Release every block the request holds (tail first)."""
        blocks = self._blocks.pop(request.request_id, [])
        self._num_published.pop(request.request_id, None)
        self._tail_published.discard(request.request_id)
        self.pool.free(reversed(blocks))

    @property
    def usage(self) -> float:
        return self.pool.usage

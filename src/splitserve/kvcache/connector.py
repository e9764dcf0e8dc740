"""The engine <-> TieredStore connector: load stored chunks on admission, save completed chunks after each step.

A chunk is ``chunk_size`` tokens (a multiple of the block size) at a chunk-aligned position of a request, named
by ``keys.cache_key(model_id, layout, hash of its last block)``; its record holds the KV of all its tokens
across all layers, ``[layers, 2, chunk_size, kv_heads, head_dim]`` (``serde``). Loads are contiguous from the
end of the engine's own prefix-cache match and never include the request's last token; a record that fails to
decode or has another layout is a miss (discarded, counted), and the engine recomputes from there. Saves go
through ``TieredStore.put``: L1 at once, L2 from the store's writer thread (a full queue drops, never blocks).

What is saved: the prompt's full chunks, unless ``save_prompt`` is off (the decode role: its prompt KV came
from a prefill worker, which saved it), plus the chunks of generated tokens when ``save_decode`` is on.
Chunks the request got from a cache at admission are not saved again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch

from splitserve.config import KVTierConfig, L2Backend, Role, redact_url
from splitserve.engine.connector import LoadedTokens
from splitserve.engine.request import Request
from splitserve.keys import cache_key, kv_layout
from splitserve.kvcache import serde
from splitserve.kvcache.cpu import CPUTier
from splitserve.kvcache.disk import DiskTier
from splitserve.kvcache.redis import RedisTier
from splitserve.kvcache.store import PrefixHit, TieredStore
from splitserve.kvcache.tiers import KVTier, NullTier, TierStats

logger = logging.getLogger(__name__)

L1_SOURCE = "l1"
L2_SOURCE = "l2"


@dataclass(slots=True)
class KVCacheStats:
    """Counters of the KV cache layer since start, plus a copy of each tier's (by tier name)."""

    num_lookup_tokens: int = 0  # tokens of admitted requests that the engine's prefix cache did not hold
    num_lookup_hits: int = 0  # of those, tokens the L1/L2 lookup found
    num_hit_tokens: int = 0  # tokens actually loaded into the engine's KV cache (L1 + L2)
    num_hit_tokens_l1: int = 0
    num_hit_tokens_l2: int = 0
    num_invalid_records: int = 0  # records that failed to decode (or L2 validation): recomputed, discarded
    num_saved_chunks: int = 0  # chunks handed to the store
    num_queue_drops: int = 0  # L2 writes dropped because the store's queue was full
    tiers: dict[str, TierStats] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Lookup:
    """The answer to one admission-time lookup, kept until the request is admitted (load) or ends."""

    num_cached: int  # the engine's match the lookup started from
    first_chunk: int  # index of the first chunk looked up
    hit: PrefixHit  # leading chunks held from ``first_chunk`` on
    num_external: int  # tokens after ``num_cached`` that can be loaded


class KVConnector:
    """Implements ``splitserve.engine.connector.KVConnectorBase`` over a ``TieredStore``.

    Args:
        store: the tiers; the connector owns it (``close`` closes it).
        model_id: ``ModelSource.model_id``, the model part of every key.
        layout: the engine's ``keys.kv_layout``; ``register_kv_cache`` checks the cache against it.
        chunk_size: tokens per chunk, a multiple of the engine's block size.
        save_prompt / save_decode: what ``save_completed_chunks`` stores (see the module docstring).
    """

    def __init__(
        self,
        store: TieredStore,
        model_id: str,
        layout: str,
        *,
        chunk_size: int = 256,
        save_prompt: bool = True,
        save_decode: bool = False,
    ) -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.store = store
        self.model_id = model_id
        self.layout = layout
        self.chunk_size = chunk_size
        self.save_prompt = save_prompt or save_decode
        self.save_decode = save_decode
        self._kv_cache: torch.Tensor | None = None  # [layers, 2, slots, kv_heads, head_dim]
        self._block_size = 0
        self._chunk_shape: tuple[int, ...] = ()
        self._lookups: dict[str, _Lookup] = {}
        self._num_saved_chunks: dict[str, int] = {}  # leading chunks of a request that are stored or cached
        self._stats = KVCacheStats()

    def register_kv_cache(self, kv_cache: torch.Tensor, block_size: int) -> None:
        num_layers, _, _, num_heads, head_dim = kv_cache.shape
        dtype = str(kv_cache.dtype).removeprefix("torch.")
        actual = kv_layout(dtype, num_layers, num_heads, head_dim, block_size)
        if actual != self.layout:
            raise ValueError(
                f"the engine's KV cache has layout {actual!r}, the connector was built for {self.layout!r}"
            )
        if self.chunk_size % block_size:
            raise ValueError(f"chunk size {self.chunk_size} is not a multiple of the block size {block_size}")
        self._kv_cache = kv_cache
        self._block_size = block_size
        self._chunk_shape = (num_layers, 2, self.chunk_size, num_heads, head_dim)

    # -- admission ----------------------------------------------------------------------------------------

    def num_external_tokens(self, request: Request, num_cached: int) -> int:
        lookup = self._lookups.get(request.request_id)
        if lookup is None or lookup.num_cached != num_cached:
            lookup = self._lookup(request, num_cached)
            self._lookups[request.request_id] = lookup
        return lookup.num_external

    def _lookup(self, request: Request, num_cached: int) -> _Lookup:
        first = num_cached // self.chunk_size
        max_chunks = (request.num_tokens - 1) // self.chunk_size  # never the last token
        if first >= max_chunks or self._kv_cache is None:
            return _Lookup(num_cached, first, PrefixHit(0, 0), 0)
        hit = self.store.lookup(self._chunk_keys(request, first, max_chunks))
        num_external = (first + hit.num_in_l1_or_l2) * self.chunk_size - num_cached
        return _Lookup(num_cached, first, hit, max(0, num_external))

    def load(self, request: Request, block_ids: list[int], start_token: int, end_token: int) -> LoadedTokens:
        lookup = self._lookups.pop(request.request_id, None)
        stats = self._stats
        stats.num_lookup_tokens += request.num_tokens - start_token
        stats.num_lookup_hits += lookup.num_external if lookup is not None else 0
        num_loaded = 0
        if end_token > start_token and lookup is not None and lookup.num_cached == start_token:
            num_loaded = self._load_chunks(request, block_ids, start_token, end_token)
        self._num_saved_chunks[request.request_id] = (start_token + num_loaded) // self.chunk_size
        if num_loaded == 0 or lookup is None:
            return LoadedTokens()
        return self._count_loaded(lookup, start_token, num_loaded)

    def _load_chunks(self, request: Request, block_ids: list[int], start_token: int, end_token: int) -> int:
        """Copy the chunks covering ``[start_token, end_token)`` into the blocks; returns the tokens loaded."""
        first, end = start_token // self.chunk_size, end_token // self.chunk_size
        keys = self._chunk_keys(request, first, end)
        num_loaded = 0
        for i, value in enumerate(self.store.get_prefix(keys)):
            chunk_start = (first + i) * self.chunk_size
            try:
                kv = serde.decode(value, self.layout, self._chunk_shape)  # [layers, 2, chunk, heads, dim]
            except serde.RecordError as exc:
                logger.warning("KV connector: %s is a miss, recomputing from token %d: %s", keys[i], chunk_start, exc)
                self._stats.num_invalid_records += 1
                self.store.discard(keys[i])
                break
            lo = max(start_token, chunk_start)  # the engine may already hold the chunk's head
            self._write_slots(block_ids, lo, chunk_start + self.chunk_size, kv[:, :, lo - chunk_start :])
            num_loaded = chunk_start + self.chunk_size - start_token
        return num_loaded

    def _count_loaded(self, lookup: _Lookup, start_token: int, num_loaded: int) -> LoadedTokens:
        """Split the loaded run by tier: chunks the lookup found in L1 first, the rest from L2."""
        l1_end = min((lookup.first_chunk + lookup.hit.num_in_l1) * self.chunk_size, start_token + num_loaded)
        from_l1 = max(0, l1_end - start_token)
        from_l2 = num_loaded - from_l1
        stats = self._stats
        stats.num_hit_tokens += num_loaded
        stats.num_hit_tokens_l1 += from_l1
        stats.num_hit_tokens_l2 += from_l2
        by_source = tuple((name, n) for name, n in ((L1_SOURCE, from_l1), (L2_SOURCE, from_l2)) if n > 0)
        return LoadedTokens(num_loaded, by_source)

    # -- saving -------------------------------------------------------------------------------------------

    def save_completed_chunks(self, request: Request, block_ids: list[int]) -> None:
        if not self.save_prompt or self._kv_cache is None:
            return
        limit = request.num_computed_tokens
        if not self.save_decode:
            limit = min(limit, request.num_prompt_tokens)
        num_chunks = limit // self.chunk_size
        start = self._num_saved_chunks.get(request.request_id, 0)
        if num_chunks <= start:
            return
        keys = self._chunk_keys(request, start, num_chunks)
        for i, key in enumerate(keys, start):
            kv = self._read_slots(block_ids, i * self.chunk_size, (i + 1) * self.chunk_size)
            self.store.put(key, serde.encode(kv, self.chunk_size, self.layout))
        self._stats.num_saved_chunks += len(keys)
        self._num_saved_chunks[request.request_id] = num_chunks

    def request_finished(self, request: Request) -> None:
        self._lookups.pop(request.request_id, None)
        self._num_saved_chunks.pop(request.request_id, None)

    # -- stats and life cycle -----------------------------------------------------------------------------

    def stats(self) -> KVCacheStats:
        store = self.store.stats()
        stats = replace(self._stats, tiers={})
        stats.num_invalid_records += store.num_invalid_records
        stats.num_queue_drops = store.num_l2_writes_dropped
        if store.l1 is not None and not isinstance(self.store.l1, NullTier):
            stats.tiers[self.store.l1.name] = store.l1
        if store.l2 is not None and self.store.l2 is not None:
            stats.tiers[self.store.l2.name] = store.l2
        return stats

    def close(self) -> None:
        self.store.close(timeout_s=5.0)

    # -- internals ----------------------------------------------------------------------------------------

    def _chunk_keys(self, request: Request, first: int, end: int) -> list[str]:
        """Keys of chunks ``first .. end-1`` of the request (all of whose blocks are full)."""
        hashes = request.update_block_hashes(self._block_size)
        per_chunk = self.chunk_size // self._block_size
        return [cache_key(self.model_id, self.layout, hashes[(i + 1) * per_chunk - 1]) for i in range(first, end)]

    def _slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        """KV slots of token positions ``[start, end)``, on the cache's device."""
        assert self._kv_cache is not None
        bs = self._block_size
        positions = range(start, end)
        return torch.tensor([block_ids[p // bs] * bs + p % bs for p in positions], device=self._kv_cache.device)

    def _read_slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        assert self._kv_cache is not None
        return self._kv_cache.index_select(2, self._slots(block_ids, start, end))  # [layers, 2, T, heads, dim]

    def _write_slots(self, block_ids: list[int], start: int, end: int, kv: torch.Tensor) -> None:
        assert self._kv_cache is not None
        with torch.no_grad():
            self._kv_cache.index_copy_(2, self._slots(block_ids, start, end), kv.to(self._kv_cache.device))


def build_connector(config: KVTierConfig, model_id: str, layout: str, role: Role = Role.COLOCATED) -> KVConnector:
    """The connector and tiers ``config`` asks for; logs the outcome (degraded mode when Redis is down)."""
    l1: KVTier = CPUTier(config.l1_cache_bytes) if config.l1_cache else NullTier()
    l2 = _build_l2(config)
    store = TieredStore(l1, l2, validate=lambda value: serde.verify(value, layout))
    connector = KVConnector(
        store,
        model_id,
        layout,
        chunk_size=config.kv_chunk_size,
        save_prompt=role != Role.DECODE,
        save_decode=config.save_decode_cache,
    )
    _log_startup(config, l2, layout)
    return connector


def _build_l2(config: KVTierConfig) -> KVTier | None:
    if config.l2_backend == L2Backend.REDIS:
        assert config.l2_url is not None  # validated
        return RedisTier(config.l2_url)
    if config.l2_backend == L2Backend.TIEREDSTORAGE:
        assert config.l2_path is not None  # validated
        return DiskTier(config.l2_path, config.l2_max_bytes)
    return None


def _log_startup(config: KVTierConfig, l2: KVTier | None, layout: str) -> None:
    l1_text = f"L1 cpu {config.l1_cache_bytes / 2**30:.2f} GiB" if config.l1_cache else "L1 off"
    if isinstance(l2, RedisTier):
        l2_text = f"L2 redis {redact_url(config.l2_url)}"
        if not l2.ping():
            logger.error(
                "LMCacheManager: L2 Redis at %s is unreachable; the KV cache will operate in degraded mode "
                "(recompute) and reconnect with back-off. %s, chunk %d tokens, layout %s",
                redact_url(config.l2_url), l1_text, config.kv_chunk_size, layout,
            )  # fmt: skip
            return
    elif isinstance(l2, DiskTier):
        l2_text = f"L2 tieredstorage {l2.path} {config.l2_max_bytes / 2**30:.2f} GiB"
    else:
        l2_text = "L2 off"
    logger.info(
        "LMCacheManager initialized successfully: %s, %s, chunk %d tokens, layout %s, save_decode_cache %s",
        l1_text, l2_text, config.kv_chunk_size, layout, config.save_decode_cache,
    )  # fmt: skip

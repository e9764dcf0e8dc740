"""The engine <-> TieredStore connector: load stored chunks into admitted requests, save completed chunks.

A record holds the KV of a run of whole blocks that starts at a chunk boundary (``chunk_size`` tokens, a
multiple of the block size) and ends at most at the next one: ``[layers, 2, num_tokens, kv_heads, head_dim]``
(``serde``). It is named by ``keys.cache_key(model_id, layout, hash of its last block)``, so a key alone says
which tokens its record covers: those from the chunk boundary at or before its last block to the end of that
block. Whole chunks are the common record; the *tail* of a prompt (its full blocks past the last whole chunk)
is saved as one shorter record, as LMCache's ``save_unfull_chunk`` does, so another worker recomputes fewer
than ``block_size`` tokens of a prompt it never saw.

Loads are contiguous from the end of the engine's own prefix-cache match: whole chunks first, then, in the
chunk where they stop, the longest shorter record (tried from the request's last full block downwards: its
own tail, or that of an earlier prompt it extends). They never include the request's last token, so a record
holding it is loaded only up to it. A record that fails to decode or has another layout is a miss (discarded,
counted), and the engine recomputes from there. Saves go through ``TieredStore.put``: L1 at once, L2 from the
store's writer thread (a full queue drops, never blocks).

The connector offers only records it has already read and decoded, so the copy cannot come up short. With an
L2 tier, nothing of this touches L2 on the engine thread. The first time the scheduler asks about a request
(``num_external_tokens``), the connector computes the request's record keys there (hashing only) and hands
them to a prefetch thread. That thread looks the records up, reads them and decodes them. Until it is done the
answer is None, and the scheduler admits the requests behind it meanwhile. The answer then counts the run of
records that decoded. At admission (``update_state_after_alloc``) the connector sets those aside for the
request, and the model runner's ``load_kv`` copies them into its blocks before the forward pass. A slow or
stalled L2 delays only the requests that wait for it, never a decode step. With L1 alone everything is in
memory: the records are read and decoded at once, on the engine thread.

What is saved: the prompt's whole chunks and, once the prompt is computed, its tail, unless ``save_prompt``
is off (the decode role: its prompt KV came from a prefill worker, which saved it), plus the whole chunks of
generated tokens when ``save_decode`` is on. Records the request got from a cache at admission are not saved
again.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from splitserve.config import KVTierConfig, L2Backend, Role, redact_url
from splitserve.engine.connector import KVLoad, LoadedTokens, token_slots
from splitserve.engine.request import Request
from splitserve.keys import cache_key, hash_of_key, kv_layout
from splitserve.kvcache import serde
from splitserve.kvcache.cpu import CPUTier
from splitserve.kvcache.disk import DiskTier
from splitserve.kvcache.redis import RedisTier, connect
from splitserve.kvcache.store import TieredStore
from splitserve.kvcache.tiers import KVTier, KVValue, NullTier, TierStats
from splitserve.metrics import LMCACHE_HIT_RATE_BUCKETS, LMCACHE_RETRIEVE_SPEED_BUCKETS, CumulativeHistogram
from splitserve.model import kv_format
from splitserve.protocol.kv_events import KVEventSink, Tier

logger = logging.getLogger(__name__)

L1_SOURCE = "l1"
L2_SOURCE = "l2"


@dataclass(slots=True)
class KVCacheStats:
    """Counters of the KV cache layer since start, plus a copy of each tier's (by tier name).

    In LMCache's terms (its ``lmcache:`` metrics): each admission *looks up* the tokens past the engine's prefix
    cache, a *retrieve* loads what was found into the engine's KV cache, a *store* hands one record to the tiers.
    A preempted request's readmission looks up again.
    """

    num_lookup_requests: int = 0  # admissions
    num_lookup_tokens: int = 0  # tokens of admitted requests that the engine's prefix cache did not hold
    num_lookup_hits: int = 0  # of those, tokens the L1/L2 lookup found
    num_lookup_0_hit_requests: int = 0  # lookups that found nothing
    num_retrieve_requests: int = 0  # admissions that loaded (or tried to load) tokens
    num_requested_tokens: int = 0  # tokens those asked for
    num_hit_tokens: int = 0  # tokens actually loaded into the engine's KV cache (L1 + L2)
    num_hit_tokens_l1: int = 0
    num_hit_tokens_l2: int = 0
    num_vllm_hit_tokens: int = 0  # tokens the engine's own prefix cache held, of the requests looked up
    num_prompt_tokens: int = 0  # prompt tokens of the requests looked up
    num_invalid_records: int = 0  # records that failed to decode (or L2 validation): recomputed, discarded
    num_saved_chunks: int = 0  # records (whole chunks and prompt tails) handed to the store
    num_stored_tokens: int = 0  # tokens those records hold
    num_queue_drops: int = 0  # L2 writes dropped because the store's queue was full
    retrieve_speed: CumulativeHistogram = field(default_factory=lambda: _histogram(LMCACHE_RETRIEVE_SPEED_BUCKETS))
    lookup_hit_rate: CumulativeHistogram = field(default_factory=lambda: _histogram(LMCACHE_HIT_RATE_BUCKETS))
    l2_tier: str | None = None  # the L2 tier's name, if there is one
    tiers: dict[str, TierStats] = field(default_factory=dict)


def _histogram(edges: tuple[float, ...]) -> CumulativeHistogram:
    return CumulativeHistogram(tuple(map(float, edges)))


@dataclass(frozen=True, slots=True)
class _Record:
    """One stored record of a request: its key and the token positions ``[start, end)`` it covers."""

    key: str
    start: int  # a chunk boundary
    end: int  # a block boundary, at most the next chunk boundary


@dataclass(frozen=True, slots=True)
class _Lookup:
    """The answer to one admission-time lookup, kept until the request is admitted (then loaded) or ends."""

    num_cached: int  # the engine's match the lookup started from
    records: tuple[_Record, ...]  # held in L1 or L2, contiguous from the chunk holding token ``num_cached``
    num_in_l1: int  # of those, the leading ones held in L1
    num_external: int  # tokens after ``num_cached`` that can be loaded
    kvs: tuple[torch.Tensor, ...] = ()  # fetched: the records' decoded KV, one per record (none: not read yet)
    num_invalid: int = 0  # fetched: records that failed to decode (counted when the lookup is used)


@dataclass(frozen=True, slots=True)
class _Plan:
    """What a prefetch needs, computed on the engine thread: every record a request could load."""

    num_cached: int
    num_tokens: int
    first_chunk: int  # the chunk holding token ``num_cached``
    by_last_block: dict[int, _Record]  # the record ending with each full block from ``first_chunk`` on


class KVConnector:
    """Implements ``splitserve.engine.connector.KVConnectorBase`` over a ``TieredStore``.

    Args:
        store: the tiers; the connector owns it (``close`` closes it).
        model_id: ``ModelSource.model_id``, the model part of every key.
        layout: the engine's ``keys.kv_layout``; ``register_kv_cache`` checks the cache against it.
        chunk_size: tokens per chunk, a multiple of the engine's block size.
        save_prompt / save_decode: what ``save_completed_chunks`` stores (see the module docstring).
        signer: signs the records saved (default: no cluster secret); the store's L2 validator should be its
            ``verify``.
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
        signer: serde.RecordSigner | None = None,
    ) -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.store = store
        self.model_id = model_id
        self.layout = layout
        self.signer = signer or serde.RecordSigner.for_secret(None, model_id, layout)
        self.chunk_size = chunk_size
        self.save_prompt = save_prompt or save_decode
        self.save_decode = save_decode
        self._kv_cache: torch.Tensor | None = None  # [layers, 2, slots, kv_heads, head_dim]
        self._block_size = 0
        self._lookups: dict[str, _Lookup] = {}  # answered, not yet admitted
        self._loads: dict[str, _Lookup] = {}  # admitted with tokens to load: for load_kv in the same step
        self._prefetches: dict[str, tuple[int, Future[_Lookup]]] = {}  # request id -> (num_cached, the fetch)
        self._prefetcher = (
            ThreadPoolExecutor(1, thread_name_prefix="kvcache-prefetch") if store.l2 is not None else None
        )
        self._num_saved_tokens: dict[str, int] = {}  # leading tokens of a request that are stored or cached
        self._stats = KVCacheStats()

    def register_kv_cache(self, kv_cache: torch.Tensor, block_size: int) -> None:
        num_layers, _, _, num_heads, head_dim = kv_cache.shape
        actual = kv_layout(kv_format.layout_name(kv_cache.dtype), num_layers, num_heads, head_dim, block_size)
        if actual != self.layout:
            raise ValueError(
                f"the engine's KV cache has layout {actual!r}, the connector was built for {self.layout!r}"
            )
        if self.chunk_size % block_size:
            raise ValueError(f"chunk size {self.chunk_size} is not a multiple of the block size {block_size}")
        self._kv_cache = kv_cache
        self._block_size = block_size

    # -- admission ----------------------------------------------------------------------------------------

    def num_external_tokens(self, request: Request, num_cached: int) -> int | None:
        rid = request.request_id
        lookup = self._lookups.get(rid)
        if lookup is not None and lookup.num_cached == num_cached:
            return lookup.num_external
        pending = self._prefetches.get(rid)
        if pending is not None and pending[0] == num_cached:  # asked again while the engine waits: no hashing
            if not pending[1].done():
                return None
            del self._prefetches[rid]
            try:
                self._lookups[rid] = pending[1].result()
            except Exception:  # a bug or an unexpected tier error: a miss, never a dead engine
                logger.exception("KV connector: prefetching %s failed; computing it instead", rid)
                self._lookups[rid] = _Lookup(num_cached, (), 0, 0)
            return self._lookups[rid].num_external
        plan = self._plan(request, num_cached)
        if self._prefetcher is None or not plan.by_last_block:  # L1 only, or nothing to look for: at once
            self._lookups[rid] = self._fetch(plan)
            return self._lookups[rid].num_external
        self._prefetches[rid] = (num_cached, self._prefetcher.submit(self._fetch, plan))
        return None

    def _plan(self, request: Request, num_cached: int) -> _Plan:
        """Every record the request could load past ``num_cached`` (the keys are hashes of the request)."""
        first = num_cached // self.chunk_size
        if self._kv_cache is None or num_cached >= request.num_tokens - 1:
            return _Plan(num_cached, request.num_tokens, first, {})
        per_chunk = self.chunk_size // self._block_size
        blocks = range(first * per_chunk, request.num_tokens // self._block_size)
        return _Plan(num_cached, request.num_tokens, first, {j: self._record(request, j) for j in blocks})

    def _lookup(self, plan: _Plan) -> _Lookup:
        """Whole chunks held from the one holding ``num_cached`` on, then the longest shorter record after them.

        The shorter record is the prompt's own tail, or that of an earlier prompt this one extends (a
        follow-up turn), whose chunk was never stored whole. Reads no values.
        """
        num_cached = plan.num_cached
        if not plan.by_last_block:
            return _Lookup(num_cached, (), 0, 0)
        per_chunk = self.chunk_size // self._block_size
        num_full_blocks = plan.num_tokens // self._block_size
        chunk_ends = range((plan.first_chunk + 1) * per_chunk - 1, num_full_blocks, per_chunk)
        chunks = [plan.by_last_block[j] for j in chunk_ends]
        hit = self.store.lookup([r.key for r in chunks])
        records, num_in_l1 = chunks[: hit.num_in_l1_or_l2], hit.num_in_l1
        tail = self._find_tail(plan, plan.first_chunk + len(records))  # where the whole chunks stop
        if tail is not None:
            record, is_in_l1 = tail
            if is_in_l1 and num_in_l1 == len(records):
                num_in_l1 += 1
            records.append(record)
        if not records:
            return _Lookup(num_cached, (), 0, 0)
        num_external = min(records[-1].end, plan.num_tokens - 1) - num_cached
        return _Lookup(num_cached, tuple(records), num_in_l1, max(0, num_external))

    def _find_tail(self, plan: _Plan, chunk: int) -> tuple[_Record, bool] | None:
        """The longest shorter record in chunk ``chunk`` that reaches past ``num_cached``, and whether in L1.

        Candidates end at the request's full blocks inside the chunk (not its last block: that is a whole
        chunk), longest first, so a record covering the request's final token is loaded only up to it.
        """
        per_chunk = self.chunk_size // self._block_size
        last = min(plan.num_tokens // self._block_size, (chunk + 1) * per_chunk - 1) - 1
        lowest = max(chunk * per_chunk, plan.num_cached // self._block_size)
        candidates = [plan.by_last_block[j] for j in range(last, lowest - 1, -1)]
        found = self.store.first_held([r.key for r in candidates]) if candidates else None
        if found is None:
            return None
        index, is_in_l1 = found
        return candidates[index], is_in_l1

    def _fetch(self, plan: _Plan) -> _Lookup:
        """Look the records up, read and decode them (the prefetch thread; with L1 alone, the engine thread);
        the run that decoded is the answer."""
        lookup = self._lookup(plan)
        kvs: list[torch.Tensor] = []
        values = self.store.get_prefix([r.key for r in lookup.records]) if lookup.records else []
        for record, value in zip(lookup.records, values, strict=False):
            kv = self._decode(record, value)
            if kv is None:
                break
            kvs.append(kv)
        records = lookup.records[: len(kvs)]
        num_invalid = int(len(kvs) < len(values))
        if not records:
            return _Lookup(plan.num_cached, (), 0, 0, (), num_invalid)
        num_external = max(0, min(records[-1].end, plan.num_tokens - 1) - plan.num_cached)
        num_in_l1 = min(lookup.num_in_l1, len(records))
        return _Lookup(plan.num_cached, records, num_in_l1, num_external, tuple(kvs), num_invalid)

    def _decode(self, record: _Record, value: KVValue) -> torch.Tensor | None:
        """A record's KV, or None (discarded, to be recomputed) when it does not decode."""
        try:
            # L2 values passed the store's MAC and identity check; the xxh3 (~20 GB/s) also guards L1's memory
            return serde.decode(value, self.layout, self._record_shape(record.end - record.start), self._kv_dtype())
        except serde.RecordError as exc:
            logger.warning("KV connector: %s is a miss, recomputing from token %d: %s", record.key, record.start, exc)
            self.store.discard(record.key)
            return None

    def lookup_tokens(self, request: Request, num_cached: int) -> tuple[tuple[str, int], ...]:
        lookup = self._lookup(self._plan(request, num_cached))
        from_l1, from_l2 = self._split_by_tier(lookup, num_cached, lookup.num_external)
        return ((L1_SOURCE, from_l1), (L2_SOURCE, from_l2))

    def update_state_after_alloc(self, request: Request, num_cached: int, num_external: int) -> None:
        """Count the admission's lookup (LMCache's), and set aside the decoded records ``load_kv`` will copy."""
        rid = request.request_id
        lookup = self._lookups.pop(rid, None)
        self._count_lookup(request, num_cached, lookup.num_external if lookup is not None else 0)
        self._stats.num_invalid_records += lookup.num_invalid if lookup is not None else 0
        if num_external > 0 and lookup is not None and lookup.num_cached == num_cached:
            self._loads[rid] = lookup
        self._num_saved_tokens[rid] = max(num_cached, self._num_saved_tokens.get(rid, 0))  # kept over preemption

    def load_kv(self, load: KVLoad) -> LoadedTokens:
        rid = load.request.request_id
        lookup = self._loads.pop(rid, None)
        if lookup is None:
            return LoadedTokens()
        began = time.perf_counter()
        num_loaded, saved_end = self._load_records(lookup, load.block_ids, load.start_token, load.end_token)
        self._count_retrieve(load.num_tokens, num_loaded, time.perf_counter() - began)
        self._num_saved_tokens[rid] = max(saved_end, self._num_saved_tokens.get(rid, 0))
        if num_loaded == 0:
            return LoadedTokens()
        return self._count_loaded(lookup, load.start_token, num_loaded)

    def _load_records(self, lookup: _Lookup, block_ids: list[int], start_token: int, end_token: int) -> tuple[int, int]:
        """Copy the fetched records' KV of ``[start_token, end_token)`` into the blocks.

        Returns the tokens loaded from ``start_token`` and the end of the last record loaded (the request's
        tokens known to be stored).
        """
        num_loaded, saved_end = 0, start_token
        for record, kv in zip(lookup.records, lookup.kvs, strict=False):
            lo, hi = max(start_token, record.start), min(end_token, record.end)  # the engine may hold the head
            try:
                self._write_slots(block_ids, lo, hi, kv[:, :, lo - record.start : hi - record.start])
            except RuntimeError as exc:  # a record that does not fit the cache is a miss, never a dead engine
                logger.warning("KV connector: %s does not fit the KV cache, recomputing: %s", record.key, exc)
                self.store.discard(record.key)
                self._stats.num_invalid_records += 1
                break
            num_loaded, saved_end = hi - start_token, record.end
            if hi == end_token:
                break
        return num_loaded, saved_end

    def _count_lookup(self, request: Request, num_cached: int, num_found: int) -> None:
        """One admission's lookup of the tokens past the engine's ``num_cached``."""
        stats = self._stats
        num_tokens = request.num_tokens - num_cached
        stats.num_lookup_requests += 1
        stats.num_lookup_tokens += num_tokens
        stats.num_lookup_hits += num_found
        stats.num_vllm_hit_tokens += num_cached
        stats.num_prompt_tokens += request.num_prompt_tokens
        if num_found == 0:
            stats.num_lookup_0_hit_requests += 1
        elif num_tokens > 0:  # LMCache's per-lookup hit rate leaves out lookups without a hit
            stats.lookup_hit_rate.observe(num_found / num_tokens)

    def _count_retrieve(self, num_requested: int, num_loaded: int, elapsed_s: float) -> None:
        """One load into the engine: LMCache's retrieve. Its speed counts the copy by the model runner (the read
        and decode happened before, on the prefetch thread with an L2)."""
        stats = self._stats
        stats.num_retrieve_requests += 1
        stats.num_requested_tokens += num_requested
        if num_loaded > 0 and elapsed_s > 0:
            stats.retrieve_speed.observe(num_loaded / elapsed_s)

    @staticmethod
    def _split_by_tier(lookup: _Lookup, start_token: int, num_tokens: int) -> tuple[int, int]:
        """Split a run of ``num_tokens`` from ``start_token`` by tier: the lookup's L1 records first, then L2."""
        l1_end = lookup.records[lookup.num_in_l1 - 1].end if lookup.num_in_l1 else start_token
        from_l1 = max(0, min(l1_end, start_token + num_tokens) - start_token)
        return from_l1, num_tokens - from_l1

    def _count_loaded(self, lookup: _Lookup, start_token: int, num_loaded: int) -> LoadedTokens:
        """Count the loaded run by tier."""
        from_l1, from_l2 = self._split_by_tier(lookup, start_token, num_loaded)
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
        records = self._records_to_save(request, self._num_saved_tokens.get(request.request_id, 0))
        for record in records:
            kv = self._read_slots(block_ids, record.start, record.end)
            self.store.put(record.key, self.signer.encode(kv, record.end - record.start, record.key))
        if records:
            self._stats.num_saved_chunks += len(records)
            self._stats.num_stored_tokens += sum(r.end - r.start for r in records)
            self._num_saved_tokens[request.request_id] = records[-1].end

    def _records_to_save(self, request: Request, num_saved: int) -> list[_Record]:
        """The whole chunks computed past ``num_saved`` tokens, then the prompt's tail once it is computed."""
        limit = request.num_computed_tokens
        if not self.save_decode:
            limit = min(limit, request.num_prompt_tokens)
        per_chunk = self.chunk_size // self._block_size
        num_chunks = limit // self.chunk_size
        records = [
            self._record(request, (i + 1) * per_chunk - 1) for i in range(num_saved // self.chunk_size, num_chunks)
        ]
        tail_end = request.num_prompt_tokens // self._block_size * self._block_size
        if (
            request.num_computed_tokens >= request.num_prompt_tokens
            and tail_end % self.chunk_size
            and tail_end > max(num_saved, num_chunks * self.chunk_size)
        ):
            records.append(self._record(request, tail_end // self._block_size - 1))
        return records

    def take_transfer_result(self, request_id: str) -> None:
        return None

    def request_finished(self, request: Request) -> None:
        self._lookups.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        self._prefetches.pop(request.request_id, None)  # a running fetch finishes into nothing
        self._num_saved_tokens.pop(request.request_id, None)

    # -- stats and life cycle -----------------------------------------------------------------------------

    def stats(self) -> KVCacheStats:
        store = self.store.stats()
        own = self._stats
        stats = replace(own, retrieve_speed=own.retrieve_speed.copy(), lookup_hit_rate=own.lookup_hit_rate.copy(),
                        tiers={})  # fmt: skip
        stats.num_invalid_records += store.num_invalid_records
        stats.num_queue_drops = store.num_l2_writes_dropped
        if store.l1 is not None and not isinstance(self.store.l1, NullTier):
            stats.tiers[self.store.l1.name] = store.l1
        if store.l2 is not None and self.store.l2 is not None:
            stats.tiers[self.store.l2.name] = store.l2
            stats.l2_tier = self.store.l2.name
        return stats

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=False, cancel_futures=True)
        self.store.close(timeout_s=5.0)

    # -- internals ----------------------------------------------------------------------------------------

    def _record(self, request: Request, last_block: int) -> _Record:
        """The record ending with the request's full block ``last_block``, from the chunk boundary before it."""
        hashes = request.update_block_hashes(self._block_size)
        end = (last_block + 1) * self._block_size
        start = last_block * self._block_size // self.chunk_size * self.chunk_size
        return _Record(cache_key(self.model_id, self.layout, hashes[last_block]), start, end)

    def _kv_dtype(self) -> torch.dtype:
        assert self._kv_cache is not None
        return self._kv_cache.dtype

    def _record_shape(self, num_tokens: int) -> tuple[int, ...]:
        """``[layers, 2, num_tokens, kv_heads, head_dim]`` of a record in the engine's layout."""
        assert self._kv_cache is not None
        num_layers, _, _, num_heads, head_dim = self._kv_cache.shape
        return (num_layers, 2, num_tokens, num_heads, head_dim)

    def _slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        """KV slots of token positions ``[start, end)``, on the cache's device."""
        assert self._kv_cache is not None
        slots = token_slots(block_ids, range(start, end), self._block_size)
        return torch.tensor(slots, device=self._kv_cache.device)

    def _read_slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        assert self._kv_cache is not None
        return self._kv_cache.index_select(2, self._slots(block_ids, start, end))  # [layers, 2, T, heads, dim]

    def _write_slots(self, block_ids: list[int], start: int, end: int, kv: torch.Tensor) -> None:
        assert self._kv_cache is not None
        with torch.no_grad():
            self._kv_cache.index_copy_(2, self._slots(block_ids, start, end), kv.to(self._kv_cache.device))


def build_connector(
    config: KVTierConfig,
    model_id: str,
    layout: str,
    role: Role = Role.COLOCATED,
    events: KVEventSink | None = None,
    cluster_secret: str | None = None,
) -> KVConnector:
    """The connector and tiers ``config`` asks for; logs the outcome (degraded mode when Redis is down).

    ``events`` hears what L1 stores and evicts and what reached L2. ``cluster_secret`` keys the records' MACs:
    a shared tier's record is served only if it was signed with the same secret (``serde.RecordSigner``).
    """
    on_evict = None if events is None else lambda key: events.removed(Tier.L1, (hash_of_key(key),))
    l1: KVTier = CPUTier(config.l1_cache_bytes, on_evict) if config.l1_cache else NullTier()
    l2 = build_l2(config)
    signer = serde.RecordSigner.for_secret(cluster_secret, model_id, layout)
    store = TieredStore(l1, l2, validate=signer.verify, events=events)
    connector = KVConnector(
        store,
        model_id,
        layout,
        chunk_size=config.kv_chunk_size,
        save_prompt=role != Role.DECODE,
        save_decode=config.save_decode_cache,
        signer=signer,
    )
    _log_startup(config, l2, layout)
    return connector


def build_l2(config: KVTierConfig) -> KVTier | None:
    """The L2 tier the config names (a Redis or a directory; not yet reached), or None."""
    if config.l2_backend == L2Backend.REDIS:
        assert config.l2_url is not None  # validated
        client = connect(config.l2_url, username=config.l2_username, password=config.l2_password)
        return RedisTier(client, key_prefix=config.l2_key_prefix, owns_client=True)
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
        if not l2.is_available:
            logger.error(
                "LMCacheManager: L2 tieredstorage at %s is unavailable; the KV cache will operate in degraded mode "
                "(recompute) and retry the directory on writes. %s, chunk %d tokens, layout %s",
                l2.path, l1_text, config.kv_chunk_size, layout,
            )  # fmt: skip
            return
    else:
        l2_text = "L2 off"
    logger.info(
        "LMCacheManager initialized successfully: %s, %s, chunk %d tokens, layout %s, save_decode_cache %s",
        l1_text, l2_text, config.kv_chunk_size, layout, config.save_decode_cache,
    )  # fmt: skip

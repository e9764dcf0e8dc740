"""What the worker's metrics read: the engine's stats snapshots (as Protocols), the finished-request record the
async engine hands over, and a histogram that components without a registry keep themselves."""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client.utils import floatToGoString

from splitserve.policy.admission import Backlog


@dataclass(slots=True)
class CumulativeHistogram:
    """Observations per bucket since start, for a component that owns no registry (the engine thread, a KV
    connector): it observes, publishes ``copy()`` in its stats snapshot, and the worker's collector renders it.

    ``edges`` are the buckets' upper bounds (inclusive, as Prometheus' ``le``); ``counts`` has one count per
    edge plus one for +Inf, not cumulative.
    """

    edges: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.edges) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.edges, value)] += 1
        self.total += value

    def copy(self) -> CumulativeHistogram:
        return CumulativeHistogram(self.edges, list(self.counts), self.total)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative ``(le, count)`` pairs, +Inf last, as ``HistogramMetricFamily.add_metric`` takes them."""
        running, out = 0, []
        for edge, num in zip((*self.edges, float("inf")), self.counts, strict=True):
            running += num
            out.append((floatToGoString(edge), float(running)))
        return out


@dataclass(frozen=True, slots=True)
class RequestPhases:
    """The engine-side phases of a finished request in seconds, on the engine's clock, as vLLM's: queued (added
    to the scheduler until first scheduled), prefill (until the first token), decode (first to last token). A
    preemption's wait stays inside the phase it interrupted."""

    queued_s: float
    prefill_s: float
    decode_s: float
    num_preemptions: int

    @property
    def inference_s(self) -> float:
        """First scheduled to last token (vLLM's RUNNING phase)."""
        return self.prefill_s + self.decode_s


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """One request the engine finished (stop or length), as the async engine hands it to the metrics.

    ``e2e_s`` runs on the event loop's clock, from the request's arrival to its last output.
    """

    finish_reason: str
    e2e_s: float
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int  # prompt tokens not computed: the engine's prefix cache and what was loaded
    max_tokens: int
    phases: RequestPhases | None  # None: the engine did not time it (a test engine)


class HistogramLike(Protocol):
    @property
    def edges(self) -> tuple[float, ...]: ...

    @property
    def total(self) -> float: ...

    def buckets(self) -> list[tuple[str, float]]: ...


class TierStatsLike(Protocol):
    """The fields of ``splitserve.kvcache.tiers.TierStats`` that the metrics read."""

    @property
    def num_hits(self) -> int: ...
    @property
    def num_misses(self) -> int: ...
    @property
    def num_errors(self) -> int: ...
    @property
    def stored_bytes(self) -> int | None: ...  # None: the tier does not know (Redis)


class KVCacheStatsLike(Protocol):
    """The fields of ``splitserve.kvcache.connector.KVCacheStats`` that the metrics read (all cumulative).

    A *lookup* asks the tiers, at a request's admission, which tokens past the engine's prefix cache they hold;
    a *retrieve* loads those into the engine's KV cache; a *store* hands one record to the tiers (LMCache's
    terms, ``lmcache/observability.py``).
    """

    @property
    def num_lookup_requests(self) -> int: ...
    @property
    def num_lookup_tokens(self) -> int: ...  # tokens looked up (the engine's prefix cache lacked them)
    @property
    def num_lookup_hits(self) -> int: ...  # of those, tokens found
    @property
    def num_lookup_0_hit_requests(self) -> int: ...
    @property
    def num_retrieve_requests(self) -> int: ...
    @property
    def num_requested_tokens(self) -> int: ...  # tokens retrieves asked for
    @property
    def num_hit_tokens(self) -> int: ...  # tokens loaded from L1/L2 into the engine
    @property
    def num_saved_chunks(self) -> int: ...  # store requests: records handed to the tiers
    @property
    def num_stored_tokens(self) -> int: ...
    @property
    def num_vllm_hit_tokens(self) -> int: ...  # the engine's own prefix-cache tokens of the requests looked up
    @property
    def num_prompt_tokens(self) -> int: ...  # prompt tokens of the requests looked up
    @property
    def num_invalid_records(self) -> int: ...
    @property
    def num_queue_drops(self) -> int: ...
    @property
    def retrieve_speed(self) -> HistogramLike: ...  # tokens per second of each retrieve
    @property
    def lookup_hit_rate(self) -> HistogramLike: ...  # hits / tokens of each lookup that found something
    @property
    def l2_tier(self) -> str | None: ...  # the L2 tier's name (redis, disk), None without one
    @property
    def tiers(self) -> Mapping[str, TierStatsLike]: ...  # by tier name (cpu, redis, disk)


class PDBufferStatsLike(Protocol):
    """The fields of ``splitserve.pd.buffer.BufferStats`` that the metrics read."""

    capacity_bytes: int
    used_bytes: int
    num_refused: int  # reservations refused for lack of room (the sender retries)
    num_expired: int


class SpecDecodeStatsLike(Protocol):
    """``splitserve.engine.speculative.SpecStats``: cumulative counts of speculative decoding."""

    num_drafts: int  # verification steps that carried drafts
    num_draft_tokens: int
    num_accepted_tokens: int

    @property
    def accepted_per_position(self) -> Sequence[int]: ...  # kept drafts by position in their run


class EngineStatsLike(Protocol):
    """The fields of ``splitserve.engine.engine.EngineStats`` that the metrics mirror (counters cumulative)."""

    num_running: int
    num_waiting: int
    num_waiting_deferred: int  # of those, passed over by the last admission: their KV was still being fetched
    kv_cache_usage: float  # 0..1
    prefix_cache_queries: int  # tokens, at first admission
    prefix_cache_hits: int
    external_prefix_cache_queries: int  # tokens past the engine's match, asked of the KV connector
    external_prefix_cache_hits: int  # tokens it loaded
    num_preemptions: int

    @property
    def cached_tokens_by_source(self) -> Mapping[str, int]: ...  # engine, l1, l2, pd: tokens not computed

    @property
    def iteration_tokens(self) -> HistogramLike: ...  # tokens computed per engine step

    @property
    def kv_cache(self) -> KVCacheStatsLike | None: ...  # None: no KV cache layer

    @property
    def pd_buffer(self) -> PDBufferStatsLike | None: ...  # None: not a decode worker

    @property
    def exactness_checks(self) -> Mapping[str, int]: ...  # --verify-sample-rate's shadow checks, by path

    @property
    def exactness_mismatches(self) -> Mapping[str, int]: ...  # those whose tokens differed, by path

    @property
    def spec_decode(self) -> SpecDecodeStatsLike | None: ...  # None: no --speculative-config

    @property
    def backlog(self) -> Backlog: ...  # what a new request finds ahead of it (policy.admission)

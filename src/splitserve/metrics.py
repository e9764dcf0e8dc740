"""Every Prometheus metric the worker exposes, and its name, in one place.

Names follow vLLM's (``vllm:*``) so existing dashboards work unchanged. Each :class:`WorkerMetrics` owns its
own ``CollectorRegistry``, so several apps can live in one process (tests). Request-level metrics (latencies,
token counters, finish reasons) are observed by the async engine as outputs arrive; the gauges and counters
that mirror the engine's own state are read on scrape from the latest stats snapshot the engine thread
published (the engine itself is never touched from the scraping thread).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

# Names exactly as exposed. prometheus_client appends ``_total`` to a Counter's name itself, so Counter
# objects are created with the name minus that suffix (see ``_counter_base``).
NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE_PERC = "vllm:kv_cache_usage_perc"
PREFIX_CACHE_HITS_TOTAL = "vllm:prefix_cache_hits_total"
PREFIX_CACHE_QUERIES_TOTAL = "vllm:prefix_cache_queries_total"
NUM_PREEMPTIONS_TOTAL = "vllm:num_preemptions_total"
TIME_TO_FIRST_TOKEN_SECONDS = "vllm:time_to_first_token_seconds"
INTER_TOKEN_LATENCY_SECONDS = "vllm:inter_token_latency_seconds"
E2E_REQUEST_LATENCY_SECONDS = "vllm:e2e_request_latency_seconds"
REQUEST_QUEUE_TIME_SECONDS = "vllm:request_queue_time_seconds"
PROMPT_TOKENS_TOTAL = "vllm:prompt_tokens_total"
GENERATION_TOKENS_TOTAL = "vllm:generation_tokens_total"
REQUEST_SUCCESS_TOTAL = "vllm:request_success_total"

# The KV cache layer (L1/L2 tiers), with LMCache's names for the dashboards that use them.
LMCACHE_NUM_LOOKUP_TOKENS_TOTAL = "lmcache:num_lookup_tokens_total"
LMCACHE_NUM_LOOKUP_HITS_TOTAL = "lmcache:num_lookup_hits_total"
LMCACHE_NUM_VLLM_HIT_TOKENS_TOTAL = "lmcache:num_vllm_hit_tokens_total"
LMCACHE_REQUEST_CACHE_HIT_RATE = "lmcache:request_cache_hit_rate"
CPU_INFO = "splitserve:cpu_info"
KV_TIER_HITS_TOTAL = "splitserve:kv_tier_hits_total"
KV_TIER_MISSES_TOTAL = "splitserve:kv_tier_misses_total"
KV_TIER_ERRORS_TOTAL = "splitserve:kv_tier_errors_total"
KV_TIER_BYTES_STORED = "splitserve:kv_tier_bytes_stored"
KV_STORE_QUEUE_DROPS_TOTAL = "splitserve:kv_store_queue_drops_total"
KV_INVALID_RECORDS_TOTAL = "splitserve:kv_invalid_records_total"
PD_BUFFER_BYTES_IN_USE = "splitserve:pd_buffer_bytes_in_use"
PD_BUFFER_CAPACITY_BYTES = "splitserve:pd_buffer_capacity_bytes"
PD_BUFFER_ALLOCATION_RETRIES_TOTAL = "splitserve:pd_buffer_allocation_retries_total"
PD_BUFFER_EXPIRED_TOTAL = "splitserve:pd_buffer_expired_total"

MODEL_NAME_LABEL = "model_name"
FINISHED_REASON_LABEL = "finished_reason"
TIER_LABEL = "tier"

# Bucket edges in seconds, as vLLM's (cut where a CPU worker never lands).
TTFT_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS_S = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS_S = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)
HIT_RATE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


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
    """The fields of ``splitserve.kvcache.connector.KVCacheStats`` that the metrics read (all cumulative)."""

    @property
    def num_lookup_tokens(self) -> int: ...  # tokens looked up in L1/L2 (the engine's prefix cache lacked them)
    @property
    def num_lookup_hits(self) -> int: ...  # of those, tokens found
    @property
    def num_hit_tokens(self) -> int: ...  # tokens loaded from L1/L2 into the engine
    @property
    def num_invalid_records(self) -> int: ...
    @property
    def num_queue_drops(self) -> int: ...
    @property
    def tiers(self) -> Mapping[str, TierStatsLike]: ...  # by tier name (cpu, redis, disk)


class PDBufferStatsLike(Protocol):
    """The fields of ``splitserve.pd.buffer.BufferStats`` that the metrics read."""

    capacity_bytes: int
    used_bytes: int
    num_refused: int  # reservations refused for lack of room (the sender retries)
    num_expired: int


class EngineStatsLike(Protocol):
    """The fields of ``splitserve.engine.engine.EngineStats`` that the metrics mirror."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1
    prefix_cache_queries: int  # cumulative tokens
    prefix_cache_hits: int  # cumulative tokens
    num_preemptions: int  # cumulative

    @property
    def kv_cache(self) -> KVCacheStatsLike | None: ...  # None: no KV cache layer

    @property
    def pd_buffer(self) -> PDBufferStatsLike | None: ...  # None: not a decode worker


def _counter_base(name: str) -> str:
    """The name to give ``prometheus_client.Counter`` so that it exposes ``name`` (which ends in _total)."""
    assert name.endswith("_total"), name
    return name.removesuffix("_total")


class _CpuInfoCollector(Collector):
    """``splitserve:cpu_info``: always 1, labelled with the CPU and the kernel path the engine runs."""

    def __init__(self, get_info: Callable[[], Mapping[str, str]]) -> None:
        self._get_info = get_info

    def collect(self) -> Iterator[Metric]:
        info = dict(self._get_info())
        gauge = GaugeMetricFamily(CPU_INFO, "The CPU and the kernel path the engine runs on it.", labels=list(info))
        gauge.add_metric(list(info.values()), 1.0)
        yield gauge


class _EngineStatsCollector(Collector):
    """Reads the latest engine stats snapshot on each scrape; nothing is exposed before the first one."""

    def __init__(self, model_name: str, get_stats: Callable[[], EngineStatsLike | None]) -> None:
        self._model_name = model_name
        self._get_stats = get_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._get_stats()
        if stats is None:
            return
        gauges = (
            (NUM_REQUESTS_RUNNING, "Number of requests in model execution batches.", stats.num_running),
            (NUM_REQUESTS_WAITING, "Number of requests waiting to be processed.", stats.num_waiting),
            (KV_CACHE_USAGE_PERC, "KV-cache usage. 1 means 100 percent usage.", stats.kv_cache_usage),
        )
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=[MODEL_NAME_LABEL])
            gauge.add_metric([self._model_name], float(value))
            yield gauge
        counters: list[tuple[str, str, float]] = [
            (PREFIX_CACHE_QUERIES_TOTAL, "Prefix cache queries, in tokens.", stats.prefix_cache_queries),
            (PREFIX_CACHE_HITS_TOTAL, "Prefix cache hits, in tokens.", stats.prefix_cache_hits),
            (
                NUM_PREEMPTIONS_TOTAL,
                "Cumulative number of preemptions from the engine.",
                stats.num_preemptions,
            ),
        ]
        kv = stats.kv_cache
        lookups, lookup_hits, hits = (kv.num_lookup_tokens, kv.num_lookup_hits, kv.num_hit_tokens) if kv else (0, 0, 0)
        counters += [
            (LMCACHE_NUM_LOOKUP_TOKENS_TOTAL, "Tokens looked up in the KV cache tiers.", lookups),
            (LMCACHE_NUM_LOOKUP_HITS_TOTAL, "Looked-up tokens found in the KV cache tiers.", lookup_hits),
            (LMCACHE_NUM_VLLM_HIT_TOKENS_TOTAL, "Tokens loaded from the KV cache tiers into the engine.", hits),
        ]
        if kv is not None:
            counters += [
                (KV_STORE_QUEUE_DROPS_TOTAL, "L2 writes dropped because the write queue was full.", kv.num_queue_drops),
                (KV_INVALID_RECORDS_TOTAL, "KV records rejected (corrupt or foreign layout).", kv.num_invalid_records),
            ]  # fmt: skip
        for name, doc, value in counters:
            counter = CounterMetricFamily(_counter_base(name), doc, labels=[MODEL_NAME_LABEL])
            counter.add_metric([self._model_name], float(value))
            yield counter
        if kv is not None:
            yield from self._tier_metrics(kv.tiers)
        if stats.pd_buffer is not None:
            yield from self._pd_buffer_metrics(stats.pd_buffer)

    def _pd_buffer_metrics(self, buffer: PDBufferStatsLike) -> Iterator[Metric]:
        for name, doc, value in (
            (PD_BUFFER_BYTES_IN_USE, "Bytes of the PD buffer reserved or holding pushed KV.", buffer.used_bytes),
            (PD_BUFFER_CAPACITY_BYTES, "Size of the PD buffer in bytes.", buffer.capacity_bytes),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=[MODEL_NAME_LABEL])
            gauge.add_metric([self._model_name], float(value))
            yield gauge
        for name, doc, value in (
            (PD_BUFFER_ALLOCATION_RETRIES_TOTAL, "KV pushes refused for lack of room (retried).", buffer.num_refused),
            (PD_BUFFER_EXPIRED_TOTAL, "Reservations or pushed KV never claimed, freed.", buffer.num_expired),
        ):
            counter = CounterMetricFamily(_counter_base(name), doc, labels=[MODEL_NAME_LABEL])
            counter.add_metric([self._model_name], float(value))
            yield counter

    def _tier_metrics(self, tiers: Mapping[str, TierStatsLike]) -> Iterator[Metric]:
        labels = [MODEL_NAME_LABEL, TIER_LABEL]
        for name, doc, field in (
            (KV_TIER_HITS_TOTAL, "KV chunk reads served by the tier.", "num_hits"),
            (KV_TIER_MISSES_TOTAL, "KV chunk reads the tier did not hold.", "num_misses"),
            (KV_TIER_ERRORS_TOTAL, "KV tier I/O errors.", "num_errors"),
        ):
            counter = CounterMetricFamily(_counter_base(name), doc, labels=labels)
            for tier, tier_stats in tiers.items():
                counter.add_metric([self._model_name, tier], float(getattr(tier_stats, field)))
            yield counter
        gauge = GaugeMetricFamily(KV_TIER_BYTES_STORED, "Bytes of KV records held by the tier.", labels=labels)
        for tier, tier_stats in tiers.items():
            if tier_stats.stored_bytes is not None:
                gauge.add_metric([self._model_name, tier], float(tier_stats.stored_bytes))
        yield gauge


class WorkerMetrics:
    """The worker's metrics, bound to one model name and one registry.

    ``observe_*`` methods are called from the event loop thread; ``render()`` may be called from any thread.
    """

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        cpu_info: Callable[[], Mapping[str, str]] | None = None,
    ) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self._stats: EngineStatsLike | None = None
        if cpu_info is not None:
            self.registry.register(_CpuInfoCollector(cpu_info))
        self.ttft_s = self._histogram(
            TIME_TO_FIRST_TOKEN_SECONDS, "Histogram of time to first token in seconds.", TTFT_BUCKETS_S
        )
        self.itl_s = self._histogram(
            INTER_TOKEN_LATENCY_SECONDS, "Histogram of inter-token latency in seconds.", ITL_BUCKETS_S
        )
        self.e2e_s = self._histogram(
            E2E_REQUEST_LATENCY_SECONDS,
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS_S,
        )
        self.queue_time_s = self._histogram(
            REQUEST_QUEUE_TIME_SECONDS,
            "Histogram of time from arrival until the engine took the request, in seconds.",
            REQUEST_LATENCY_BUCKETS_S,
        )
        self.request_cache_hit_rate = self._histogram(
            LMCACHE_REQUEST_CACHE_HIT_RATE,
            "Fraction of each request's prompt served from a KV cache (the engine's or the tiers').",
            HIT_RATE_BUCKETS,
        )
        self.prompt_tokens = self._counter(PROMPT_TOKENS_TOTAL, "Number of prefill tokens processed.")
        self.generation_tokens = self._counter(GENERATION_TOKENS_TOTAL, "Number of generation tokens processed.")
        self._request_success = Counter(
            _counter_base(REQUEST_SUCCESS_TOTAL),
            "Count of successfully processed requests.",
            [MODEL_NAME_LABEL, FINISHED_REASON_LABEL],
            registry=self.registry,
        )
        self.registry.register(_EngineStatsCollector(model_name, lambda: self._stats))

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        family = Histogram(name, doc, [MODEL_NAME_LABEL], buckets=buckets, registry=self.registry)
        return family.labels(self.model_name)

    def _counter(self, name: str, doc: str) -> Counter:
        family = Counter(_counter_base(name), doc, [MODEL_NAME_LABEL], registry=self.registry)
        return family.labels(self.model_name)

    def set_engine_stats(self, stats: EngineStatsLike) -> None:
        """Publish the engine's latest stats (an immutable snapshot; called from the engine thread)."""
        self._stats = stats

    def observe_finished(self, finish_reason: str) -> None:
        self._request_success.labels(self.model_name, finish_reason).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric in this registry."""
        return generate_latest(self.registry)


# ---- the router ------------------------------------------------------------------------------------------

ROUTER_REQUESTS_TOTAL = "splitserve:router_requests_total"
ROUTER_REQUESTS_IN_FLIGHT = "splitserve:router_requests_in_flight"
ROUTER_ROUTING_DECISIONS_TOTAL = "splitserve:router_routing_decisions_total"
ROUTER_RETRIES_TOTAL = "splitserve:router_retries_total"
ROUTER_STREAM_MIGRATIONS_TOTAL = "splitserve:router_stream_migrations_total"
ROUTER_CIRCUIT_BREAKER_STATE = "splitserve:router_circuit_breaker_state"
ROUTER_WORKER_HEALTHY = "splitserve:router_worker_healthy"
ROUTER_INDEX_ENTRIES = "splitserve:router_index_entries"
ROUTER_INDEX_HIT_TOKENS_TOTAL = "splitserve:router_index_hit_tokens_total"
ROUTER_TTFT_SECONDS = "splitserve:e2e_time_to_first_token_seconds"
ROUTER_ITL_SECONDS = "splitserve:router_inter_token_latency_seconds"
ROUTER_E2E_SECONDS = "splitserve:router_e2e_request_latency_seconds"
ROUTER_PD_DECISIONS_TOTAL = "splitserve:router_pd_decisions_total"
PREFILL_TIME_SECONDS = "splitserve:prefill_time_seconds"
KV_TRANSFER_TIME_SECONDS = "splitserve:kv_transfer_time_seconds"
KV_TRANSFER_BYTES_TOTAL = "splitserve:kv_transfer_bytes_total"
KV_TRANSFER_FAILURES_TOTAL = "splitserve:kv_transfer_failures_total"

WORKER_LABEL = "worker"
STRATEGY_LABEL = "strategy"
OUTCOME_LABEL = "outcome"


class RouterStateLike(Protocol):
    """What the router's scrape-time collector reads (``splitserve.router.app.Router``)."""

    def worker_states(self) -> list[tuple[str, int, int, bool]]: ...  # (url, in flight, breaker state, healthy)

    def index_sizes(self) -> dict[str, int]: ...  # entries per index


class _RouterStateCollector(Collector):
    def __init__(self, get_state: Callable[[], RouterStateLike | None]) -> None:
        self._get_state = get_state

    def collect(self) -> Iterator[Metric]:
        state = self._get_state()
        if state is None:
            return
        workers = state.worker_states()
        for name, doc, column in (
            (ROUTER_REQUESTS_IN_FLIGHT, "Requests the router has in flight to each worker.", 1),
            (ROUTER_CIRCUIT_BREAKER_STATE, "Circuit breaker per worker: 0 closed, 1 open, 2 half-open.", 2),
            (ROUTER_WORKER_HEALTHY, "1 when the worker passes its health checks.", 3),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=[WORKER_LABEL])
            for row in workers:
                gauge.add_metric([row[0]], float(row[column]))
            yield gauge
        gauge = GaugeMetricFamily(ROUTER_INDEX_ENTRIES, "Entries in the router's KV/prefix index.", labels=["index"])
        for index, size in state.index_sizes().items():
            gauge.add_metric([index], float(size))
        yield gauge


class RouterMetrics:
    """The router's metrics on their own registry; ``observe_*`` from the event loop, ``render()`` anywhere."""

    def __init__(self, strategy: str, registry: CollectorRegistry | None = None) -> None:
        self.strategy = strategy
        self.registry = registry if registry is not None else CollectorRegistry()
        self._state: RouterStateLike | None = None
        self.requests = Counter(
            _counter_base(ROUTER_REQUESTS_TOTAL), "Requests answered, by worker and status.",
            [WORKER_LABEL, "status"], registry=self.registry,
        )  # fmt: skip
        self.decisions = Counter(
            _counter_base(ROUTER_ROUTING_DECISIONS_TOTAL), "Routing decisions by strategy and outcome.",
            [STRATEGY_LABEL, OUTCOME_LABEL], registry=self.registry,
        )  # fmt: skip
        self.retries = Counter(
            _counter_base(ROUTER_RETRIES_TOTAL), "Requests sent again to another worker, by reason.",
            ["reason"], registry=self.registry,
        )  # fmt: skip
        self.migrations = Counter(
            _counter_base(ROUTER_STREAM_MIGRATIONS_TOTAL),
            "Streams whose worker failed mid-answer, by outcome: resumed on another worker, or ended with an error.",
            [OUTCOME_LABEL], registry=self.registry,
        )  # fmt: skip
        self.index_hit_tokens = Counter(
            _counter_base(ROUTER_INDEX_HIT_TOKENS_TOTAL), "Prompt tokens the index found on the chosen worker.",
            [STRATEGY_LABEL], registry=self.registry,
        ).labels(strategy)  # fmt: skip
        self.ttft_s = Histogram(
            ROUTER_TTFT_SECONDS, "Time to first token seen by the router, in seconds.", buckets=TTFT_BUCKETS_S,
            registry=self.registry,
        )  # fmt: skip
        self.itl_s = Histogram(
            ROUTER_ITL_SECONDS, "Time between streamed chunks seen by the router, in seconds.", buckets=ITL_BUCKETS_S,
            registry=self.registry,
        )  # fmt: skip
        self.e2e_s = Histogram(
            ROUTER_E2E_SECONDS, "Request latency seen by the router, in seconds.", buckets=REQUEST_LATENCY_BUCKETS_S,
            registry=self.registry,
        )  # fmt: skip
        self.pd_decisions = Counter(
            _counter_base(ROUTER_PD_DECISIONS_TOTAL), "Disaggregated endpoints: requests by path.",
            ["path"], registry=self.registry,
        )  # fmt: skip
        self.prefill_s = Histogram(
            PREFILL_TIME_SECONDS, "Prefill requests (prompt, first token and KV push), seen by the router.",
            buckets=REQUEST_LATENCY_BUCKETS_S, registry=self.registry,
        )  # fmt: skip
        self.transfer_s = Histogram(
            KV_TRANSFER_TIME_SECONDS, "KV pushes from prefill to decode workers, as the prefill worker timed them.",
            buckets=TTFT_BUCKETS_S, registry=self.registry,
        )  # fmt: skip
        self.transfer_bytes = Counter(
            _counter_base(KV_TRANSFER_BYTES_TOTAL), "Bytes of KV pushed from prefill to decode workers.",
            registry=self.registry,
        )  # fmt: skip
        self.transfer_failures = Counter(
            _counter_base(KV_TRANSFER_FAILURES_TOTAL), "KV pushes that failed (decode recomputed).",
            registry=self.registry,
        )  # fmt: skip
        self.registry.register(_RouterStateCollector(lambda: self._state))

    def pd_path(self, path: str) -> None:
        self.pd_decisions.labels(path).inc()

    def observe_transfer(self, report: Mapping[str, object]) -> None:
        """Count one prefill worker's ``kv_transfer_params`` report."""
        if not report.get("ok"):
            self.transfer_failures.inc()
            return
        elapsed_ms, num_bytes = report.get("transfer_ms"), report.get("num_bytes")
        if isinstance(elapsed_ms, int | float):
            self.transfer_s.observe(elapsed_ms / 1000)
        if isinstance(num_bytes, int):
            self.transfer_bytes.inc(num_bytes)

    def bind(self, state: RouterStateLike) -> None:
        self._state = state

    def decision(self, outcome: str) -> None:
        self.decisions.labels(self.strategy, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def sum_samples(text: str, name: str, **labels: str) -> float:
    """The sum of every sample named exactly ``name`` whose labels include ``labels``, in a Prometheus text page.

    ``name`` is the sample's full name: ``..._total`` for a counter, ``..._sum`` or ``..._count`` of a histogram.
    Every reader of ``/metrics`` (supervisor, benchmarks) goes through here, never through substring matches.
    """
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )

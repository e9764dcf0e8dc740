"""The worker's metrics: every ``vllm:`` family vLLM 0.32 exposes on a CPU, LMCache's, and splitserve's own.

Each :class:`WorkerMetrics` owns its ``CollectorRegistry``, so several apps can live in one process (tests).
Per-request families (latencies, token counts, finish reasons) are observed by the async engine as outputs
arrive; families that mirror the engine's state (queues, cache counters, tokens per step) are read on scrape
from the latest stats snapshot the engine thread published, so the scraping thread never touches the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from splitserve.metrics import names as n
from splitserve.metrics.stats import (
    CumulativeHistogram,
    EngineStatsLike,
    FinishedRequest,
    HistogramLike,
    KVCacheStatsLike,
    SpecDecodeStatsLike,
)

# where the engine's cached tokens came from (Request.cached_tokens_by_source) -> vLLM's CacheHitSource
_HIT_SOURCES = {"engine": "device", "l1": "host", "pd": "p2p"}
_L2_HIT_SOURCES = {"disk": "disk"}  # the L2 tier's name -> its source; Redis is vLLM's remote "external_unspecified"
_UNSPECIFIED_SOURCE = "external_unspecified"
_ENGINE_SOURCE = "engine"

_MM_QUERIES_DOC = "Multi-modal cache queries, in terms of number of queried items."
_MM_HITS_DOC = "Multi-modal cache hits, in terms of number of cached items."
_WAITING_BY_REASON_DOC = (
    "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
    "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). "
    "Sum of all reasons equals vllm:num_requests_waiting."
)
_EXTERNAL_QUERIES_DOC = (
    "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of "
    "queried tokens."
)
_EXTERNAL_HITS_DOC = (
    "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens."
)
_CACHED_BY_SOURCE_DOC = (
    "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host (offloaded to DRAM), "
    "disk, p2p (transferred from another vLLM instance) or external_unspecified. Counted at admission; sums to "
    "vllm:prefix_cache_hits + vllm:external_prefix_cache_hits."
)
_SLEEP_STATE_DOC = (
    "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
    "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2."
)
_FLOPS_DOCS = (
    (n.ESTIMATED_FLOPS_PER_GPU_TOTAL, "Estimated number of floating point operations per GPU (for Model Flops "
     "Utilization calculations)."),
    (n.ESTIMATED_READ_BYTES_PER_GPU_TOTAL, "Estimated number of bytes read from memory per GPU (for Model Flops "
     "Utilization calculations)."),
    (n.ESTIMATED_WRITE_BYTES_PER_GPU_TOTAL, "Estimated number of bytes written to memory per GPU (for Model "
     "Flops Utilization calculations)."),
)  # fmt: skip


def hit_source(source: str, l2_tier: str | None) -> str:
    """vLLM's ``CacheHitSource`` of tokens a splitserve source (engine, l1, l2, pd) supplied."""
    if source == "l2":
        return _L2_HIT_SOURCES.get(l2_tier or "", _UNSPECIFIED_SOURCE)
    return _HIT_SOURCES.get(source, _UNSPECIFIED_SOURCE)


class _CpuInfoCollector(Collector):
    """``splitserve:cpu_info``: always 1, labelled with the CPU and the kernel path the engine runs."""

    def __init__(self, get_info: Callable[[], Mapping[str, str]]) -> None:
        self._get_info = get_info

    def collect(self) -> Iterator[Metric]:
        info = dict(self._get_info())
        gauge = GaugeMetricFamily(n.CPU_INFO, "The CPU and the kernel path the engine runs on it.", labels=list(info))
        gauge.add_metric(list(info.values()), 1.0)
        yield gauge


class _EngineStatsCollector(Collector):
    """Reads the latest engine stats snapshot on each scrape; nothing is exposed before the first one."""

    def __init__(self, model_name: str, get_stats: Callable[[], EngineStatsLike | None]) -> None:
        self._model_name = model_name
        self._labels = [model_name, n.ENGINE_INDEX]
        self._get_stats = get_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._get_stats()
        if stats is None:
            return
        yield from self._scheduler_gauges(stats)
        yield from self._cache_counters(stats)
        yield _histogram(n.ITERATION_TOKENS_TOTAL, "Histogram of number of tokens per engine_step.",
                         list(n.VLLM_LABELS), self._labels, stats.iteration_tokens)  # fmt: skip
        kv = stats.kv_cache
        yield from _lmcache_metrics(self._model_name, kv)
        if kv is not None:
            yield from _tier_metrics(self._model_name, kv)
        if stats.pd_buffer is not None:
            yield from self._pd_buffer_metrics(stats)
        yield from self._exactness_counters(stats)
        if stats.spec_decode is not None:
            yield from self._spec_decode_counters(stats.spec_decode)

    def _spec_decode_counters(self, spec: SpecDecodeStatsLike) -> Iterator[Metric]:
        """vLLM's speculative decoding counters: acceptance rate = accepted / draft tokens."""
        labels = list(n.VLLM_LABELS)
        for name, doc, value in (
            (n.SPEC_DECODE_NUM_DRAFTS_TOTAL, "Number of spec decoding drafts.", spec.num_drafts),
            (n.SPEC_DECODE_NUM_DRAFT_TOKENS_TOTAL, "Number of draft tokens.", spec.num_draft_tokens),
            (n.SPEC_DECODE_NUM_ACCEPTED_TOKENS_TOTAL, "Number of accepted tokens.", spec.num_accepted_tokens),
        ):
            yield _counter(name, doc, labels, [(self._labels, value)])
        per_position = [([*self._labels, str(pos)], value) for pos, value in enumerate(spec.accepted_per_position)]
        yield _counter(n.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_TOTAL, "Accepted tokens per draft position.",
                       [*labels, n.POSITION_LABEL], per_position)  # fmt: skip

    def _exactness_counters(self, stats: EngineStatsLike) -> Iterator[Metric]:
        """--verify-sample-rate's checks and mismatches, every path listed (zero until one happens)."""
        labels = [n.MODEL_NAME_LABEL, n.PATH_LABEL]
        for name, doc, counts in (
            (n.EXACTNESS_CHECKS_TOTAL, "Requests that reused KV, recomputed cold and compared token by token.",
             stats.exactness_checks),
            (n.EXACTNESS_MISMATCHES_TOTAL, "Of those, requests whose tokens differed from the cold recompute.",
             stats.exactness_mismatches),
        ):  # fmt: skip
            yield _counter(name, doc, labels, [([self._model_name, p], counts.get(p, 0)) for p in n.EXACTNESS_PATHS])

    def _scheduler_gauges(self, stats: EngineStatsLike) -> Iterator[Metric]:
        for name, doc, value in (
            (n.NUM_REQUESTS_RUNNING, "Number of requests in model execution batches.", stats.num_running),
            (n.NUM_REQUESTS_WAITING, "Number of requests waiting to be processed.", stats.num_waiting),
            (n.KV_CACHE_USAGE_PERC, "KV-cache usage. 1 means 100 percent usage.", stats.kv_cache_usage),
        ):
            yield _gauge(name, doc, list(n.VLLM_LABELS), [(self._labels, value)])
        deferred = min(stats.num_waiting_deferred, stats.num_waiting)  # an abort may leave the last count stale
        by_reason = [([*self._labels, n.WAITING_CAPACITY], stats.num_waiting - deferred),
                     ([*self._labels, n.WAITING_DEFERRED], deferred)]  # fmt: skip
        yield _gauge(n.NUM_REQUESTS_WAITING_BY_REASON, _WAITING_BY_REASON_DOC, [*n.VLLM_LABELS, n.REASON_LABEL],
                     by_reason)  # fmt: skip

    def _cache_counters(self, stats: EngineStatsLike) -> Iterator[Metric]:
        labels = list(n.VLLM_LABELS)
        for name, doc, value in (
            (n.PREFIX_CACHE_QUERIES_TOTAL, "Prefix cache queries, in terms of number of queried tokens.",
             stats.prefix_cache_queries),
            (n.PREFIX_CACHE_HITS_TOTAL, "Prefix cache hits, in terms of number of cached tokens.",
             stats.prefix_cache_hits),
            (n.EXTERNAL_PREFIX_CACHE_QUERIES_TOTAL, _EXTERNAL_QUERIES_DOC, stats.external_prefix_cache_queries),
            (n.EXTERNAL_PREFIX_CACHE_HITS_TOTAL, _EXTERNAL_HITS_DOC, stats.external_prefix_cache_hits),
            (n.NUM_PREEMPTIONS_TOTAL, "Cumulative number of preemption from the engine.", stats.num_preemptions),
        ):  # fmt: skip
            yield _counter(name, doc, labels, [(self._labels, value)])
        l2_tier = stats.kv_cache.l2_tier if stats.kv_cache is not None else None
        by_source = dict.fromkeys(n.CACHE_HIT_SOURCES, 0)
        for source, num_tokens in stats.cached_tokens_by_source.items():
            by_source[hit_source(source, l2_tier)] += num_tokens
        yield _counter(n.PROMPT_TOKENS_CACHED_BY_SOURCE_TOTAL, _CACHED_BY_SOURCE_DOC, [*labels, n.SOURCE_LABEL],
                       [([*self._labels, source], value) for source, value in by_source.items()])  # fmt: skip

    def _pd_buffer_metrics(self, stats: EngineStatsLike) -> Iterator[Metric]:
        buffer, labels, values = stats.pd_buffer, [n.MODEL_NAME_LABEL], [self._model_name]
        assert buffer is not None
        yield _gauge(n.PD_BUFFER_BYTES_IN_USE, "Bytes of the PD buffer reserved or holding pushed KV.", labels,
                     [(values, buffer.used_bytes)])  # fmt: skip
        yield _gauge(n.PD_BUFFER_CAPACITY_BYTES, "Size of the PD buffer in bytes.", labels,
                     [(values, buffer.capacity_bytes)])  # fmt: skip
        yield _counter(n.PD_BUFFER_ALLOCATION_RETRIES_TOTAL, "KV pushes refused for lack of room (retried).",
                       labels, [(values, buffer.num_refused)])  # fmt: skip
        yield _counter(n.PD_BUFFER_EXPIRED_TOTAL, "Reservations or pushed KV never claimed, freed.", labels,
                       [(values, buffer.num_expired)])  # fmt: skip


def _lmcache_metrics(model_name: str, kv: KVCacheStatsLike | None) -> Iterator[Metric]:
    """LMCache's families; without a KV cache layer they exist, zero and empty, so that its dashboards find them."""
    counters = (
        (n.LMCACHE_NUM_LOOKUP_REQUESTS_TOTAL, "Total number of lookup requests sent to lmcache",
         "num_lookup_requests"),
        (n.LMCACHE_NUM_LOOKUP_TOKENS_TOTAL, "Total number of tokens requested in lookup from lmcache",
         "num_lookup_tokens"),
        (n.LMCACHE_NUM_LOOKUP_HITS_TOTAL, "Total number of tokens hit in lookup from lmcache", "num_lookup_hits"),
        (n.LMCACHE_LOOKUP_0_HIT_REQUESTS_TOTAL, "Total number of 0 hit lookup requests",
         "num_lookup_0_hit_requests"),
        (n.LMCACHE_NUM_RETRIEVE_REQUESTS_TOTAL, "Total number of retrieve requests sent to lmcache",
         "num_retrieve_requests"),
        (n.LMCACHE_NUM_REQUESTED_TOKENS_TOTAL, "Total number of tokens requested from lmcache",
         "num_requested_tokens"),
        (n.LMCACHE_NUM_HIT_TOKENS_TOTAL, "Total number of tokens hit in lmcache", "num_hit_tokens"),
        (n.LMCACHE_NUM_STORE_REQUESTS_TOTAL, "Total number of store requests sent to lmcache", "num_saved_chunks"),
        (n.LMCACHE_NUM_STORED_TOKENS_TOTAL, "Total number of tokens stored in lmcache including evicted ones",
         "num_stored_tokens"),
        (n.LMCACHE_NUM_VLLM_HIT_TOKENS_TOTAL, "Number of hit tokens in vllm", "num_vllm_hit_tokens"),
        (n.LMCACHE_NUM_PROMPT_TOKENS_TOTAL, "Number of prompt tokens in lmcache", "num_prompt_tokens"),
    )  # fmt: skip
    for name, doc, field in counters:
        value = getattr(kv, field) if kv is not None else 0
        yield _counter(name, doc, [n.MODEL_NAME_LABEL], [([model_name], value)])
    if kv is not None:
        for name, doc, value in (
            (n.KV_STORE_QUEUE_DROPS_TOTAL, "L2 writes dropped because the write queue was full.", kv.num_queue_drops),
            (n.KV_INVALID_RECORDS_TOTAL, "KV records rejected (corrupt or foreign layout).", kv.num_invalid_records),
        ):
            yield _counter(name, doc, [n.MODEL_NAME_LABEL], [([model_name], value)])
    labels, values = [n.MODEL_NAME_LABEL], [model_name]
    tiers = kv.tiers if kv is not None else {}
    for name, doc, tier in (
        (n.LMCACHE_LOCAL_CACHE_USAGE, "Local cache usage (bytes) of lmcache", "cpu"),
        (n.LMCACHE_LOCAL_STORAGE_USAGE, "Local storage usage (bytes) of lmcache", "disk"),
    ):
        stored = tiers[tier].stored_bytes if tier in tiers else None
        yield _gauge(name, doc, labels, [] if stored is None else [(values, stored)])
    speed = kv.retrieve_speed if kv is not None else _EMPTY_SPEED
    hit_rate = kv.lookup_hit_rate if kv is not None else _EMPTY_HIT_RATE
    yield _histogram(n.LMCACHE_RETRIEVE_SPEED, "Retrieve speed of lmcache (tokens per second)", labels, values, speed)
    yield _histogram(n.LMCACHE_REQUEST_CACHE_HIT_RATE, "Request cache hit rate", labels, values, hit_rate)


_EMPTY_SPEED = CumulativeHistogram(tuple(map(float, n.LMCACHE_RETRIEVE_SPEED_BUCKETS)))
_EMPTY_HIT_RATE = CumulativeHistogram(tuple(map(float, n.LMCACHE_HIT_RATE_BUCKETS)))


def _tier_metrics(model_name: str, kv: KVCacheStatsLike) -> Iterator[Metric]:
    labels = [n.MODEL_NAME_LABEL, n.TIER_LABEL]
    for name, doc, field in (
        (n.KV_TIER_HITS_TOTAL, "KV chunk reads served by the tier.", "num_hits"),
        (n.KV_TIER_MISSES_TOTAL, "KV chunk reads the tier did not hold.", "num_misses"),
        (n.KV_TIER_ERRORS_TOTAL, "KV tier I/O errors.", "num_errors"),
    ):
        yield _counter(name, doc, labels, [([model_name, t], getattr(s, field)) for t, s in kv.tiers.items()])
    stored = [([model_name, t], s.stored_bytes) for t, s in kv.tiers.items() if s.stored_bytes is not None]
    yield _gauge(n.KV_TIER_BYTES_STORED, "Bytes of KV records held by the tier.", labels, stored)


def _gauge(name: str, doc: str, labels: list[str], rows: Sequence[tuple[list[str], float]]) -> Metric:
    gauge = GaugeMetricFamily(name, doc, labels=labels)
    for values, value in rows:
        gauge.add_metric(values, float(value))
    return gauge


def _counter(name: str, doc: str, labels: list[str], rows: Sequence[tuple[list[str], float]]) -> Metric:
    counter = CounterMetricFamily(n.counter_base(name), doc, labels=labels)
    for values, value in rows:
        counter.add_metric(values, float(value))
    return counter


def _histogram(name: str, doc: str, labels: list[str], values: list[str], histogram: HistogramLike) -> Metric:
    family = HistogramMetricFamily(name, doc, labels=labels)
    family.add_metric(values, histogram.buckets(), histogram.total)
    return family


class _EngineInfoCollector(Collector):
    """``vllm:cache_config_info`` and ``vllm:engine_sleep_state``, once the engine has loaded."""

    def __init__(self, model_name: str, cache_info: Mapping[str, str]) -> None:
        self._labels = [model_name, n.ENGINE_INDEX]
        self._cache_info = dict(cache_info)

    def collect(self) -> Iterator[Metric]:
        info = self._cache_info
        yield _gauge(n.CACHE_CONFIG_INFO, "Information of the LLMEngine CacheConfig", [*n.VLLM_LABELS, *info],
                     [([*self._labels, *info.values()], 1.0)])  # fmt: skip
        states = [([*self._labels, state], float(state == "awake")) for state in n.SLEEP_STATES]  # no sleep mode
        yield _gauge(n.ENGINE_SLEEP_STATE, _SLEEP_STATE_DOC, [*n.VLLM_LABELS, n.SLEEP_STATE_LABEL], states)


class WorkerMetrics:
    """The worker's metrics, bound to one model name and one registry.

    ``observe_*`` methods are called from the event loop thread, :meth:`engine_ready` and
    :meth:`set_engine_stats` from the engine thread, ``render()`` from any thread.
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
        self._request_tokens: dict[str, Histogram] = {}  # their edges depend on max_model_len: engine_ready
        if cpu_info is not None:
            self.registry.register(_CpuInfoCollector(cpu_info))
        self._make_token_counters()
        self._make_latency_histograms()
        self.registry.register(_EngineStatsCollector(model_name, lambda: self._stats))

    def _make_token_counters(self) -> None:
        self.prompt_tokens = self._counter(n.PROMPT_TOKENS_TOTAL, "Number of prefill tokens processed.")
        self.generation_tokens = self._counter(n.GENERATION_TOKENS_TOTAL, "Number of generation tokens processed.")
        self.prompt_tokens_cached = self._counter(
            n.PROMPT_TOKENS_CACHED_TOTAL, "Number of cached prompt tokens (local + external)."
        )
        by_source = self._counter_family(n.PROMPT_TOKENS_BY_SOURCE_TOTAL, "Number of prompt tokens by source.",
                                         [n.SOURCE_LABEL])  # fmt: skip
        self.prompt_tokens_by_source = {s: by_source.labels(*self._labels, s) for s in n.PROMPT_TOKEN_SOURCES}
        success = self._counter_family(n.REQUEST_SUCCESS_TOTAL, "Count of successfully processed requests.",
                                       [n.FINISHED_REASON_LABEL])  # fmt: skip
        self._request_success = {r: success.labels(*self._labels, r) for r in n.FINISHED_REASONS}
        rejections = Counter(
            n.counter_base(n.ADMISSION_REJECTIONS_TOTAL),
            "Number of admission attempts rejected by a queue limit, by reason.",
            [n.MODEL_NAME_LABEL, n.REASON_LABEL], registry=self.registry,
        )  # fmt: skip
        self._admission_rejections = {r: rejections.labels(self.model_name, r) for r in n.ADMISSION_REASONS}
        for name, doc in (
            *_FLOPS_DOCS,
            (n.MM_CACHE_QUERIES_TOTAL, _MM_QUERIES_DOC),
            (n.MM_CACHE_HITS_TOTAL, _MM_HITS_DOC),
        ):
            self._counter(name, doc)  # zero by design (docs/metrics.md)

    def _make_latency_histograms(self) -> None:
        h = self._histogram
        self.ttft_s = h(n.TIME_TO_FIRST_TOKEN_SECONDS, "Histogram of time to first token in seconds.",
                        n.TTFT_BUCKETS_S)  # fmt: skip
        self.itl_s = h(n.INTER_TOKEN_LATENCY_SECONDS, "Histogram of inter-token latency in seconds.", n.ITL_BUCKETS_S)
        self.tpot_s = h(n.REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS,
                        "Histogram of time_per_output_token_seconds per request.", n.ITL_BUCKETS_S)  # fmt: skip
        latency = n.REQUEST_LATENCY_BUCKETS_S
        self.e2e_s = h(n.E2E_REQUEST_LATENCY_SECONDS, "Histogram of e2e request latency in seconds.", latency)
        self.queue_time_s = h(n.REQUEST_QUEUE_TIME_SECONDS, "Histogram of time spent in WAITING phase for request.",
                              latency)  # fmt: skip
        self.inference_time_s = h(n.REQUEST_INFERENCE_TIME_SECONDS,
                                  "Histogram of time spent in RUNNING phase for request.", latency)  # fmt: skip
        self.prefill_time_s = h(n.REQUEST_PREFILL_TIME_SECONDS,
                                "Histogram of time spent in PREFILL phase for request.", latency)  # fmt: skip
        self.decode_time_s = h(n.REQUEST_DECODE_TIME_SECONDS, "Histogram of time spent in DECODE phase for request.",
                               latency)  # fmt: skip
        self.num_preemptions = h(n.REQUEST_NUM_PREEMPTIONS,
                                 "Histogram of the number of times a request was preempted.",
                                 n.REQUEST_NUM_PREEMPTIONS_BUCKETS)  # fmt: skip
        self.params_n = h(n.REQUEST_PARAMS_N, "Histogram of the n request parameter.", n.REQUEST_PARAMS_N_BUCKETS)

    @property
    def _labels(self) -> tuple[str, str]:
        return (self.model_name, n.ENGINE_INDEX)

    def _counter_family(self, name: str, doc: str, extra_labels: list[str]) -> Counter:
        return Counter(n.counter_base(name), doc, [*n.VLLM_LABELS, *extra_labels], registry=self.registry)

    def _counter(self, name: str, doc: str) -> Counter:
        return self._counter_family(name, doc, []).labels(*self._labels)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        family = Histogram(name, doc, list(n.VLLM_LABELS), buckets=buckets, registry=self.registry)
        return family.labels(*self._labels)

    # ---- from the engine thread ------------------------------------------------------------------------

    def engine_ready(self, max_model_len: int, cache_config_info: Mapping[str, str]) -> None:
        """The engine loaded: make the families that depend on it (once). Token-count histograms get vLLM's
        edges for ``max_model_len`` (1, 2, 5, 10, ... up to it)."""
        if self._request_tokens:
            return
        edges = tuple(float(e) for e in n.request_tokens_buckets(max_model_len))
        for name, doc in (
            (n.REQUEST_PROMPT_TOKENS, "Number of prefill tokens processed."),
            (n.REQUEST_GENERATION_TOKENS, "Number of generation tokens processed."),
            (n.REQUEST_MAX_NUM_GENERATION_TOKENS, "Histogram of maximum number of requested generation tokens."),
            (n.REQUEST_PARAMS_MAX_TOKENS, "Histogram of the max_tokens request parameter."),
            (n.REQUEST_PREFILL_KV_COMPUTED_TOKENS,
             "Histogram of new KV tokens computed during prefill (excluding cached tokens)."),
        ):  # fmt: skip
            self._request_tokens[name] = self._histogram(name, doc, edges)
        self.registry.register(_EngineInfoCollector(self.model_name, cache_config_info))

    def set_engine_stats(self, stats: EngineStatsLike) -> None:
        """Publish the engine's latest stats (an immutable snapshot)."""
        self._stats = stats

    # ---- from the event loop ---------------------------------------------------------------------------

    def observe_first_token(self, ttft_s: float, num_prompt_tokens: int, cached: Mapping[str, int]) -> None:
        """A request's first token: its latency and its prompt tokens, split by where they came from."""
        self.ttft_s.observe(ttft_s)
        num_cached = sum(cached.values())
        num_local = cached.get(_ENGINE_SOURCE, 0)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.prompt_tokens_cached.inc(num_cached)
        by_source = self.prompt_tokens_by_source
        by_source["local_compute"].inc(max(0, num_prompt_tokens - num_cached))
        by_source["local_cache_hit"].inc(num_local)
        by_source["external_kv_transfer"].inc(num_cached - num_local)

    def observe_finished_request(self, request: FinishedRequest) -> None:
        """A request the engine finished: its phases and token counts (vLLM observes them at the same point)."""
        self._request_success[request.finish_reason].inc()
        self.e2e_s.observe(request.e2e_s)
        self.params_n.observe(1)  # each of n choices is an engine request of its own
        phases = request.phases
        if phases is not None:
            self.queue_time_s.observe(phases.queued_s)
            self.prefill_time_s.observe(phases.prefill_s)
            self.decode_time_s.observe(phases.decode_s)
            self.inference_time_s.observe(phases.inference_s)
            # vLLM's: decode time per token after the first (0 for a single token, whose decode time is 0)
            self.tpot_s.observe(phases.decode_s / max(1, request.num_generation_tokens - 1))
            self.num_preemptions.observe(phases.num_preemptions)
        tokens = self._request_tokens
        if tokens:
            tokens[n.REQUEST_PROMPT_TOKENS].observe(request.num_prompt_tokens)
            tokens[n.REQUEST_GENERATION_TOKENS].observe(request.num_generation_tokens)
            tokens[n.REQUEST_MAX_NUM_GENERATION_TOKENS].observe(request.num_generation_tokens)  # n = 1
            tokens[n.REQUEST_PARAMS_MAX_TOKENS].observe(request.max_tokens)
            computed = request.num_prompt_tokens - request.num_cached_tokens
            tokens[n.REQUEST_PREFILL_KV_COMPUTED_TOKENS].observe(computed)

    def observe_finished(self, finish_reason: str) -> None:
        """A request that ended without a final output: aborted (``abort``) or failed (``error``)."""
        self._request_success[finish_reason].inc()

    def observe_admission_rejected(self, reason: str = n.ADMISSION_QUEUED_REQUESTS) -> None:
        self._admission_rejections[reason].inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric in this registry."""
        return generate_latest(self.registry)

"""Every metric name, label and bucket edge splitserve exposes, in one place (``docs/metrics.md`` explains each).

``vllm:`` families carry vLLM 0.32's names, types, labels (``model_name`` and ``engine``) and bucket edges
(``vllm/v1/metrics/buckets.py``), so vLLM's dashboards and a fleet mixing vLLM and splitserve workers aggregate.
``lmcache:`` families carry LMCache's names and meanings (``lmcache/observability.py``). The router's ``vllm:``
gauges are vllm-project/production-stack's router metrics (label ``server``). ``splitserve:`` ones are our own.

Names are as exposed: prometheus_client appends ``_total`` to a Counter's name itself, so counters are created
with the name minus that suffix (``counter_base``).
"""

from __future__ import annotations

from splitserve.policy.admission import ADMISSION_QUEUED_REQUESTS, ADMISSION_QUEUED_TOKENS

# ---- vLLM 0.32, on a worker (tests/data/vllm_0_32_metric_families.txt lists them) ---------------------------

NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
NUM_REQUESTS_WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
ENGINE_SLEEP_STATE = "vllm:engine_sleep_state"
KV_CACHE_USAGE_PERC = "vllm:kv_cache_usage_perc"
CACHE_CONFIG_INFO = "vllm:cache_config_info"
PREFIX_CACHE_QUERIES_TOTAL = "vllm:prefix_cache_queries_total"
PREFIX_CACHE_HITS_TOTAL = "vllm:prefix_cache_hits_total"
EXTERNAL_PREFIX_CACHE_QUERIES_TOTAL = "vllm:external_prefix_cache_queries_total"
EXTERNAL_PREFIX_CACHE_HITS_TOTAL = "vllm:external_prefix_cache_hits_total"
MM_CACHE_QUERIES_TOTAL = "vllm:mm_cache_queries_total"
MM_CACHE_HITS_TOTAL = "vllm:mm_cache_hits_total"
NUM_PREEMPTIONS_TOTAL = "vllm:num_preemptions_total"
PROMPT_TOKENS_TOTAL = "vllm:prompt_tokens_total"
PROMPT_TOKENS_BY_SOURCE_TOTAL = "vllm:prompt_tokens_by_source_total"
PROMPT_TOKENS_CACHED_TOTAL = "vllm:prompt_tokens_cached_total"
PROMPT_TOKENS_CACHED_BY_SOURCE_TOTAL = "vllm:prompt_tokens_cached_by_source_total"
GENERATION_TOKENS_TOTAL = "vllm:generation_tokens_total"
REQUEST_SUCCESS_TOTAL = "vllm:request_success_total"
ADMISSION_REJECTIONS_TOTAL = "vllm:admission_rejections_total"
ESTIMATED_FLOPS_PER_GPU_TOTAL = "vllm:estimated_flops_per_gpu_total"
ESTIMATED_READ_BYTES_PER_GPU_TOTAL = "vllm:estimated_read_bytes_per_gpu_total"
ESTIMATED_WRITE_BYTES_PER_GPU_TOTAL = "vllm:estimated_write_bytes_per_gpu_total"
REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"
ITERATION_TOKENS_TOTAL = "vllm:iteration_tokens_total"  # a histogram, despite the suffix (vLLM's name)
REQUEST_MAX_NUM_GENERATION_TOKENS = "vllm:request_max_num_generation_tokens"
REQUEST_PARAMS_N = "vllm:request_params_n"
REQUEST_PARAMS_MAX_TOKENS = "vllm:request_params_max_tokens"
TIME_TO_FIRST_TOKEN_SECONDS = "vllm:time_to_first_token_seconds"
INTER_TOKEN_LATENCY_SECONDS = "vllm:inter_token_latency_seconds"
REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS = "vllm:request_time_per_output_token_seconds"
E2E_REQUEST_LATENCY_SECONDS = "vllm:e2e_request_latency_seconds"
REQUEST_QUEUE_TIME_SECONDS = "vllm:request_queue_time_seconds"
REQUEST_INFERENCE_TIME_SECONDS = "vllm:request_inference_time_seconds"
REQUEST_PREFILL_TIME_SECONDS = "vllm:request_prefill_time_seconds"
REQUEST_DECODE_TIME_SECONDS = "vllm:request_decode_time_seconds"
REQUEST_NUM_PREEMPTIONS = "vllm:request_num_preemptions"
REQUEST_PREFILL_KV_COMPUTED_TOKENS = "vllm:request_prefill_kv_computed_tokens"

# vLLM families that exist for parity but hold no information on this engine: zero or a constant, by design
# (docs/metrics.md says why). Dashboards need not chart them.
CONSTANT_FAMILIES = frozenset(
    {
        ENGINE_SLEEP_STATE,  # no sleep mode: awake
        MM_CACHE_QUERIES_TOTAL,  # text only
        MM_CACHE_HITS_TOTAL,
        ESTIMATED_FLOPS_PER_GPU_TOTAL,  # vLLM counts these only with --enable-mfu-metrics, off by default
        ESTIMATED_READ_BYTES_PER_GPU_TOTAL,
        ESTIMATED_WRITE_BYTES_PER_GPU_TOTAL,
        REQUEST_PARAMS_N,  # 1: each of n choices is an engine request of its own
    }
)

# ---- LMCache's, on a worker with L1/L2 tiers ----------------------------------------------------------------

LMCACHE_NUM_LOOKUP_REQUESTS_TOTAL = "lmcache:num_lookup_requests_total"
LMCACHE_NUM_LOOKUP_TOKENS_TOTAL = "lmcache:num_lookup_tokens_total"
LMCACHE_NUM_LOOKUP_HITS_TOTAL = "lmcache:num_lookup_hits_total"
LMCACHE_LOOKUP_0_HIT_REQUESTS_TOTAL = "lmcache:lookup_0_hit_requests_total"
LMCACHE_NUM_RETRIEVE_REQUESTS_TOTAL = "lmcache:num_retrieve_requests_total"
LMCACHE_NUM_REQUESTED_TOKENS_TOTAL = "lmcache:num_requested_tokens_total"
LMCACHE_NUM_HIT_TOKENS_TOTAL = "lmcache:num_hit_tokens_total"
LMCACHE_NUM_STORE_REQUESTS_TOTAL = "lmcache:num_store_requests_total"
LMCACHE_NUM_STORED_TOKENS_TOTAL = "lmcache:num_stored_tokens_total"
LMCACHE_NUM_VLLM_HIT_TOKENS_TOTAL = "lmcache:num_vllm_hit_tokens_total"
LMCACHE_NUM_PROMPT_TOKENS_TOTAL = "lmcache:num_prompt_tokens_total"
LMCACHE_LOCAL_CACHE_USAGE = "lmcache:local_cache_usage"
LMCACHE_LOCAL_STORAGE_USAGE = "lmcache:local_storage_usage"
LMCACHE_RETRIEVE_SPEED = "lmcache:retrieve_speed"
LMCACHE_REQUEST_CACHE_HIT_RATE = "lmcache:request_cache_hit_rate"

# ---- splitserve's own, on a worker --------------------------------------------------------------------------

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
EXACTNESS_CHECKS_TOTAL = "splitserve:exactness_checks_total"
EXACTNESS_MISMATCHES_TOTAL = "splitserve:exactness_mismatches_total"
# the paths that reuse KV, as --verify-sample-rate's checks name them (engine.verifier.PATH_OF_SOURCE, migration)
EXACTNESS_PATHS = ("prefix_cache", "l1", "l2", "pd", "migration")
# --speculative-config, as vLLM names them
SPEC_DECODE_NUM_DRAFTS_TOTAL = "vllm:spec_decode_num_drafts_total"
SPEC_DECODE_NUM_DRAFT_TOKENS_TOTAL = "vllm:spec_decode_num_draft_tokens_total"
SPEC_DECODE_NUM_ACCEPTED_TOKENS_TOTAL = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_TOTAL = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
POSITION_LABEL = "position"

# ---- the router: production-stack's router metrics (label ``server``) ---------------------------------------

ROUTER_CURRENT_QPS = "vllm:current_qps"
ROUTER_NUM_REQUESTS_RUNNING = NUM_REQUESTS_RUNNING  # per server, as the router counts them
ROUTER_NUM_PREFILL_REQUESTS = "vllm:num_prefill_requests"
ROUTER_NUM_DECODING_REQUESTS = "vllm:num_decoding_requests"
ROUTER_HEALTHY_PODS_TOTAL = "vllm:healthy_pods_total"  # a gauge, despite the suffix (production-stack's)
ROUTER_AVG_LATENCY = "vllm:avg_latency"
ROUTER_AVG_ITL = "vllm:avg_itl"
ROUTER_GPU_PREFIX_CACHE_HITS_TOTAL = "vllm:gpu_prefix_cache_hits_total"  # a gauge (production-stack's)
ROUTER_GPU_PREFIX_CACHE_QUERIES_TOTAL = "vllm:gpu_prefix_cache_queries_total"  # a gauge
ROUTER_GPU_PREFIX_CACHE_HIT_RATE = "vllm:gpu_prefix_cache_hit_rate"
ROUTER_NUM_INCOMING_REQUESTS_TOTAL = "vllm:num_incoming_requests_total"
ROUTER_CPU_USAGE_PERCENT = "router_cpu_usage_percent"
ROUTER_MEMORY_USAGE_PERCENT = "router_memory_usage_percent"
ROUTER_DISK_USAGE_PERCENT = "router_disk_usage_percent"

# ---- the router: splitserve's own ---------------------------------------------------------------------------

ROUTER_REQUESTS_TOTAL = "splitserve:router_requests_total"
ROUTER_REQUESTS_IN_FLIGHT = "splitserve:router_requests_in_flight"
ROUTER_ROUTING_DECISIONS_TOTAL = "splitserve:router_routing_decisions_total"
ROUTER_RETRIES_TOTAL = "splitserve:router_retries_total"
ROUTER_STREAM_MIGRATIONS_TOTAL = "splitserve:router_stream_migrations_total"
ROUTER_CIRCUIT_BREAKER_STATE = "splitserve:router_circuit_breaker_state"
ROUTER_WORKER_HEALTHY = "splitserve:router_worker_healthy"
ROUTER_INDEX_ENTRIES = "splitserve:router_index_entries"
ROUTER_INDEX_HIT_TOKENS_TOTAL = "splitserve:router_index_hit_tokens_total"
ROUTER_PREDICTED_HIT_TOKENS_TOTAL = "splitserve:router_predicted_hit_tokens_total"
ROUTER_REPORTED_HIT_TOKENS = "splitserve:router_reported_hit_tokens"
ROUTER_HIT_ALARMS_TOTAL = "splitserve:router_hit_alarms_total"
ROUTER_TTFT_SECONDS = "splitserve:e2e_time_to_first_token_seconds"
ROUTER_ITL_SECONDS = "splitserve:router_inter_token_latency_seconds"
ROUTER_E2E_SECONDS = "splitserve:router_e2e_request_latency_seconds"
ROUTER_PD_DECISIONS_TOTAL = "splitserve:router_pd_decisions_total"
PREFILL_TIME_SECONDS = "splitserve:prefill_time_seconds"
KV_TRANSFER_TIME_SECONDS = "splitserve:kv_transfer_time_seconds"
KV_TRANSFER_BYTES_TOTAL = "splitserve:kv_transfer_bytes_total"
KV_TRANSFER_FAILURES_TOTAL = "splitserve:kv_transfer_failures_total"

# ---- labels and their values --------------------------------------------------------------------------------

MODEL_NAME_LABEL = "model_name"
ENGINE_LABEL = "engine"
ENGINE_INDEX = "0"  # one engine per worker process: vLLM's engine 0
VLLM_LABELS = (MODEL_NAME_LABEL, ENGINE_LABEL)
FINISHED_REASON_LABEL = "finished_reason"
SOURCE_LABEL = "source"
PATH_LABEL = "path"
REASON_LABEL = "reason"
SLEEP_STATE_LABEL = "sleep_state"
TIER_LABEL = "tier"
SERVER_LABEL = "server"  # the router's production-stack gauges: a worker's URL
WORKER_LABEL = "worker"
STRATEGY_LABEL = "strategy"
OUTCOME_LABEL = "outcome"

FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason, in its order
FINISHED_ERROR = "error"  # the engine failed while the request ran
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")  # vLLM's CacheHitSource
WAITING_CAPACITY = "capacity"
WAITING_DEFERRED = "deferred"
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
ADMISSION_REASONS = (ADMISSION_QUEUED_REQUESTS, ADMISSION_QUEUED_TOKENS)  # vLLM's; policy.admission says which is which

# ---- bucket edges -------------------------------------------------------------------------------------------

# vLLM 0.32's (vllm/v1/metrics/buckets.py), exactly: a fleet of vLLM and splitserve workers sums bucket by bucket.
REQUEST_LATENCY_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)  # fmt: skip
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)

# LMCache's (lmcache/observability.py)
LMCACHE_RETRIEVE_SPEED_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
LMCACHE_HIT_RATE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def request_tokens_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's token-count edges: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len`` (``build_1_2_5_buckets``)."""
    edges: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(edges)
            edges.append(mantissa * scale)
        scale *= 10


def counter_base(name: str) -> str:
    """The name to give ``prometheus_client.Counter`` so that it exposes ``name`` (which ends in _total)."""
    if not name.endswith("_total"):
        raise ValueError(f"a counter's exposed name ends in _total: {name}")
    return name.removesuffix("_total")

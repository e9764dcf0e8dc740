"""The metrics' parts without a model: vLLM's bucket edges, the histograms components keep themselves, where
cached tokens are said to come from, the async engine's rejections and failures, and the router's
production-stack gauges (sliding windows, per-worker request phases, scraped prefix-cache counters, host usage).

``tests/engine/test_metrics_parity.py`` checks the whole pages of a real worker and router."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from splitserve import metrics
from splitserve.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.speculative import SpecStats
from splitserve.metrics import (
    CumulativeHistogram,
    HostUsage,
    PrefixCacheCounts,
    RouterMetrics,
    WorkerMetrics,
    WorkerRow,
    sum_samples,
)
from splitserve.metrics.router import SlidingWindow
from splitserve.metrics.worker import hit_source
from splitserve.policy.admission import AdmissionLimits
from splitserve.router.scrape import page_totals, prefix_cache_counts
from tests.support.fake_engine import FakeEngine, FakeStats

FAMILIES_PATH = Path(__file__).resolve().parents[1] / "data" / "vllm_0_32_metric_families.txt"


def vllm_edges() -> dict[str, tuple[float, ...]]:
    """Each vLLM histogram's bucket edges, as vLLM 0.32 made them (for max_model_len 512)."""
    edges = {}
    for line in FAMILIES_PATH.read_text().splitlines():
        if not line.startswith("#"):
            name, kind, _, buckets, _ = line.split("\t")
            if kind == "histogram":
                edges[name] = tuple(float(b) for b in buckets.split(","))
    return edges


# ---- bucket edges -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "ours"),
    [
        (metrics.E2E_REQUEST_LATENCY_SECONDS, metrics.REQUEST_LATENCY_BUCKETS_S),
        (metrics.REQUEST_QUEUE_TIME_SECONDS, metrics.REQUEST_LATENCY_BUCKETS_S),
        (metrics.TIME_TO_FIRST_TOKEN_SECONDS, metrics.TTFT_BUCKETS_S),
        (metrics.INTER_TOKEN_LATENCY_SECONDS, metrics.ITL_BUCKETS_S),
        (metrics.REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS, metrics.ITL_BUCKETS_S),
        (metrics.ITERATION_TOKENS_TOTAL, metrics.ITERATION_TOKENS_BUCKETS),
        (metrics.REQUEST_PARAMS_N, metrics.REQUEST_PARAMS_N_BUCKETS),
        (metrics.REQUEST_NUM_PREEMPTIONS, metrics.REQUEST_NUM_PREEMPTIONS_BUCKETS),
        (metrics.REQUEST_PROMPT_TOKENS, metrics.request_tokens_buckets(512)),
    ],
)
def test_bucket_edges_are_vllms(family: str, ours: tuple[float, ...]) -> None:
    assert tuple(map(float, ours)) == vllm_edges()[family]


def test_token_count_edges_follow_max_model_len() -> None:
    assert metrics.request_tokens_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert metrics.request_tokens_buckets(8192)[-3:] == (1000, 2000, 5000)  # vLLM's: not max_model_len itself
    assert metrics.request_tokens_buckets(1) == (1,)


def test_a_cumulative_histogram_renders_as_prometheus_client_would() -> None:
    values = [0.0, 1.0, 1.5, 8.0, 9.0, 100.0]
    ours = CumulativeHistogram((1.0, 8.0, 16.0))
    registry = CollectorRegistry()
    theirs = Histogram("h", "h", buckets=(1.0, 8.0, 16.0), registry=registry)
    for value in values:
        ours.observe(value)
        theirs.observe(value)
    page = generate_latest(registry).decode()
    for le, count in ours.buckets():
        assert sum_samples(page, "h_bucket", le=le) == count
    assert ours.total == sum_samples(page, "h_sum") and ours.count == sum_samples(page, "h_count") == 6
    snapshot = ours.copy()
    ours.observe(1.0)
    assert snapshot.count == 6  # a snapshot does not move with its source


# ---- cached tokens' sources ---------------------------------------------------------------------------------


def test_sources_map_onto_vllms_cache_hit_sources() -> None:
    assert hit_source("engine", None) == "device"
    assert hit_source("l1", "redis") == "host"
    assert hit_source("pd", None) == "p2p"
    assert hit_source("l2", "disk") == "disk"
    assert hit_source("l2", "redis") == "external_unspecified"  # a remote store, in vLLM's terms
    assert {hit_source(s, t) for s in ("engine", "l1", "l2", "pd") for t in ("disk", "redis")} <= set(
        metrics.CACHE_HIT_SOURCES
    )


def test_cached_tokens_are_counted_by_source_on_scrape() -> None:
    worker = WorkerMetrics("m")
    worker.set_engine_stats(FakeStats(cached_tokens_by_source={"engine": 48, "l1": 64, "pd": 16}))
    page = worker.render().decode()
    cached = "vllm:prompt_tokens_cached_by_source_total"
    assert [sum_samples(page, cached, source=s) for s in metrics.CACHE_HIT_SOURCES] == [48, 64, 16, 0, 0]


def test_speculative_decodings_counters_are_vllms_and_only_where_it_runs() -> None:
    worker = WorkerMetrics("m")
    worker.set_engine_stats(FakeStats())
    assert "vllm:spec_decode" not in worker.render().decode()
    spec = SpecStats(num_drafts=4, num_draft_tokens=12, num_accepted_tokens=7, accepted_per_position=[4, 2, 1])
    worker.set_engine_stats(FakeStats(spec_decode=spec))
    page = worker.render().decode()
    assert sum_samples(page, "vllm:spec_decode_num_drafts_total") == 4
    assert sum_samples(page, "vllm:spec_decode_num_draft_tokens_total") == 12
    assert sum_samples(page, "vllm:spec_decode_num_accepted_tokens_total") == 7
    per_position = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert [sum_samples(page, per_position, position=str(p)) for p in range(3)] == [4, 2, 1]


def test_first_tokens_split_prompt_tokens_by_source() -> None:
    worker = WorkerMetrics("m")
    worker.observe_first_token(0.1, 100, {"engine": 32, "l1": 48})
    page = worker.render().decode()
    by_source = "vllm:prompt_tokens_by_source_total"
    assert sum_samples(page, by_source, source="local_compute") == 20
    assert sum_samples(page, by_source, source="local_cache_hit") == 32
    assert sum_samples(page, by_source, source="external_kv_transfer") == 48
    assert sum_samples(page, "vllm:prompt_tokens_cached_total") == 80


# ---- the async engine's rejections and failures ----------------------------------------------------------------


def test_a_full_queue_is_an_admission_rejection_and_a_dead_engine_an_error() -> None:
    fake = FakeEngine(step_delay_s=0.05)
    worker = WorkerMetrics("m")

    async def main() -> None:
        engine = AsyncEngine(lambda: fake, worker, limits=AdmissionLimits(max_in_flight=1, max_prefill_tokens=1))
        engine.start()
        await engine.wait_until_ready(5)
        engine.admit()
        stream = await engine.submit([72, 105], SamplingParams(max_tokens=50), "r1")
        with pytest.raises(QueueFullError):
            engine.admit()
        fake.fail_on_step = True
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass

    asyncio.run(main())
    page = worker.render().decode()
    assert sum_samples(page, "vllm:admission_rejections_total", reason="max_num_queued_reqs") == 1
    assert sum_samples(page, "vllm:request_success_total", finished_reason="error") == 1
    assert sum_samples(page, "vllm:request_success_total", finished_reason="length") == 0


# ---- the router --------------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_sliding_window_forgets_what_is_older_than_it() -> None:
    clock = Clock()
    window = SlidingWindow(60.0, clock)
    assert window.average() == -1.0 and window.rate() == 0.0  # production-stack's "no value"
    window.add(2.0)
    clock.now += 30
    window.add(4.0)
    assert window.average() == 3.0 and window.rate() == 6.0 / 60
    clock.now += 31
    assert window.average() == 4.0
    clock.now += 30
    assert window.average() == -1.0


class State:
    def __init__(self, rows: list[WorkerRow]) -> None:
        self.rows = rows

    def worker_states(self) -> list[WorkerRow]:
        return self.rows

    def index_sizes(self) -> dict[str, int]:
        return {"kv": 3}


def test_the_routers_production_stack_gauges(tmp_path: Path) -> None:
    clock = Clock()
    router = RouterMetrics("roundrobin", clock=clock, host=HostUsage(tmp_path / "no-proc"))
    a, b = "http://a:1", "http://b:1"
    router.bind(State([WorkerRow(a, 5, 2, 0, True), WorkerRow(b, 0, 0, 1, False)]))
    for _ in range(3):
        router.observe_sent(a)
    router.observe_e2e(a, 2.0)
    router.observe_e2e(a, 4.0)
    router.observe_itl(a, 0.1)
    router.set_prefix_cache(a, PrefixCacheCounts(hits=30, queries=120))
    router.observe_incoming("m")
    page = router.render().decode()
    assert sum_samples(page, "vllm:current_qps", server=a) == 3 / 60
    assert sum_samples(page, "vllm:num_requests_running", server=a) == 5
    assert sum_samples(page, "vllm:num_prefill_requests", server=a) == 3  # sent, no first bytes yet
    assert sum_samples(page, "vllm:num_decoding_requests", server=a) == 2  # being relayed
    assert sum_samples(page, "vllm:healthy_pods_total", server=a) == 1
    assert sum_samples(page, "vllm:healthy_pods_total", server=b) == 0
    assert sum_samples(page, "vllm:avg_latency", server=a) == 3.0
    assert sum_samples(page, "vllm:avg_latency", server=b) == -1.0
    assert sum_samples(page, "vllm:avg_itl", server=a) == pytest.approx(0.1)
    assert sum_samples(page, "vllm:gpu_prefix_cache_hit_rate", server=a) == 0.25
    assert sum_samples(page, "vllm:gpu_prefix_cache_queries_total", server=a) == 120
    assert sum_samples(page, "vllm:num_incoming_requests_total", model="m") == 1
    assert sum_samples(page, "splitserve:router_e2e_request_latency_seconds_count") == 2
    assert "# TYPE router_cpu_usage_percent gauge" in page and "\nrouter_cpu_usage_percent " not in page  # no /proc
    # a worker that leaves the pool leaves the gauges
    router.bind(State([WorkerRow(b, 0, 0, 0, True)]))
    page = router.render().decode()
    assert f'server="{a}"' not in page and sum_samples(page, "vllm:healthy_pods_total", server=b) == 1


def test_host_usage_reads_proc_like_psutil(tmp_path: Path) -> None:
    (tmp_path / "meminfo").write_text("MemTotal:       1000 kB\nMemFree: 100 kB\nMemAvailable:    250 kB\n")
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 100 700 100 0 0 0 0 0\ncpu0 1 2 3\n")  # busy 200 of 1000 since boot
    host = HostUsage(tmp_path, disk_path=str(tmp_path))
    assert host.memory_percent() == 75.0
    assert host.cpu_percent() == 20.0
    stat.write_text("cpu  400 0 100 800 100 0 0 0 0 0\n")  # since then: 300 busy of 400
    assert host.cpu_percent() == 75.0
    disk = host.disk_percent()
    assert disk is not None and 0.0 < disk < 100.0


def test_the_scrape_reads_a_workers_prefix_cache_counters() -> None:
    worker = WorkerMetrics("m")
    worker.set_engine_stats(FakeStats(prefix_cache_queries=100, prefix_cache_hits=40))
    assert prefix_cache_counts(page_totals(worker.render().decode())) == PrefixCacheCounts(hits=40, queries=100)
    assert prefix_cache_counts(page_totals("not { a page")) is None

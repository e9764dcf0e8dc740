"""Acceptance for the vLLM-compatible metrics, on a real worker (SmolLM2, in process, with an L1 tier) and a router
in front.

- Every ``vllm:`` family vLLM 0.32 exposes on a CPU (``tests/data/vllm_0_32_metric_families.txt``, made from
  vLLM's own stat logger by ``scripts/vllm_metric_families.py``) exists on the worker's ``/metrics`` with vLLM's
  type, labels, bucket edges and HELP text.
- They hold what the worker did: requests, tokens, phases, the engine's prefix cache and the L1 tier's hits.
- Every metric production-stack's Grafana dashboards (``tests/data/production_stack_dashboards_promql.txt``) and
  our own (``deploy/grafana``) query exists on the worker or on the router.

The traffic: prompt A, A again (the engine's prefix cache), a long prompt B that evicts most of A's blocks from
the small KV cache, then A once more (the engine's remaining blocks, then L1).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve import metrics
from splitserve.config import CacheConfig, EngineConfig, KVTierConfig, ModelConfig, RouterConfig
from splitserve.engine.async_engine import AsyncEngine
from splitserve.metrics import WorkerMetrics, sum_samples
from splitserve.router.app import build_router_app
from splitserve.router.build import build_router
from splitserve.worker.app import build_app
from tests.support.fake_engine import ServerThread
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

DATA = Path(__file__).resolve().parents[1] / "data"
FAMILIES_PATH = DATA / "vllm_0_32_metric_families.txt"
PROMQL_PATH = DATA / "production_stack_dashboards_promql.txt"
DASHBOARD_PATH = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "splitserve-dashboard.json"
MAX_MODEL_LEN = 512  # the families file was made for this length (its token-count bucket edges)
MODEL = "smollm2"
PROMPT_A = [100 + (i * 7) % 900 for i in range(200)]  # 12 full blocks of 16, 3 chunks of 64 in L1
PROMPT_B = [1100 + (i * 11) % 900 for i in range(440)]  # 28 blocks: most of the 32 in the KV cache
MAX_TOKENS = 4
GREEDY = {"temperature": 0, "ignore_eos": True}
ENGINE = {"model_name": MODEL, "engine": "0"}


@dataclass(frozen=True)
class Family:
    name: str  # as exposed: counters with _total
    type: str
    labels: frozenset[str]
    buckets: tuple[float, ...]
    help: str


def vllm_families() -> list[Family]:
    families = []
    for line in FAMILIES_PATH.read_text().splitlines():
        if line.startswith("#"):
            continue
        name, kind, labels, buckets, help_text = line.split("\t")
        edges = () if buckets == "-" else tuple(float(b) for b in buckets.split(","))
        families.append(Family(name, kind, frozenset(labels.split(",")), edges, help_text))
    return families


def exposed_families(text: str) -> dict[str, Family]:
    out = {}
    for family in text_string_to_metric_families(text):
        name = f"{family.name}_total" if family.type == "counter" else family.name
        labels = frozenset(k for s in family.samples for k in s.labels) - {"le"}
        edges = {float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")} - {float("inf")}
        out[name] = Family(name, family.type, labels, tuple(sorted(edges)), family.documentation)
    return out


@dataclass(frozen=True)
class Pages:
    worker: str
    router: str


@pytest.fixture(scope="module")
def pages() -> Iterator[Pages]:
    config = EngineConfig(
        model=ModelConfig(MODEL, max_model_len=MAX_MODEL_LEN),
        cache=CacheConfig(num_gpu_blocks_override=32),
        kv_tiers=KVTierConfig(l1_cache=True, kv_chunk_size=64),
    )

    def load() -> object:
        from splitserve.worker.build import build_engine

        return build_engine(config)

    with ExitStack() as stack:
        engine = AsyncEngine(load, WorkerMetrics(MODEL, cpu_info=lambda: {"arch": "x86_64"}))  # type: ignore[arg-type]
        worker = stack.enter_context(ServerThread(build_app(engine)))
        http = stack.enter_context(httpx.Client(base_url=worker.url, timeout=300))
        wait_until(lambda: http.get("/health").status_code == 200, timeout_s=300, interval_s=0.2)  # the model loads
        for prompt in (PROMPT_A, PROMPT_A, PROMPT_B, PROMPT_A):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS} | GREEDY
            assert http.post("/v1/completions", json=body).status_code == 200
        router = build_router(RouterConfig(model=MODEL, backends=(worker.url,), health_interval_s=0.2))
        front = stack.enter_context(ServerThread(build_router_app(router)))  # scrapes the worker as it starts
        client = stack.enter_context(httpx.Client(base_url=front.url, timeout=300))
        scraped = lambda: "vllm:gpu_prefix_cache_queries_total{" in client.get("/metrics").text  # noqa: E731
        wait_until(scraped, timeout_s=30, interval_s=0.1)  # so it saw the first four requests, not the fifth
        body = {"model": MODEL, "prompt": PROMPT_A[:40], "max_tokens": 2, "stream": True} | GREEDY
        with client.stream("POST", "/v1/completions", json=body) as answer:
            assert answer.status_code == 200 and "[DONE]" in answer.read().decode()
        wait_until(lambda: 'vllm:avg_latency{server="' in client.get("/metrics").text, timeout_s=10)
        yield Pages(http.get("/metrics").text, client.get("/metrics").text)


# ---- vLLM 0.32's families --------------------------------------------------------------------------------------


def test_every_vllm_family_exists_with_its_type_labels_buckets_and_help(pages: Pages) -> None:
    exposed = exposed_families(pages.worker)
    for family in vllm_families():
        ours = exposed.get(family.name)
        assert ours is not None, f"{family.name} is missing"
        assert ours.type == family.type, family.name
        assert ours.buckets == family.buckets, family.name
        assert ours.help == family.help, family.name
        if family.name == metrics.CACHE_CONFIG_INFO:  # the options splitserve has, and the model
            assert {"engine", "model_name", "block_size", "num_gpu_blocks"} <= ours.labels
            assert ours.labels <= family.labels | {"model_name"}, ours.labels - family.labels
        else:
            assert ours.labels == family.labels, family.name
    assert len(vllm_families()) == 39


def test_request_families_count_the_requests_the_worker_finished(pages: Pages) -> None:
    page = pages.worker
    num_requests = 4  # the router's request (5th) finished too: it counts in every family
    total = num_requests + 1
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds", "e2e_request_latency_seconds", "request_params_n",
                 "request_params_max_tokens", "request_num_preemptions", "request_prefill_kv_computed_tokens",
                 "request_max_num_generation_tokens", "time_to_first_token_seconds"):  # fmt: skip
        assert sum_samples(page, f"vllm:{name}_count", **ENGINE) == total, name
    prompts = 3 * len(PROMPT_A) + len(PROMPT_B) + 40
    assert sum_samples(page, "vllm:request_prompt_tokens_sum", **ENGINE) == prompts
    assert sum_samples(page, "vllm:prompt_tokens_total", **ENGINE) == prompts
    assert sum_samples(page, "vllm:request_generation_tokens_sum", **ENGINE) == num_requests * MAX_TOKENS + 2
    assert sum_samples(page, "vllm:request_params_max_tokens_sum", **ENGINE) == num_requests * MAX_TOKENS + 2
    assert sum_samples(page, "vllm:request_success_total", finished_reason="length", **ENGINE) == total
    # phases add up: inference = prefill + decode, each at least as long as nothing
    inference = sum_samples(page, "vllm:request_inference_time_seconds_sum", **ENGINE)
    parts = sum_samples(page, "vllm:request_prefill_time_seconds_sum", **ENGINE) + sum_samples(
        page, "vllm:request_decode_time_seconds_sum", **ENGINE
    )
    assert inference == pytest.approx(parts) and inference > 0
    # every engine step is one observation; together they computed every token that was not cached
    steps = sum_samples(page, "vllm:iteration_tokens_total_sum", **ENGINE)
    computed = sum_samples(page, "vllm:prompt_tokens_by_source_total", source="local_compute", **ENGINE)
    assert steps == computed + total * MAX_TOKENS - 2 - total  # the last token of each is sampled, not computed


def test_cache_families_split_cached_tokens_by_where_they_came_from(pages: Pages) -> None:
    page = pages.worker
    device = sum_samples(page, "vllm:prompt_tokens_cached_by_source_total", source="device", **ENGINE)
    host = sum_samples(page, "vllm:prompt_tokens_cached_by_source_total", source="host", **ENGINE)
    assert device == sum_samples(page, "vllm:prefix_cache_hits_total", **ENGINE) > 0  # A's repeat
    assert host == sum_samples(page, "vllm:external_prefix_cache_hits_total", **ENGINE) > 0  # A after B: L1
    cached = sum_samples(page, "vllm:prompt_tokens_cached_total", **ENGINE)
    by_source = sum_samples(page, "vllm:prompt_tokens_by_source_total", source="local_cache_hit", **ENGINE)
    external = sum_samples(page, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer", **ENGINE)
    assert cached == device + host == by_source + external
    assert sum_samples(page, "lmcache:num_hit_tokens_total") == host  # LMCache's: tokens retrieved
    assert sum_samples(page, "lmcache:retrieve_speed_count") >= 1
    assert sum_samples(page, "lmcache:local_cache_usage") > 0  # A's and B's chunks in L1
    queries = sum_samples(page, "vllm:external_prefix_cache_queries_total", **ENGINE)
    assert queries == sum_samples(page, "vllm:prefix_cache_queries_total", **ENGINE) - device


# ---- dashboards ------------------------------------------------------------------------------------------------

PROMQL_WORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                          "unless", "offset", "inf", "nan"})  # fmt: skip
DECODE_WORKER_ONLY = frozenset(
    {metrics.PD_BUFFER_BYTES_IN_USE, metrics.PD_BUFFER_CAPACITY_BYTES, metrics.PD_BUFFER_ALLOCATION_RETRIES_TOTAL,
     metrics.PD_BUFFER_EXPIRED_TOTAL}
)  # fmt: skip
# only on a worker with --speculative-config (tests/unit/test_metrics_families.py renders them)
SPECULATIVE_ONLY = frozenset(
    {metrics.SPEC_DECODE_NUM_DRAFTS_TOTAL, metrics.SPEC_DECODE_NUM_DRAFT_TOKENS_TOTAL,
     metrics.SPEC_DECODE_NUM_ACCEPTED_TOKENS_TOTAL, metrics.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_TOTAL}
)  # fmt: skip


def metric_names(promql: str) -> set[str]:
    """The metric names a PromQL expression reads (not functions, label names, keywords or numbers)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', promql)  # strings
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)  # label lists
    text = re.sub(r"label_values\(([^,()]*),[^)]*\)", r"\1", text)  # label_values(metric, label): the metric
    text = re.sub(r"label_values\([^)]*\)", " ", text)  # label_values(label): no metric
    names = re.findall(r"(?<![\w.:])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()", text)  # whole names, not calls
    return {n for n in names if n.lower() not in PROMQL_WORDS and not n.startswith("$")}


def production_stack_queries() -> dict[str, list[str]]:
    queries: dict[str, list[str]] = {}
    dashboard = ""
    for line in PROMQL_PATH.read_text().splitlines():
        if line.startswith("## "):
            dashboard = line[3:]
            queries[dashboard] = []
        elif line and not line.startswith("#"):
            queries[dashboard].append(line)
    return queries


def our_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD_PATH.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    return exprs + [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]


def exposed_names(page: str) -> set[str]:
    """Every series name a page has, and the families it declares (a gauge may have no sample yet)."""
    families = list(text_string_to_metric_families(page))
    samples = {s.name for f in families for s in f.samples}
    return samples | {f"{f.name}_total" if f.type == "counter" else f.name for f in families}


def test_the_promql_copy_and_its_name_reader() -> None:
    queries = production_stack_queries()
    assert set(queries) == {"helm/dashboards/vllm-dashboard.json", "helm/dashboards/vllm-model-metrics-dashboard.json",
                            "helm/dashboards/lmcache-dashboard.json"}  # fmt: skip
    assert metric_names("sum(max by (server) (vllm:healthy_pods_total))") == {"vllm:healthy_pods_total"}
    assert metric_names("rate(a:b_total[1m]) / (rate(c_d[1m]) + 1e-10) * 100 / 1e3") == {"a:b_total", "c_d"}
    assert metric_names('histogram_quantile(0.9, sum by(le) (rate(x_bucket{model_name="$m"}[$__rate_interval])))') == {
        "x_bucket"
    }
    assert metric_names("label_values(model_name)") == set()
    assert metric_names('label_values(vllm:num_requests_running{model_name=~"$m"}, role)') == {
        "vllm:num_requests_running"
    }


def test_every_metric_production_stacks_dashboards_query_exists(pages: Pages) -> None:
    on_worker, on_router = exposed_names(pages.worker), exposed_names(pages.router)
    for dashboard, queries in production_stack_queries().items():
        for query in queries:
            missing = metric_names(query) - on_worker - on_router
            assert not missing, f"{dashboard}: {query!r} reads {sorted(missing)}"


def test_every_metric_our_dashboard_queries_exists(pages: Pages) -> None:
    on_worker, on_router = exposed_names(pages.worker), exposed_names(pages.router)
    for query in our_queries():
        missing = metric_names(query) - on_worker - on_router - DECODE_WORKER_ONLY - SPECULATIVE_ONLY
        assert not missing, f"{query!r} reads {sorted(missing)}"


def test_the_routers_production_stack_gauges_describe_the_worker(pages: Pages) -> None:
    page, worker = pages.router, {"server": re.search(r'server="([^"]+)"', pages.router).group(1)}  # type: ignore[union-attr]
    assert sum_samples(page, "vllm:healthy_pods_total", **worker) == 1
    assert sum_samples(page, "vllm:current_qps", **worker) == pytest.approx(1 / 60)  # one request in the window
    assert sum_samples(page, "vllm:avg_latency", **worker) > 0
    assert sum_samples(page, "vllm:num_requests_running", **worker) == 0
    # scraped from the worker when the router started: after the first four requests
    hits = sum_samples(page, "vllm:gpu_prefix_cache_hits_total", **worker)
    queries = sum_samples(page, "vllm:gpu_prefix_cache_queries_total", **worker)
    assert hits > 0 and queries == 3 * len(PROMPT_A) + len(PROMPT_B)
    assert sum_samples(page, "vllm:gpu_prefix_cache_hit_rate", **worker) == pytest.approx(hits / queries)
    assert sum_samples(page, "vllm:num_incoming_requests_total", model=MODEL) == 1

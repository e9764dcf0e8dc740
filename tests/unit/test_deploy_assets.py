"""The assets under deploy/ and the Dockerfile: the Grafana dashboard and Prometheus config load, and the
dashboard's queries name only metrics splitserve exposes (and every one not constant by design); the Kubernetes
files are what the code renders, valid objects; the image runs as the user the manifests name."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from splitserve import metrics
from splitserve.metrics import RouterMetrics, WorkerMetrics
from tests.support.fake_engine import FakeStats

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD_PATH = DEPLOY / "grafana" / "splitserve-dashboard.json"
PROMETHEUS_PATH = DEPLOY / "prometheus" / "prometheus.yml"
OPERATOR_PATH = DEPLOY / "kubernetes" / "operator.yaml"
ALLOW_PROMETHEUS_PATH = DEPLOY / "kubernetes" / "allow-prometheus.yaml"
DOCKERFILE_PATH = DEPLOY.parent / "Dockerfile"

METRIC_RE = re.compile(r"\b(?:vllm|lmcache|splitserve):[a-z0-9_]+")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
ROWS = ["Overview", "Latency", "Disaggregation (prefill/decode)", "Routing", "KV cache"]


def _exposed_names() -> set[str]:
    """Every metric name ``splitserve.metrics`` declares (its string constants)."""
    return {value for value in vars(metrics).values() if isinstance(value, str) and METRIC_RE.fullmatch(value)}


def _histogram_names() -> set[str]:
    """The exposed histograms, read from real worker (with an engine loaded) and router registries."""
    worker = WorkerMetrics("m")
    worker.engine_ready(512, {"block_size": "16"})
    worker.set_engine_stats(FakeStats())
    families = [*worker.registry.collect(), *RouterMetrics("roundrobin").registry.collect()]
    return {family.name for family in families if family.type == "histogram"}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD_PATH.read_text())


def _queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL the dashboard runs: panel targets and template variable queries."""
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    variables = dashboard["templating"]["list"]
    return exprs + [var["query"] for var in variables if var["type"] == "query"]


def _referenced_names(dashboard: dict[str, Any]) -> set[str]:
    return {name for query in _queries(dashboard) for name in METRIC_RE.findall(query)}


def _series_base(name: str, histograms: set[str]) -> str | None:
    """The histogram a ``_bucket``/``_sum``/``_count`` series belongs to, or None."""
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name.removesuffix(suffix) in histograms:
            return name.removesuffix(suffix)
    return None


# ---- the dashboard --------------------------------------------------------------------------------------


def test_dashboard_is_an_importable_grafana_dashboard(dashboard: dict[str, Any]) -> None:
    assert dashboard["schemaVersion"] >= 39
    assert dashboard["uid"] and dashboard["title"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert [panel["title"] for panel in dashboard["panels"] if panel["type"] == "row"] == ROWS


def test_every_query_uses_the_datasource_variable(dashboard: dict[str, Any]) -> None:
    variables = {var["name"]: var for var in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        for source in [panel["datasource"], *(target["datasource"] for target in panel["targets"])]:
            assert source == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]


def test_dashboard_names_only_exposed_metrics(dashboard: dict[str, Any]) -> None:
    exposed, histograms = _exposed_names(), _histogram_names()
    unknown = {
        name for name in _referenced_names(dashboard) if name not in exposed and _series_base(name, histograms) is None
    }
    assert not unknown, f"not in splitserve/metrics.py (or a suffix on a non-histogram): {sorted(unknown)}"


def test_histograms_are_queried_through_their_series(dashboard: dict[str, Any]) -> None:
    histograms = _histogram_names()
    bare = _referenced_names(dashboard) & histograms
    assert not bare, f"histograms have no bare series, use _bucket/_sum/_count: {sorted(bare)}"


def test_every_exposed_metric_is_on_the_dashboard(dashboard: dict[str, Any]) -> None:
    histograms = _histogram_names()
    shown = {_series_base(name, histograms) or name for name in _referenced_names(dashboard)}
    missing = _exposed_names() - shown - metrics.CONSTANT_FAMILIES  # those hold nothing to chart (docs/metrics.md)
    assert not missing, f"metrics.py exposes these but no panel shows them: {sorted(missing)}"


# ---- the Prometheus config ------------------------------------------------------------------------------


def _kubernetes_variant(text: str) -> dict[str, Any]:
    """The commented Kubernetes block at the end of prometheus.yml, uncommented and parsed."""
    lines = text.splitlines()
    start = lines.index("# scrape_configs:")
    return yaml.safe_load("\n".join(line.removeprefix("#").removeprefix(" ") for line in lines[start:]))


def test_prometheus_config_scrapes_the_local_endpoint_with_roles() -> None:
    config = yaml.safe_load(PROMETHEUS_PATH.read_text())
    assert config["scrape_configs"]
    roles = {
        group["labels"]["role"]: group["targets"]
        for job in config["scrape_configs"]
        for group in job.get("static_configs", [])
    }
    assert roles == {"router": ["127.0.0.1:8080"], "prefill": ["127.0.0.1:8001"], "decode": ["127.0.0.1:8002"]}


def test_kubernetes_variant_selects_pods_by_role_labels() -> None:
    jobs = {job["job_name"]: job for job in _kubernetes_variant(PROMETHEUS_PATH.read_text())["scrape_configs"]}
    assert set(jobs) == {"splitserve-workers", "splitserve-router"}
    for job in jobs.values():
        assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
        assert any(rule.get("target_label") == "role" for rule in job["relabel_configs"])
    keeps = {
        (tuple(rule["source_labels"]), rule["regex"])
        for job in jobs.values()
        for rule in job["relabel_configs"]
        if rule.get("action") == "keep"
    }
    assert (("__meta_kubernetes_pod_label_splitserve_io_dpd_role",), "prefill|decode") in keeps
    assert (("__meta_kubernetes_pod_label_app_kubernetes_io_component",), "router") in keeps


# ---- Kubernetes -----------------------------------------------------------------------------------------


def test_the_operator_manifest_is_what_render_operator_prints() -> None:
    from splitserve.deploy.operator import install_manifests

    assert list(yaml.safe_load_all(OPERATOR_PATH.read_text())) == install_manifests()
    kinds = [m["kind"] for m in yaml.safe_load_all(OPERATOR_PATH.read_text())]
    assert "Role" in kinds and "ClusterRole" not in kinds  # namespaced, as installed by default


def test_the_prometheus_policy_example_admits_prometheus_to_the_rendered_workers_port() -> None:
    from splitserve.deploy.render import render
    from splitserve.endpoint import load_endpoint

    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    policy = yaml.safe_load(ALLOW_PROMETHEUS_PATH.read_text())
    kubernetes_validate.validate(policy, "1.30", strict=True)
    manifests = render(load_endpoint(DEPLOY.parent / "examples" / "dpd.yaml"))
    selected = policy["spec"]["podSelector"]
    (components,) = [e["values"] for e in selected["matchExpressions"] if e["key"] == "app.kubernetes.io/component"]
    workers = [m for m in manifests if m["kind"] == "Deployment" and not m["metadata"]["name"].endswith("-router")]
    for deployment in workers:
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selected["matchLabels"].items() <= labels.items() and labels["app.kubernetes.io/component"] in components
        ports = {p["containerPort"] for c in deployment["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert policy["spec"]["ingress"][0]["ports"][0]["port"] in ports


def test_the_image_runs_as_the_non_root_user_the_manifests_name() -> None:
    from splitserve.deploy.render import HOME_DIR, RUN_AS_ID

    lines = [line.strip() for line in DOCKERFILE_PATH.read_text().splitlines()]
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users[-1] == f"{RUN_AS_ID}:{RUN_AS_ID}"  # numeric: the kubelet can check runAsNonRoot
    text = DOCKERFILE_PATH.read_text()
    assert f"--uid {RUN_AS_ID}" in text and f"--gid {RUN_AS_ID}" in text
    assert HOME_DIR == "/home/splitserve" and "useradd" in text and "splitserve" in text  # useradd's home
    assert "SPLITSERVE_CACHE_DIR=" in text  # the built tokenizer is readable with a read-only root filesystem


def test_the_adapter_rules_serve_the_metrics_the_autoscalers_read_from_metrics_the_endpoint_exposes() -> None:
    from splitserve.deploy.render import ENDPOINT_IN_FLIGHT_METRIC, IN_FLIGHT_METRIC, TTFT_METRIC

    rules = yaml.safe_load((DEPLOY / "prometheus" / "adapter-rules.yaml").read_text())["rules"]
    assert [rule["name"]["as"] for rule in rules] == [IN_FLIGHT_METRIC, TTFT_METRIC, ENDPOINT_IN_FLIGHT_METRIC]
    queries = " ".join(rule["metricsQuery"] + rule["seriesQuery"] for rule in rules)
    for name in (metrics.NUM_REQUESTS_RUNNING, metrics.NUM_REQUESTS_WAITING, metrics.ROUTER_TTFT_SECONDS,
                 metrics.ROUTER_REQUESTS_IN_FLIGHT):  # fmt: skip
        assert name in queries
    assert {rule["resources"]["overrides"].get("pod", rule["resources"]["overrides"].get("service"))["resource"]
            for rule in rules} == {"pod", "service"}  # fmt: skip

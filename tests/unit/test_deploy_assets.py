"""The Grafana dashboard and Prometheus config under deploy/: they load, and the dashboard's queries name only
metrics splitserve exposes (and every one of them)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from splitserve import metrics
from splitserve.metrics import RouterMetrics, WorkerMetrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD_PATH = DEPLOY / "grafana" / "splitserve-dashboard.json"
PROMETHEUS_PATH = DEPLOY / "prometheus" / "prometheus.yml"

METRIC_RE = re.compile(r"\b(?:vllm|lmcache|splitserve):[a-z0-9_]+")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
ROWS = ["Overview", "Latency", "Disaggregation (prefill/decode)", "Routing", "KV cache"]


def _exposed_names() -> set[str]:
    """Every metric name ``splitserve.metrics`` declares (its string constants)."""
    return {value for value in vars(metrics).values() if isinstance(value, str) and METRIC_RE.fullmatch(value)}


def _histogram_names() -> set[str]:
    """The exposed histograms, read from real worker and router registries."""
    families = [*WorkerMetrics("m").registry.collect(), *RouterMetrics("roundrobin").registry.collect()]
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
    missing = _exposed_names() - shown
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

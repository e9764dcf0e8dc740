"""The cluster side of an endpoint, with fakes for the cluster: the operator's handlers (create, scale, toggle
DPD, delete, status conditions, invalid resources) and the router's Kubernetes discovery sidecar."""

from __future__ import annotations

import copy
import json
import threading
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import yaml
from starlette.testclient import TestClient

from splitserve.config import RouterConfig
from splitserve.deploy import operator
from splitserve.deploy.operator import (
    FIELD_MANAGER,
    MANAGED_KINDS,
    READY_COLOCATED,
    READY_DPD,
    install_manifests,
    reconcile,
    refresh,
    register,
    teardown,
)
from splitserve.deploy.render import render
from splitserve.endpoint import parse_endpoint
from splitserve.kube import PLURALS, KubeApi, KubeApiError
from splitserve.router.app import build_router_app
from splitserve.router.build import build_router
from splitserve.router.k8s_discovery import (
    KubernetesDiscovery,
    WorkerLists,
    worker_lists,
)
from tests.support.paths import EXAMPLES

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def body(name: str = "dpd", **changes: Any) -> dict[str, Any]:
    """An example as the API server hands it to the operator (uid, generation), with ``changes`` to spec."""
    data: dict[str, Any] = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    data["metadata"] |= {"uid": f"uid-{name}", "generation": 1, "resourceVersion": "7"}
    data["spec"].update(changes)
    return data


def without_pd(data: dict[str, Any]) -> dict[str, Any]:
    data = copy.deepcopy(data)
    del data["spec"]["pdSpec"]
    data["metadata"]["generation"] += 1
    return data


class FakeKube:
    """An in-memory API server: apply stores, list matches ``k=v`` selectors, Deployments get a status."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.applied: list[str] = []
        self.forced: list[str] = []  # applied with force (taking over fields)
        self.deleted: list[str] = []
        self.scaled: list[str] = []  # through the scale subresource
        self.fail: str | None = None

    def apply(self, manifest: dict[str, Any], *, force: bool = False) -> None:
        self._maybe_fail()
        meta = manifest["metadata"]
        key = (manifest["kind"], meta["namespace"], meta["name"])
        old = self.objects.get(key, {})
        self.objects[key] = {**copy.deepcopy(manifest), "status": old.get("status", {})}
        self.applied.append(f"{manifest['kind']}/{meta['name']}")
        if force:
            self.forced.append(f"{manifest['kind']}/{meta['name']}")

    def put(self, kind: str, name: str, **metadata: Any) -> dict[str, Any]:
        """An object someone else made (no owner reference unless given)."""
        obj = {"kind": kind, "metadata": {"name": name, "namespace": "default", **metadata}, "spec": {"x": 1}}
        self.objects[(kind, "default", name)] = obj
        return obj

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self._maybe_fail()
        return copy.deepcopy(self.objects.get((kind, namespace, name)))

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        terms = dict(term.split("=", 1) for term in selector.split(","))
        return [
            copy.deepcopy(obj)
            for (k, ns, _), obj in self.objects.items()
            if k == kind and ns == namespace and terms.items() <= obj["metadata"].get("labels", {}).items()
        ]

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self.objects.pop((kind, namespace, name), None)
        self.deleted.append(f"{kind}/{name}")

    def scale(self, api_version: str, kind: str, namespace: str, name: str, replicas: int) -> None:
        self._maybe_fail()
        self.objects[(kind, namespace, name)]["spec"]["replicas"] = replicas
        self.scaled.append(f"{kind}/{name}={replicas}")

    def set_ready(self, *, ready: bool = True) -> None:
        """Every Deployment reports its replicas ready (or none)."""
        for (kind, _, _), obj in self.objects.items():
            if kind == "Deployment":
                wanted = obj["spec"]["replicas"]
                count = wanted if ready else 0
                obj["status"] = {"readyReplicas": count, "updatedReplicas": count, "observedGeneration": 1}
                obj["metadata"]["generation"] = 1

    def names(self, kind: str) -> set[str]:
        return {name for (k, _, name) in self.objects if k == kind}

    def _maybe_fail(self) -> None:
        if self.fail:
            raise KubeApiError(self.fail)


def ready_condition(status: dict[str, Any]) -> dict[str, Any]:
    (condition,) = [c for c in status["conditions"] if c["type"] == "Ready"]
    return condition


def clock(at: datetime) -> Any:
    return lambda: at


# ---------------------------------------------------------------------------------------------- create


def test_create_applies_the_rendered_manifests_owned_by_the_resource() -> None:
    kube = FakeKube()
    status = reconcile(body("dpd"), kube, now=clock(T0))
    assert kube.applied == [f"{m['kind']}/{m['metadata']['name']}" for m in render(parse_endpoint(body("dpd")))]
    assert kube.names("Deployment") == {"prefill-dpd", "decode-dpd", "dpd-router"}
    owner = kube.objects[("Deployment", "default", "decode-dpd")]["metadata"]["ownerReferences"]
    assert owner == [{"apiVersion": "splitserve.io/v1alpha1", "kind": "InferenceEndpointConfig", "name": "dpd",
                      "uid": "uid-dpd", "controller": True, "blockOwnerDeletion": True}]  # fmt: skip
    condition = ready_condition(status)
    assert (condition["status"], condition["reason"]) == ("False", "DeploymentsNotReady")
    assert condition["message"] == "waiting for prefill-dpd (0/1 ready); decode-dpd (0/1 ready); dpd-router (0/1 ready)"
    assert condition["lastTransitionTime"] == "2026-01-02T03:04:05Z" and condition["observedGeneration"] == 1
    assert status["observedGeneration"] == 1 and status["url"] == "http://dpd-router.default.svc:8080"
    assert status["warnings"] == []


def test_ready_when_the_deployments_report_ready_replicas_dpd_and_colocated() -> None:
    kube = FakeKube()
    reconcile(body("dpd"), kube, now=clock(T0))
    kube.set_ready()
    condition = ready_condition(refresh(body("dpd"), kube, now=clock(T0)))
    assert (condition["status"], condition["reason"], condition["message"]) == ("True", "DeploymentsReady", READY_DPD)
    assert READY_DPD == "DPD prefill and decode deployments are ready"
    kube = FakeKube()
    reconcile(body("colocated"), kube)
    kube.set_ready()
    message = ready_condition(refresh(body("colocated"), kube))["message"]
    assert message == READY_COLOCATED == "Endpoint deployment is ready"


def test_a_deployment_still_rolling_out_is_not_ready() -> None:
    kube = FakeKube()
    reconcile(body("dpd"), kube)
    kube.set_ready()
    decode = kube.objects[("Deployment", "default", "decode-dpd")]
    decode["metadata"]["generation"] = 2  # a new spec the controller has not seen yet
    condition = ready_condition(refresh(body("dpd"), kube))
    assert condition["status"] == "False" and "decode-dpd (1/1 ready)" in condition["message"]
    del kube.objects[("Deployment", "default", "dpd-router")]
    assert "dpd-router (not created)" in ready_condition(refresh(body("dpd"), kube))["message"]


def test_the_transition_time_moves_only_when_readiness_changes() -> None:
    kube = FakeKube()
    resource = body("dpd")
    resource["status"] = reconcile(resource, kube, now=clock(T0))
    later = T0 + timedelta(minutes=1)
    resource["status"] = refresh(resource, kube, now=clock(later))
    assert ready_condition(resource["status"])["lastTransitionTime"] == "2026-01-02T03:04:05Z"
    kube.set_ready()
    resource["status"] = refresh(resource, kube, now=clock(later))
    assert ready_condition(resource["status"])["lastTransitionTime"] == "2026-01-02T03:05:05Z"


def test_plan_warnings_are_reported_in_the_status() -> None:
    status = reconcile(body("dpd", replicas=2), FakeKube())
    (warning,) = status["warnings"]
    assert warning == "spec.replicas is ignored with spec.pdSpec: set prefillSpec and decodingSpec replicas"


# ---------------------------------------------------------------------------------------------- update


def test_scaling_a_role_updates_only_its_deployment() -> None:
    kube = FakeKube()
    reconcile(body("dpd"), kube)
    scaled = body("dpd")
    scaled["spec"]["pdSpec"]["prefillSpec"]["replicas"] = 3
    kube.applied.clear()
    reconcile(scaled, kube)
    assert kube.objects[("Deployment", "default", "prefill-dpd")]["spec"]["replicas"] == 3
    assert kube.objects[("Deployment", "default", "decode-dpd")]["spec"]["replicas"] == 1
    assert kube.deleted == []


def test_the_prefill_pool_keeps_its_decode_ratio_of_what_the_decode_autoscaler_chose() -> None:
    autoscaling = {
        "decode": {"maxReplicas": 8, "targetConcurrency": 4},
        "prefill": {"maxReplicas": 3, "decodeRatio": 0.5},
    }
    kube = FakeKube()
    reconcile(body("dpd", autoscaling=autoscaling), kube)
    prefill, decode = (kube.objects[("Deployment", "default", f"{role}-dpd")] for role in ("prefill", "decode"))
    assert "replicas" not in decode["spec"]  # its HorizontalPodAutoscaler's
    assert kube.names("HorizontalPodAutoscaler") == {"decode-dpd"}
    assert kube.scaled == ["Deployment/prefill-dpd=1"]  # half of the decode pool's 1 (the resource's), rounded up
    for chosen, expected in ((5, 3), (8, 3), (2, 1)):  # the HPA's choice; 8 would ask for 4: past maxReplicas
        decode["spec"]["replicas"] = chosen
        refresh(body("dpd", autoscaling=autoscaling), kube)
        assert prefill["spec"]["replicas"] == expected
    kube.scaled.clear()
    refresh(body("dpd", autoscaling=autoscaling), kube)  # nothing changed: nothing written
    assert kube.scaled == []


def test_router_replicas_scale_the_router_and_its_disruption_budget_comes_and_goes_with_them() -> None:
    kube = FakeKube()
    reconcile(body("kvaware"), kube)  # spec.router.replicas: 2
    assert kube.objects[("Deployment", "default", "kvaware-router")]["spec"]["replicas"] == 2
    assert kube.names("PodDisruptionBudget") == {"kvaware-router"}
    one = body("kvaware")
    one["spec"]["router"]["replicas"] = 1
    reconcile(one, kube)
    assert kube.objects[("Deployment", "default", "kvaware-router")]["spec"]["replicas"] == 1
    assert kube.names("PodDisruptionBudget") == set() and kube.deleted == ["PodDisruptionBudget/kvaware-router"]


def test_toggling_dpd_off_and_on_swaps_the_deployments_and_services() -> None:
    kube = FakeKube()
    reconcile(body("dpd"), kube)
    reconcile(without_pd(body("dpd")), kube)
    assert kube.names("Deployment") == {"dpd", "dpd-router"}
    assert kube.names("Service") == {"dpd", "dpd-router"}
    assert sorted(kube.deleted) == [
        "Deployment/decode-dpd", "Deployment/prefill-dpd", "NetworkPolicy/dpd-decode", "NetworkPolicy/dpd-prefill",
        "Service/decode-dpd", "Service/prefill-dpd",
    ]  # fmt: skip
    assert "NetworkPolicy/dpd-worker" in kube.applied
    router = kube.objects[("Deployment", "default", "dpd-router")]["spec"]["template"]["spec"]["containers"][0]
    assert "--backend" in router["args"]
    kube.deleted.clear()
    reconcile(body("dpd"), kube)
    assert kube.names("Deployment") == {"prefill-dpd", "decode-dpd", "dpd-router"}
    assert sorted(kube.deleted) == ["Deployment/dpd", "NetworkPolicy/dpd-worker", "Service/dpd"]


def test_another_endpoints_objects_are_never_pruned() -> None:
    kube = FakeKube()
    reconcile(body("colocated"), kube)
    reconcile(body("dpd"), kube)
    reconcile(without_pd(body("dpd")), kube)
    assert {"colocated", "colocated-router"} <= kube.names("Deployment")


# ---------------------------------------------------------------------------------------------- invalid


def test_an_invalid_resource_gets_a_condition_with_the_error_and_nothing_is_touched() -> None:
    kube = FakeKube()
    reconcile(body("dpd"), kube)
    before = copy.deepcopy(kube.objects)
    bad = body("dpd", intelligentRoutingSpec={"routingStrategy": "fastest"})
    status = reconcile(bad, kube)
    condition = ready_condition(status)
    assert (condition["status"], condition["reason"]) == ("False", "InvalidSpec")
    assert condition["message"] == (
        "spec.intelligentRoutingSpec.routingStrategy: 'fastest' is not one of roundrobin, session, prefixaware, kvaware"
    )
    assert kube.objects == before and status["url"] is None
    assert ready_condition(refresh(bad, kube)) == condition | {"lastTransitionTime": condition["lastTransitionTime"]}


def test_a_resource_that_validates_but_cannot_be_planned_is_invalid_too() -> None:
    bad = body("dpd", modelSourceConfig={"modelSourceType": "s3", "modelLocation": "llama"})
    condition = ready_condition(reconcile(bad, FakeKube()))
    assert condition["reason"] == "InvalidSpec" and "spec.worker.modelVolumeMount is required" in condition["message"]


def test_several_problems_are_all_in_the_message() -> None:
    bad = body("dpd", replicas=-1, loadBalancer={"healthCheckPath": 5, "port": 1})
    message = ready_condition(reconcile(bad, FakeKube()))["message"]
    assert message.startswith("3 errors:\n") and "spec.replicas" in message and "spec.loadBalancer.port" in message


# ---------------------------------------------------------------------------------------------- delete


def test_delete_removes_every_object_of_the_endpoint_even_when_its_spec_is_invalid() -> None:
    kube = FakeKube()
    reconcile(body("dpd-redis"), kube)
    reconcile(body("colocated"), kube)
    deleted = teardown(body("dpd-redis", intelligentRoutingSpec={"routingStrategy": "nope"}), kube)
    assert {"Deployment/dpd-redis-redis", "Deployment/prefill-dpd-redis", "RoleBinding/dpd-redis-router",
            "ServiceAccount/dpd-redis-router", "Secret/dpd-redis-cluster-secret",
            "NetworkPolicy/dpd-redis-default-deny"} <= set(deleted)  # fmt: skip
    assert {name for (_, _, name) in kube.objects if not name.startswith("colocated")} == set()


# ---------------------------------------------------------------------------------------------- kopf wiring


class FakeKopf:
    """Records what ``register`` hands kopf; TemporaryError as kopf's."""

    class TemporaryError(Exception):
        def __init__(self, message: str, delay: float | None = None) -> None:
            super().__init__(message)
            self.delay = delay

    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}
        causes = ("create", "update", "resume", "delete")
        self.on = SimpleNamespace(**{cause: self._decorator(cause) for cause in causes})

    def _decorator(self, cause: str) -> Any:
        def decorator(*resource: str, **options: Any) -> Any:
            assert resource == ("splitserve.io", "v1alpha1", "inferenceendpointconfigs")
            return lambda fn: self.handlers.setdefault(cause, fn)

        return decorator

    def timer(self, *resource: str, interval: float, **options: Any) -> Any:
        self.interval = interval
        return lambda fn: self.handlers.setdefault("timer", fn)


def test_the_kopf_handlers_are_thin_and_patch_the_status() -> None:
    kopf, kube = FakeKopf(), FakeKube()
    register(kopf, kube, interval_s=7.0)
    assert set(kopf.handlers) == {"create", "update", "resume", "delete", "timer"} and kopf.interval == 7.0
    patch = SimpleNamespace(status={})
    kopf.handlers["create"](body=body("dpd"), patch=patch, logger=None)
    assert kube.names("Deployment") == {"prefill-dpd", "decode-dpd", "dpd-router"}
    assert ready_condition(patch.status)["reason"] == "DeploymentsNotReady"
    kube.set_ready()
    kopf.handlers["timer"](body=body("dpd"), patch=patch)
    assert ready_condition(patch.status)["message"] == READY_DPD
    kopf.handlers["delete"](body=body("dpd"))
    assert kube.objects == {}


def test_api_failures_become_kopf_retries() -> None:
    kopf, kube = FakeKopf(), FakeKube()
    register(kopf, kube)
    kube.fail = "503 etcd is down"
    with pytest.raises(FakeKopf.TemporaryError, match="etcd is down") as info:
        kopf.handlers["update"](body=body("dpd"), patch=SimpleNamespace(status={}))
    assert info.value.delay == operator.RETRY_DELAY_S


def test_register_with_the_real_kopf() -> None:
    kopf = pytest.importorskip("kopf")
    registry = kopf.OperatorRegistry()
    register(kopf, FakeKube(), registry=registry)
    changing = [h.id for h in registry._changing.get_all_handlers()]  # kopf has no public listing
    assert sorted(changing) == ["apply", "apply", "apply", "delete"]
    assert [h.id for h in registry._spawning.get_all_handlers()] == ["status"]


# ---------------------------------------------------------------------------------------------- the HTTP client


def test_the_http_client_applies_server_side_and_treats_missing_objects_as_none() -> None:
    seen: list[httpx.Request] = []

    def api(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.method == "GET" and request.url.path.endswith("/deployments/gone"):
            return httpx.Response(404, json={"kind": "Status"})
        if request.method == "DELETE":
            return httpx.Response(404, json={"kind": "Status"})
        if request.method == "GET":
            return httpx.Response(200, json={"items": [{"metadata": {"name": "a"}}]})
        return httpx.Response(200, json={})

    kube = KubeApi(httpx.Client(base_url="https://api:6443", transport=httpx.MockTransport(api)), FIELD_MANAGER)
    deployment = next(m for m in render(parse_endpoint(body("dpd"))) if m["kind"] == "Deployment")
    kube.apply(deployment)
    request = seen[-1]
    assert (request.method, request.url.path) == ("PATCH", "/apis/apps/v1/namespaces/default/deployments/prefill-dpd")
    assert request.headers["content-type"] == "application/apply-patch+yaml"
    assert request.url.params["fieldManager"] == "splitserve-operator" and request.url.params["force"] == "false"
    assert json.loads(request.content) == deployment
    kube.apply(deployment, force=True)  # only ever for the endpoint's own objects
    assert seen[-1].url.params["force"] == "true"
    policy = next(m for m in render(parse_endpoint(body("dpd"))) if m["kind"] == "NetworkPolicy")
    kube.apply(policy)
    assert seen[-1].url.path == "/apis/networking.k8s.io/v1/namespaces/default/networkpolicies/dpd-default-deny"
    assert kube.get("apps/v1", "Deployment", "default", "gone") is None
    assert kube.list("v1", "Service", "default", "a=b") == [{"metadata": {"name": "a"}}]
    assert seen[-1].url.path == "/api/v1/namespaces/default/services" and seen[-1].url.params["labelSelector"] == "a=b"
    kube.delete("rbac.authorization.k8s.io/v1", "Role", "default", "r")  # already gone: fine
    assert seen[-1].url.path == "/apis/rbac.authorization.k8s.io/v1/namespaces/default/roles/r"
    kube.scale("apps/v1", "Deployment", "default", "prefill-dpd", 3)  # as an HPA does: the scale subresource
    assert (seen[-1].method, seen[-1].url.path) == (
        "PATCH",
        "/apis/apps/v1/namespaces/default/deployments/prefill-dpd/scale",
    )
    assert seen[-1].headers["content-type"] == "application/merge-patch+json"
    assert json.loads(seen[-1].content) == {"spec": {"replicas": 3}}


def test_the_http_client_raises_api_errors() -> None:
    kube = KubeApi(
        httpx.Client(base_url="https://api", transport=httpx.MockTransport(lambda r: httpx.Response(403, text="no")))
    )
    with pytest.raises(KubeApiError, match="403"):
        kube.list("apps/v1", "Deployment", "default", "a=b")


def test_the_operator_install_manifests_are_valid_kubernetes_objects() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for cluster_wide in (False, True):
        for manifest in install_manifests(namespace="ops", image="reg/splitserve:1", cluster_wide=cluster_wide):
            kubernetes_validate.validate(manifest, "1.30", strict=True)


@pytest.mark.parametrize("cluster_wide", [False, True], ids=["namespaced", "cluster-wide"])
def test_the_operator_may_manage_everything_it_renders(cluster_wide: bool) -> None:
    manifests = install_manifests(namespace="ops", cluster_wide=cluster_wide)
    role = next(m for m in manifests if m["kind"] in ("Role", "ClusterRole"))
    granted = {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    rendered = [m for name in ("dpd-redis", "kvaware", "autoscaling") for m in render(parse_endpoint(body(name)))]
    for manifest in rendered:  # everything it renders (ConfigMaps and PodDisruptionBudgets too), it may manage
        group = manifest["apiVersion"].rpartition("/")[0]
        assert (group, PLURALS[manifest["kind"]]) in granted  # and its client knows where each kind lives
        assert (manifest["apiVersion"], manifest["kind"]) in MANAGED_KINDS  # so it prunes what it no longer renders
    assert ("", "pods") in granted  # to grant the router's discovery what it holds itself


def test_the_operator_is_namespaced_unless_asked_otherwise() -> None:
    manifests = install_manifests(namespace="ops")
    kinds = [m["kind"] for m in manifests]
    assert "ClusterRole" not in kinds and "ClusterRoleBinding" not in kinds
    role, binding = (next(m for m in manifests if m["kind"] == kind) for kind in ("Role", "RoleBinding"))
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "ops"
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "splitserve-operator",
    }
    granted = {r for rule in role["rules"] for r in rule["resources"]}
    assert not granted & {"namespaces", "customresourcedefinitions"}  # no cluster-level reads either
    operator_pod = next(m for m in manifests if m["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert operator_pod["containers"][0]["command"] == ["splitserve", "operator"]  # its own namespace
    wide = install_manifests(namespace="ops", cluster_wide=True)
    assert {"ClusterRole", "ClusterRoleBinding"} <= {m["kind"] for m in wide}
    wide_pod = next(m for m in wide if m["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert wide_pod["containers"][0]["command"] == ["splitserve", "operator", "--all-namespaces"]


def test_the_operator_watches_its_own_namespace_by_default() -> None:
    assert operator.watched_namespaces((), False, own_namespace="ops") == ["ops"]
    assert operator.watched_namespaces(("a", "b"), False, own_namespace="ops") == ["a", "b"]
    assert operator.watched_namespaces((), True, own_namespace="ops") is None  # every namespace
    with pytest.raises(RuntimeError, match="exclude each other"):
        operator.watched_namespaces(("a",), True)
    with pytest.raises(RuntimeError, match="give --namespace NAME or --all-namespaces"):
        operator.watched_namespaces((), False, own_namespace=None)


def test_a_namespaced_operator_runs_kopf_on_its_namespace_without_cluster_scanning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_kopf = pytest.importorskip("kopf")
    runs: list[dict[str, Any]] = []
    fake = SimpleNamespace(
        on=SimpleNamespace(**{c: real_kopf.on.create for c in ("create", "update", "resume", "delete")}),
        timer=real_kopf.timer, OperatorSettings=real_kopf.OperatorSettings, TemporaryError=real_kopf.TemporaryError,
        run=lambda **kwargs: runs.append(kwargs),
    )  # fmt: skip
    monkeypatch.setitem(__import__("sys").modules, "kopf", fake)
    monkeypatch.setattr(operator, "register", lambda *args, **kwargs: None)
    monkeypatch.setenv("SPLITSERVE_POD_NAMESPACE", "team-a")
    assert operator.run_operator(api_server="http://127.0.0.1:1") == 0
    assert operator.run_operator(api_server="http://127.0.0.1:1", all_namespaces=True) == 0
    namespaced, wide = runs
    assert (namespaced["clusterwide"], namespaced["namespaces"]) == (False, ["team-a"])
    assert namespaced["settings"].scanning.disabled  # no list/watch of namespaces or CRDs: a Role suffices
    assert (wide["clusterwide"], wide["settings"].scanning.disabled) == (True, False)


# ---------------------------------------------------------------------------------------------- ownership


def test_the_cluster_secret_is_made_once_not_on_every_reconcile() -> None:
    kube = FakeKube()
    reconcile(body("dpd-redis"), kube)
    secret = kube.objects[("Secret", "default", "dpd-redis-cluster-secret")]
    template = kube.objects[("Deployment", "default", "decode-dpd-redis")]["spec"]["template"]
    for _ in range(2):
        reconcile(body("dpd-redis"), kube)
    assert kube.objects[("Secret", "default", "dpd-redis-cluster-secret")]["data"] == secret["data"]
    assert kube.objects[("Deployment", "default", "decode-dpd-redis")]["spec"]["template"] == template  # no roll
    del kube.objects[("Secret", "default", "dpd-redis-cluster-secret")]  # someone deleted it: a new one, pods roll
    reconcile(body("dpd-redis"), kube)
    assert kube.objects[("Secret", "default", "dpd-redis-cluster-secret")]["data"] != secret["data"]
    rolled = kube.objects[("Deployment", "default", "decode-dpd-redis")]["spec"]["template"]
    assert rolled["metadata"]["annotations"] != template["metadata"]["annotations"]


def test_only_the_endpoints_own_objects_are_applied_with_force() -> None:
    kube = FakeKube()
    reconcile(body("dpd"), kube)
    assert kube.forced == []  # all new: created without taking anything over
    kube.applied.clear()
    reconcile(body("dpd"), kube)
    assert kube.forced == kube.applied  # all its own now


def test_an_object_it_does_not_own_is_a_conflict_reported_not_overwritten() -> None:
    kube = FakeKube()
    foreign = kube.put("Service", "dpd-router", labels={"app": "someone-elses"})
    status = reconcile(body("dpd"), kube, now=clock(T0))
    condition = ready_condition(status)
    assert (condition["status"], condition["reason"]) == ("False", "Conflict")
    assert "Service/dpd-router" in condition["message"] and "not this endpoint's" in condition["message"]
    assert kube.applied == [] and kube.objects == {("Service", "default", "dpd-router"): foreign}
    resource = {**body("dpd"), "status": status}
    assert ready_condition(refresh(resource, kube))["reason"] == "Conflict"  # the timer tries again: still taken
    del kube.objects[("Service", "default", "dpd-router")]
    assert ready_condition(refresh(resource, kube))["reason"] == "DeploymentsNotReady"  # now applied
    assert "Deployment/dpd-router" in kube.applied


def test_an_object_owned_by_another_resource_is_neither_taken_nor_pruned_nor_deleted() -> None:
    kube = FakeKube()
    other = {"apiVersion": "v1", "kind": "Thing", "name": "x", "uid": "uid-other", "controller": True}
    kube.put("Secret", "dpd-cluster-secret", ownerReferences=[other], labels={})
    assert ready_condition(reconcile(body("dpd"), kube))["reason"] == "Conflict"
    assert ("Deployment", "default", "decode-dpd") not in kube.objects  # no pod ever read that Secret
    labelled = {"app.kubernetes.io/instance": "dpd", "app.kubernetes.io/managed-by": "splitserve"}
    kube = FakeKube()
    reconcile(body("dpd"), kube)
    kube.put("Service", "dpd-extra", labels=labelled)  # looks like ours (a kubectl-applied render), is not
    reconcile(body("dpd"), kube)
    teardown(body("dpd"), kube)
    assert set(kube.objects) == {("Service", "default", "dpd-extra")}


# ---------------------------------------------------------------------------------------------- discovery


def pod(name: str, ip: str | None, role: str | None, *, ready: bool = True, phase: str = "Running") -> dict[str, Any]:
    labels = {"app.kubernetes.io/instance": "dpd"} | ({"splitserve.io/dpd-role": role} if role else {})
    status: dict[str, Any] = {"phase": phase, "conditions": [{"type": "Ready", "status": str(ready)}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": {"name": name, "labels": labels}, "status": status}


PODS = [
    pod("prefill-dpd-a", "10.0.0.1", "prefill"),
    pod("prefill-dpd-b", "10.0.0.2", "prefill", ready=False),  # loading its model
    pod("decode-dpd-a", "10.0.0.3", "decode"),
    pod("decode-dpd-b", None, "decode", phase="Pending"),
]


def test_worker_lists_keep_ready_pods_with_their_role() -> None:
    lists = worker_lists(PODS, 8000)
    assert lists == WorkerLists(prefill=("http://10.0.0.1:8000",), decode=("http://10.0.0.3:8000",))
    assert lists.body() == {"backend": [], "prefill": ["http://10.0.0.1:8000"], "decode": ["http://10.0.0.3:8000"]}
    terminating = pod("x", "10.0.0.9", None)
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    colocated = worker_lists([pod("w", "fd00::5", None), terminating], 9000)
    assert colocated == WorkerLists(backend=("http://[fd00::5]:9000",))


def fake_api(pods: list[dict[str, Any]], seen: list[httpx.Request]) -> httpx.Client:
    """The API server's pod list, as JSON, for one namespace."""

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path != "/api/v1/namespaces/default/pods":
            return httpx.Response(404)
        return httpx.Response(200, json={"kind": "PodList", "apiVersion": "v1", "items": pods})

    return httpx.Client(base_url="https://kubernetes.default.svc", transport=httpx.MockTransport(handle))


SELECTOR = "app.kubernetes.io/instance=dpd,app.kubernetes.io/component in (prefill,decode)"


def test_discovery_puts_the_ready_pods_into_the_real_router() -> None:
    services = {"prefill": ("http://prefill-dpd.default.svc:8000",), "decode": ("http://decode-dpd.default.svc:8000",)}
    config = RouterConfig(**services)
    router = build_router(config)
    seen: list[httpx.Request] = []
    with TestClient(build_router_app(router, probe=False)) as client:
        discovery = KubernetesDiscovery(
            KubeApi(fake_api(PODS, seen)), client, namespace="default", selector=SELECTOR, port=8000
        )
        sent = discovery.sync_once()
        assert sent == WorkerLists(prefill=("http://10.0.0.1:8000",), decode=("http://10.0.0.3:8000",))
        assert sorted((w.role.value, w.url) for w in router.pool) == [
            ("decode", "http://10.0.0.3:8000"),
            ("prefill", "http://10.0.0.1:8000"),
        ]
        assert seen[0].url.params["labelSelector"] == SELECTOR
        assert discovery.sync_once() is None and discovery.num_updates == 1  # unchanged: no second PUT


def test_discovery_keeps_the_routers_list_while_no_decode_pod_is_ready() -> None:
    puts: list[Any] = []

    def fake_router(request: httpx.Request) -> httpx.Response:
        if request.method == "PUT":
            puts.append(json.loads(request.content))
        return httpx.Response(200, json={"workers": []})

    router = httpx.Client(base_url="http://127.0.0.1:8080", transport=httpx.MockTransport(fake_router))
    only_prefill = [p for p in PODS if "prefill" in p["metadata"]["name"]]
    discovery = KubernetesDiscovery(
        KubeApi(fake_api(only_prefill, [])), router, namespace="default", selector=SELECTOR, port=8000
    )
    assert discovery.sync_once() is None and puts == []


def test_discovery_survives_api_and_router_failures() -> None:
    broken_api = httpx.Client(base_url="https://api", transport=httpx.MockTransport(lambda r: httpx.Response(403)))
    refusing = httpx.Client(
        base_url="http://router", transport=httpx.MockTransport(lambda r: httpx.Response(400, json={"error": {}}))
    )
    discovery = KubernetesDiscovery(KubeApi(broken_api), refusing, namespace="default", selector="a=b", port=1)
    assert discovery.sync_once() is None
    discovery.pods = KubeApi(fake_api(PODS, []))
    assert discovery.sync_once() is None and discovery.num_updates == 0


def test_discovery_runs_until_stopped() -> None:
    class Pods:
        calls = 0

        def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
            self.calls += 1
            return []

    stop, pods = threading.Event(), Pods()
    router = httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(200, json={"workers": []})))
    discovery = KubernetesDiscovery(pods, router, namespace="default", selector="a=b", port=1, interval_s=0.01)
    discovery.run(stop, sleep=lambda _: stop.set() if pods.calls >= 3 else None)
    assert pods.calls == 3

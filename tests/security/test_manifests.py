"""The rendered Kubernetes manifests pass the policy checks: for every example and a few variants, every pod runs
restricted, only the discovery sidecar holds a service-account token, no secret is a literal anywhere but in the
endpoint's Secret, and the NetworkPolicies let exactly the documented connections through (checked by evaluating them,
as a CNI would). The operator's RBAC is namespaced unless asked otherwise.

Checkov (a policy tool on PyPI; too heavy for the dev dependencies) runs too when it is installed:
``pip install checkov`` in a virtual environment of its own, then ``SPLITSERVE_CHECKOV=/path/to/bin/checkov``
or checkov on PATH. It needs no network."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from splitserve.deploy import collector
from splitserve.deploy.operator import install_manifests
from splitserve.deploy.render import (
    RUN_AS_ID,
    SECRET_KEY,
    SERVICE_ACCOUNT_DIR,
    decode_secret,
    kv_transfer_port,
    render,
    render_yaml,
    secret_name,
)
from splitserve.endpoint import InferenceEndpointConfig, load_endpoint, parse_endpoint

Manifest = dict[str, Any]

EXAMPLES = {path.stem: path for path in sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))}
SECRET_ENV = {"SPLITSERVE_CLUSTER_SECRET", "SPLITSERVE_API_KEY", "VLLM_API_KEY", "SPLITSERVE_REDIS_PASSWORD",
              "REDIS_PASSWORD"}  # fmt: skip
SPLITSERVE_CONTAINERS = {"worker", "router", "discovery"}
DNS = 53
# Checkov checks that do not apply, and why: the image and namespace are the user's choice (the examples use
# splitserve:latest in "default", built locally, hence IfNotPresent); secrets reach the processes through the
# environment (``env`` ``valueFrom.secretKeyRef``), as they read them; the discovery sidecar serves no port to
# probe.
CHECKOV_SKIPPED = {
    "CKV_K8S_14": "image tag latest: the default image is built from this repository; spec.worker.image sets one",
    "CKV_K8S_15": "pull policy Always: a locally built image would never start",
    "CKV_K8S_21": "default namespace: the examples' choice",
    "CKV_K8S_35": "secrets as files: the processes read SPLITSERVE_CLUSTER_SECRET from their environment",
    "CKV_K8S_43": "image digest: the user's choice",
    "CKV_K8S_8": "liveness probe: the discovery sidecar serves nothing to probe",
    "CKV_K8S_9": "readiness probe: the discovery sidecar serves nothing to probe",
}


def variant(name: str, **spec: Any) -> InferenceEndpointConfig:
    data = yaml.safe_load(EXAMPLES[name].read_text())
    data["spec"] = {**data["spec"], **copy.deepcopy(spec)}
    return parse_endpoint(data)


def resources() -> Iterator[tuple[str, InferenceEndpointConfig]]:
    """Every example, and variants that change what the manifests hold (disk L2, an outside Redis, a secret
    client key, another port, metrics)."""
    for name, path in EXAMPLES.items():
        yield name, load_endpoint(path)
    disk = {"enableL2Cache": True, "l2CacheSpec": {"l2CacheBackend": "tieredstorage"}}
    yield "colocated-disk", variant("colocated", kvCacheSpec=disk)
    outside = {"enableL2Cache": True, "l2CacheSpec": {"l2CacheBackend": "redis", "l2CacheLocalUrl": "redis://r:6380/0"}}
    yield "dpd-outside-redis", variant("dpd", kvCacheSpec=outside)
    key = {"name": "SPLITSERVE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "client-keys", "key": "main"}}}
    worker = {**yaml.safe_load(EXAMPLES["kvaware"].read_text())["spec"]["worker"], "environmentVariables": [key]}
    worker["modelInvocationPort"] = {"name": "http", "containerPort": 9000}
    yield "kvaware-key-port", variant("kvaware", worker=worker, metrics={"enabled": False})
    vllm_worker = {**yaml.safe_load(EXAMPLES["vllm"].read_text())["spec"]["worker"], "environmentVariables": [key]}
    yield "vllm-key-roundrobin", variant("vllm", worker=vllm_worker, intelligentRoutingSpec={"enabled": False})


RENDERED = [(name, render(config)) for name, config in resources()]
IDS = [name for name, _ in RENDERED]


def deployments(manifests: list[Manifest]) -> list[Manifest]:
    return [m for m in manifests if m["kind"] == "Deployment"]


def pods(manifests: list[Manifest]) -> Iterator[tuple[str, Manifest]]:
    for deployment in deployments(manifests):
        yield deployment["metadata"]["name"], deployment["spec"]["template"]


def containers(manifests: list[Manifest]) -> Iterator[tuple[str, Manifest, Manifest]]:
    for name, pod in pods(manifests):
        for c in pod["spec"]["containers"]:
            yield name, pod, c


def component_of(manifests: list[Manifest], component: str) -> Manifest | None:
    for _, pod in pods(manifests):
        if pod["metadata"]["labels"]["app.kubernetes.io/component"] == component:
            return pod
    return None


# ---------------------------------------------------------------------------------------------- pods


@pytest.mark.parametrize(("name", "manifests"), RENDERED, ids=IDS)
def test_every_pod_runs_as_a_non_root_user_under_seccomp(name: str, manifests: list[Manifest]) -> None:
    assert deployments(manifests)
    for pod_name, pod in pods(manifests):
        security = pod["spec"]["securityContext"]
        assert security["runAsNonRoot"] is True, pod_name
        for field in ("runAsUser", "runAsGroup", "fsGroup"):
            assert isinstance(security[field], int) and security[field] == RUN_AS_ID >= 10000, (pod_name, field)
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}, pod_name
        spec = pod["spec"]
        assert not (spec.get("hostNetwork") or spec.get("hostPID") or spec.get("hostIPC")), pod_name
        assert not [v for v in spec.get("volumes", []) if "hostPath" in v], pod_name


@pytest.mark.parametrize(("name", "manifests"), RENDERED, ids=IDS)
def test_every_container_is_restricted_with_a_read_only_root(name: str, manifests: list[Manifest]) -> None:
    for pod_name, _, c in containers(manifests):
        where = f"{pod_name}/{c['name']}"
        security = c["securityContext"]
        assert security["allowPrivilegeEscalation"] is False, where
        assert security["readOnlyRootFilesystem"] is True, where
        assert security["capabilities"] == {"drop": ["ALL"]}, where  # and nothing added
        assert security.get("privileged") is not True and security.get("runAsUser", RUN_AS_ID) != 0, where


@pytest.mark.parametrize(("name", "manifests"), RENDERED, ids=IDS)
def test_what_a_process_writes_goes_to_an_empty_dir(name: str, manifests: list[Manifest]) -> None:
    for pod_name, pod, c in containers(manifests):
        empty_dirs = {v["name"] for v in pod["spec"]["volumes"] if "emptyDir" in v}
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        # the collector writes nothing: its spans go to its log or out to a backend
        writable = {"redis": ["/data"], "discovery": ["/tmp"], collector.CONTAINER_NAME: []}.get(c["name"])
        if writable is None:  # worker, router: /tmp and HOME (native kernels, caches)
            home = next(e["value"] for e in c["env"] if e["name"] == "HOME")
            writable = ["/tmp", home]
        for path in writable:
            assert mounts.get(path) in empty_dirs, f"{pod_name}/{c['name']}: {path} is not writable"


@pytest.mark.parametrize(("name", "manifests"), RENDERED, ids=IDS)
def test_only_the_discovery_sidecar_holds_a_service_account_token(name: str, manifests: list[Manifest]) -> None:
    for pod_name, pod in pods(manifests):
        assert pod["spec"]["automountServiceAccountToken"] is False, pod_name
        token_volumes = {
            v["name"]
            for v in pod["spec"]["volumes"]
            if any("serviceAccountToken" in source for source in v.get("projected", {}).get("sources", []))
        }
        holders = [c["name"] for c in pod["spec"]["containers"] for m in c.get("volumeMounts", [])
                   if m["name"] in token_volumes]  # fmt: skip
        assert holders == (
            ["discovery"] if pod["metadata"]["labels"]["app.kubernetes.io/component"] == "router" else []
        )
    router = component_of(manifests, "router")
    assert router is not None
    (sidecar,) = [c for c in router["spec"]["containers"] if c["name"] == "discovery"]
    assert any(m["mountPath"] == SERVICE_ACCOUNT_DIR and m.get("readOnly") for m in sidecar["volumeMounts"])
    for account in (m for m in manifests if m["kind"] == "ServiceAccount"):
        assert account["automountServiceAccountToken"] is False


@pytest.mark.parametrize(("name", "manifests"), RENDERED, ids=IDS)
def test_the_router_and_its_helpers_have_requests_and_limits(name: str, manifests: list[Manifest]) -> None:
    for _, _, c in containers(manifests):
        if c["name"] in ("router", "discovery", "redis"):
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind]), (c["name"], kind)


# ---------------------------------------------------------------------------------------------- secrets


@pytest.mark.parametrize(("name", "manifests"), RENDERED, ids=IDS)
def test_no_secret_is_a_literal_outside_the_endpoints_secret(name: str, manifests: list[Manifest]) -> None:
    (secret,) = [m for m in manifests if m["kind"] == "Secret"]
    values = decode_secret(secret)
    assert values[SECRET_KEY] and len(values[SECRET_KEY]) >= 32
    others = yaml.safe_dump_all([m for m in manifests if m is not secret])
    for key, value in values.items():
        assert value not in others, f"the {key} value is written outside its Secret"
    for pod_name, _, c in containers(manifests):
        for var in c.get("env", []):
            if var["name"] in SECRET_ENV:
                assert "value" not in var and "secretKeyRef" in var["valueFrom"], f"{pod_name}: {var['name']}"
        argv = " ".join([*c.get("command", []), *c.get("args", [])])
        assert not [value for value in values.values() if value in argv]
        assert "--api-key" not in argv and "requirepass " not in argv.replace("requirepass $", "")


@pytest.mark.parametrize(("name", "manifests"), RENDERED, ids=IDS)
def test_every_splitserve_container_gets_the_cluster_secret_from_the_secret(
    name: str, manifests: list[Manifest]
) -> None:
    (secret,) = [m for m in manifests if m["kind"] == "Secret"]
    reference = {"secretKeyRef": {"name": secret["metadata"]["name"], "key": SECRET_KEY}}
    assert secret["metadata"]["name"] == secret_name(secret["metadata"]["labels"]["app.kubernetes.io/instance"])
    seen = set()
    for pod_name, _, c in containers(manifests):
        env = {var["name"]: var for var in c.get("env", [])}
        if c["name"] in SPLITSERVE_CONTAINERS:  # a vLLM worker takes it as its key: the router sends it
            name = "VLLM_API_KEY" if c["command"] == ["vllm", "serve"] else "SPLITSERVE_CLUSTER_SECRET"
            assert env[name] == {"name": name, "valueFrom": reference}
            seen.add(c["name"])
        for var in env.values():  # every reference to this endpoint's Secret names a key it has
            ref = var.get("valueFrom", {}).get("secretKeyRef")
            if ref is not None and ref["name"] == secret["metadata"]["name"]:
                assert ref["key"] in secret["data"], f"{pod_name}: {var['name']}"
    assert seen == SPLITSERVE_CONTAINERS


def test_the_secret_is_random_per_render_unless_kept() -> None:
    config = load_endpoint(EXAMPLES["dpd"])
    first, second = render_yaml(config), render_yaml(config)
    assert first != second  # a new cluster secret each time: never derived from the resource
    kept = decode_secret(next(m for m in yaml.safe_load_all(first) if m and m["kind"] == "Secret"))
    assert render_yaml(config, secret_values=kept) == first


# ---------------------------------------------------------------------------------------------- the network


@dataclass(frozen=True)
class Peer:
    """One side of a connection: a pod of the endpoint (its labels), or an address outside it (no labels)."""

    labels: dict[str, str]

    @property
    def is_pod(self) -> bool:
        return bool(self.labels)


OUTSIDE = Peer({})


def selects(selector: Manifest, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels and In/NotIn/Exists matchExpressions) matches ``labels``."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        value, operator = labels.get(expression["key"]), expression["operator"]
        ok = {"In": value in expression.get("values", []), "NotIn": value not in expression.get("values", []),
              "Exists": value is not None, "DoesNotExist": value is None}[operator]  # fmt: skip
        if not ok:
            return False
    return True


def rule_admits(rule: Manifest, peer_key: str, peer: Peer, port: int, protocol: str) -> bool:
    ports = rule.get("ports")
    if ports is not None and not any(p["port"] == port and p.get("protocol", "TCP") == protocol for p in ports):
        return False
    peers = rule.get(peer_key)
    if peers is None:
        return True  # any address
    for entry in peers:
        assert set(entry) == {"podSelector"}, f"only same-namespace pod peers are rendered: {entry}"
        if peer.is_pod and selects(entry["podSelector"], peer.labels):
            return True
    return False


def allowed(policies: list[Manifest], src: Peer, dst: Peer, port: int, protocol: str = "TCP") -> bool:
    """Whether the policies let ``src`` open ``port`` on ``dst`` (Kubernetes' rules: a pod selected by a policy
    of a direction admits only what some such policy's rules allow; the others admit everything)."""
    return _side(policies, "Egress", "egress", "to", src, dst, port, protocol) and _side(
        policies, "Ingress", "ingress", "from", dst, src, port, protocol
    )


def _side(policies: list[Manifest], kind: str, rules_key: str, peer_key: str, pod: Peer, peer: Peer, port: int,
          protocol: str) -> bool:  # fmt: skip
    if not pod.is_pod:
        return True  # outside the endpoint: no policy of ours applies
    governing = [
        p for p in policies if kind in p["spec"]["policyTypes"] and selects(p["spec"]["podSelector"], pod.labels)
    ]
    if not governing:
        return True
    rules = [rule for p in governing for rule in p["spec"].get(rules_key, [])]
    return any(rule_admits(rule, peer_key, peer, port, protocol) for rule in rules)


def peer_of(manifests: list[Manifest], component: str) -> Peer | None:
    pod = component_of(manifests, component)
    return None if pod is None else Peer(pod["metadata"]["labels"])


def http_port(manifests: list[Manifest], component: str) -> int:
    pod = component_of(manifests, component)
    assert pod is not None
    return int(pod["spec"]["containers"][0]["ports"][0]["containerPort"])


@pytest.mark.parametrize(("name", "manifests"), RENDERED, ids=IDS)
def test_a_default_deny_covers_every_pod_of_the_endpoint(name: str, manifests: list[Manifest]) -> None:
    policies = [m for m in manifests if m["kind"] == "NetworkPolicy"]
    (deny,) = [p for p in policies if p["metadata"]["name"].endswith("-default-deny")]
    assert set(deny["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    assert "ingress" not in deny["spec"] and "egress" not in deny["spec"]
    for pod_name, pod in pods(manifests):
        assert selects(deny["spec"]["podSelector"], pod["metadata"]["labels"]), pod_name
    for policy in policies:  # every policy is the endpoint's and governs both directions of what it selects
        instance = policy["metadata"]["labels"]["app.kubernetes.io/instance"]
        assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == instance
        assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}


@pytest.mark.parametrize(("name", "manifests"), RENDERED, ids=IDS)
def test_clients_reach_the_router_only(name: str, manifests: list[Manifest]) -> None:
    policies = [m for m in manifests if m["kind"] == "NetworkPolicy"]
    router = peer_of(manifests, "router")
    assert router is not None and allowed(policies, OUTSIDE, router, 8080)
    assert not allowed(policies, OUTSIDE, router, 8081)  # the admin listener is the pod's own (loopback)
    for component in ("worker", "prefill", "decode", "redis"):
        target = peer_of(manifests, component)
        if target is None:
            continue
        for _, _, c in containers(manifests):
            for port in (p["containerPort"] for p in c.get("ports", [])):
                assert not allowed(policies, OUTSIDE, target, port), f"outside -> {component}:{port}"


@pytest.mark.parametrize(("name", "manifests"), RENDERED, ids=IDS)
def test_the_router_reaches_only_the_workers_http_port(name: str, manifests: list[Manifest]) -> None:
    policies = [m for m in manifests if m["kind"] == "NetworkPolicy"]
    router = peer_of(manifests, "router")
    assert router is not None
    workers = [c for c in ("worker", "prefill", "decode") if peer_of(manifests, c) is not None]
    assert workers
    for component in workers:
        worker = peer_of(manifests, component)
        assert worker is not None
        port = http_port(manifests, component)
        assert allowed(policies, router, worker, port), component
        assert not allowed(policies, router, worker, kv_transfer_port(port)), component
    redis = peer_of(manifests, "redis")
    assert redis is None or not allowed(policies, router, redis, 6379)
    assert not allowed(policies, router, OUTSIDE, 80) and allowed(policies, router, OUTSIDE, DNS, "UDP")
    assert allowed(policies, router, OUTSIDE, 443)  # the API server, for the discovery sidecar


def runs_vllm(manifests: list[Manifest]) -> bool:
    worker = component_of(manifests, "worker")
    return worker is not None and worker["spec"]["containers"][0]["command"] == ["vllm", "serve"]


VLLM_RENDERED = [(name, manifests) for name, manifests in RENDERED if runs_vllm(manifests)]


def test_some_rendered_resource_runs_vllm_workers() -> None:
    assert VLLM_RENDERED, "no resource with vLLM workers: the test below would check nothing"


@pytest.mark.parametrize(("name", "manifests"), VLLM_RENDERED, ids=[name for name, _ in VLLM_RENDERED])
def test_vllm_workers_kv_event_sockets_are_the_routers_alone(name: str, manifests: list[Manifest]) -> None:
    policies = [m for m in manifests if m["kind"] == "NetworkPolicy"]
    worker = component_of(manifests, "worker")
    assert worker is not None
    ports = {p["name"]: p["containerPort"] for p in worker["spec"]["containers"][0]["ports"]}
    router, peer = peer_of(manifests, "router"), Peer(worker["metadata"]["labels"])
    assert router is not None
    for port in (ports.get("kv-events"), ports.get("kv-replay")):
        if port is not None:  # under a kvaware router only
            assert allowed(policies, router, peer, port)
            assert not allowed(policies, OUTSIDE, peer, port) and not allowed(policies, peer, peer, port)
    client_keys = [e for e in worker["spec"]["containers"][0]["env"] if e["name"] == "SPLITSERVE_API_KEY"]
    assert not client_keys  # the router checks the clients' keys; vLLM's key is the cluster secret


@pytest.mark.parametrize(("name", "manifests"), RENDERED, ids=IDS)
def test_prefill_pods_reach_only_the_decode_kv_port(name: str, manifests: list[Manifest]) -> None:
    policies = [m for m in manifests if m["kind"] == "NetworkPolicy"]
    prefill, decode = peer_of(manifests, "prefill"), peer_of(manifests, "decode")
    if prefill is None or decode is None:
        pytest.skip("colocated")
    port = http_port(manifests, "decode")
    assert allowed(policies, prefill, decode, kv_transfer_port(port))
    assert not allowed(policies, prefill, decode, port)
    assert not allowed(policies, decode, prefill, port) and not allowed(
        policies, decode, decode, kv_transfer_port(port)
    )
    assert not allowed(policies, prefill, prefill, kv_transfer_port(port))
    assert not allowed(policies, prefill, OUTSIDE, kv_transfer_port(port))  # nowhere but a decode pod


@pytest.mark.parametrize(("name", "manifests"), RENDERED, ids=IDS)
def test_workers_reach_only_redis_dns_and_the_routers_events(name: str, manifests: list[Manifest]) -> None:
    policies = [m for m in manifests if m["kind"] == "NetworkPolicy"]
    redis, router = peer_of(manifests, "redis"), peer_of(manifests, "router")
    assert router is not None
    takes_events = any("--kv-events-url" in c["args"] for _, _, c in containers(manifests) if c["name"] == "worker")
    outside_redis = next((int(a.rsplit(":", 1)[1].split("/")[0]) for _, _, c in containers(manifests)
                          for a in c.get("args", []) if a.startswith("redis://r:")), None)  # fmt: skip
    for component in ("worker", "prefill", "decode"):
        worker = peer_of(manifests, component)
        if worker is None:
            continue
        assert allowed(policies, worker, OUTSIDE, DNS, "UDP")
        assert allowed(policies, worker, router, 8080) == takes_events
        assert not allowed(policies, worker, OUTSIDE, 443) and not allowed(policies, worker, OUTSIDE, 6379)
        if redis is not None:
            assert allowed(policies, worker, redis, 6379)
        if outside_redis is not None:
            assert allowed(policies, worker, OUTSIDE, outside_redis)
    if redis is not None:
        assert not allowed(policies, redis, OUTSIDE, DNS, "UDP") and not allowed(policies, redis, router, 8080)


# ---------------------------------------------------------------------------------------------- the operator


def test_the_operator_is_namespaced_by_default_and_claims_no_wildcard() -> None:
    manifests = install_manifests(namespace="ops")
    cluster_scoped = [m["kind"] for m in manifests if "namespace" not in m["metadata"]]
    assert cluster_scoped == ["CustomResourceDefinition"]  # no ClusterRole, no ClusterRoleBinding
    for manifest in manifests:
        for rule in manifest.get("rules", []):
            assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
    (operator,) = deployments(manifests)
    pod = operator["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == RUN_AS_ID
    (c,) = pod["containers"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True and c["securityContext"]["capabilities"] == {
        "drop": ["ALL"]
    }
    wide = install_manifests(namespace="ops", cluster_wide=True)
    assert {m["kind"] for m in wide if "namespace" not in m["metadata"]} == {
        "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------- a policy tool


def checkov() -> str | None:
    return os.environ.get("SPLITSERVE_CHECKOV") or shutil.which("checkov")


@pytest.mark.slow
@pytest.mark.skipif(checkov() is None, reason="checkov is not installed (see the module's docstring)")
def test_checkov_passes_the_rendered_manifests(tmp_path: Path) -> None:
    endpoints, operator = tmp_path / "endpoints", tmp_path / "operator"
    endpoints.mkdir()
    operator.mkdir()
    for name, config in resources():
        (endpoints / f"{name}.yaml").write_text(render_yaml(config))
    (operator / "operator.yaml").write_text(yaml.safe_dump_all(install_manifests(namespace="ops")[1:]))
    operator_skips = {**CHECKOV_SKIPPED, "CKV_K8S_38": "service-account token: the operator talks to the API"}
    for directory, skipped in ((endpoints, CHECKOV_SKIPPED), (operator, operator_skips)):
        command = [str(checkov()), "-d", str(directory), "--framework", "kubernetes", "--compact", "--quiet",
                   "--skip-check", ",".join(skipped)]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]

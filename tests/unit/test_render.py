"""Kubernetes manifests for an endpoint (``splitserve render``) and the CRD: every example renders to objects the
Kubernetes schemas accept, and what a user checks with ``kubectl`` (labels, probes, ports, env, args) is there."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from splitserve.cli import app
from splitserve.deploy import collector
from splitserve.deploy.crd import CRD_PATH, crd, crd_yaml, openapi_schema
from splitserve.deploy.plan import Target, plan
from splitserve.deploy.render import (
    DEFAULT_IMAGE,
    LABEL_ROLE,
    ROUTER_ADMIN_PORT,
    ROUTER_PORT,
    SECRET_HASH_ANNOTATION,
    decode_secret,
    in_cluster_redis_url,
    kv_transfer_port,
    render,
    render_yaml,
    secret_name,
    worker_selector,
)
from splitserve.endpoint import EndpointError, InferenceEndpointConfig, load_endpoint, parse_endpoint

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))
EXAMPLE = {path.stem: path for path in EXAMPLES}
K8S_VERSION = "1.30"  # the oldest Kubernetes the manifests are checked against
VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def example(name: str) -> InferenceEndpointConfig:
    return load_endpoint(EXAMPLE[name])


def example_data(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(EXAMPLE[name].read_text())
    return data


def find(manifests: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name} not rendered once: {names(manifests)}"
    return matches[0]


def names(manifests: list[dict[str, Any]], kind: str | None = None) -> list[str]:
    return [f"{m['kind']}/{m['metadata']['name']}" for m in manifests if kind in (None, m["kind"])]


def container(deployment: dict[str, Any], name: str = "worker") -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == name)


def value_after(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} not in {args}"
    return args[len(args) - 1 - args[::-1].index(flag) + 1]


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def expanded(c: dict[str, Any]) -> list[str]:
    """The container's args as Kubernetes runs them: ``$(VAR)`` replaced from the env (a fake pod IP/name)."""
    pod = {"status.podIP": "10.1.2.3", "metadata.name": "pod-0", "metadata.namespace": "default"}
    env = {}
    for name, value in env_of(c).items():
        if isinstance(value, dict) and "fieldRef" in value:
            env[name] = pod[value["fieldRef"]["fieldPath"]]
        elif not isinstance(value, dict):
            env[name] = value
    return [VAR.sub(lambda m: env[m.group(1)], arg) for arg in c["args"]]


SECRETS = {"cluster-secret": "s" * 43, "redis-password": "r" * 43}  # fixed values: renders compare equal


def cli_command(name: str) -> Any:
    return typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]


def rendered_examples() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    for path in EXAMPLES:
        yield path.stem, render(load_endpoint(path), secret_values=SECRETS)


# ---------------------------------------------------------------------------------------------- every example


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_renders_manifests_the_kubernetes_schemas_accept(path: Path) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    manifests = render(load_endpoint(path))
    for manifest in manifests:
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)  # raises ValidationError


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_is_internally_consistent(path: Path) -> None:
    """What a schema cannot check: selectors select their pods, named ports exist, $(VARS) are defined."""
    manifests = render(load_endpoint(path))
    assert len(set(names(manifests))) == len(manifests)
    deployments = [m for m in manifests if m["kind"] == "Deployment"]
    for deployment in deployments:
        pod = deployment["spec"]["template"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        for c in pod["spec"]["containers"]:
            port_names = {p["name"] for p in c.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in c:
                    action = c[probe].get("httpGet") or c[probe].get("tcpSocket")
                    assert action["port"] in port_names
            defined = set(env_of(c))
            assert {v for arg in c.get("args", []) for v in VAR.findall(arg)} <= defined
            volumes = {v["name"] for v in pod["spec"].get("volumes", [])}
            assert {m["name"] for m in c.get("volumeMounts", [])} <= volumes
    for service in (m for m in manifests if m["kind"] == "Service"):
        selected = [d for d in deployments if service["spec"]["selector"].items() <= _pod_labels(d).items()]
        assert len(selected) == 1, f"Service/{service['metadata']['name']} selects {len(selected)} Deployments"
        containers = selected[0]["spec"]["template"]["spec"]["containers"]
        pod_ports = {p["name"] for c in containers for p in c.get("ports", [])}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= pod_ports


def _pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = deployment["spec"]["template"]["metadata"]["labels"]
    return labels


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_container_command_is_one_the_real_cli_accepts(path: Path) -> None:
    manifests = render(load_endpoint(path))
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    for deployment in (m for m in manifests if m["kind"] == "Deployment"):
        for c in deployment["spec"]["template"]["spec"]["containers"]:
            if c.get("command", [""])[0] != "splitserve":
                continue  # redis
            name = c["command"][1]
            if name not in commands:
                assert name == "k8s-discovery", f"splitserve {name} does not exist"
                continue  # registered in cli.py separately
            commands[name].make_context(name, expanded(c))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_render_yaml_is_the_manifests_as_multi_document_yaml(path: Path) -> None:
    config = load_endpoint(path)
    text = render_yaml(config, secret_values=SECRETS)
    assert list(yaml.safe_load_all(text)) == render(config, secret_values=SECRETS)
    assert "&id" not in text and "*id" not in text  # no YAML aliases: every object is its own
    for warning in plan(config, Target.KUBERNETES, redis_url=in_cluster_redis_url(config)).warnings:
        assert f"# warning: {warning}\n" in text


# ---------------------------------------------------------------------------------------------- the shape


def test_dpd_renders_prefill_decode_router_and_the_routers_rbac() -> None:
    manifests = render(example("dpd"))
    assert names(manifests) == [
        "Secret/dpd-cluster-secret",
        "NetworkPolicy/dpd-default-deny",
        "NetworkPolicy/dpd-router",
        "NetworkPolicy/dpd-prefill",
        "NetworkPolicy/dpd-decode",
        "ServiceAccount/dpd-router",
        "Role/dpd-router",
        "RoleBinding/dpd-router",
        "Deployment/prefill-dpd",
        "Service/prefill-dpd",
        "Deployment/decode-dpd",
        "Service/decode-dpd",
        "Deployment/dpd-router",
        "Service/dpd-router",
    ]
    assert all(m["metadata"]["namespace"] == "default" for m in manifests)


def test_toggling_pd_spec_swaps_the_colocated_deployment_for_prefill_and_decode() -> None:
    data = example_data("dpd")
    with_pd = render(parse_endpoint(data))
    del data["spec"]["pdSpec"]
    without_pd = render(parse_endpoint(data))
    assert names(with_pd, "Deployment") == ["Deployment/prefill-dpd", "Deployment/decode-dpd", "Deployment/dpd-router"]
    assert names(without_pd, "Deployment") == ["Deployment/dpd", "Deployment/dpd-router"]
    assert names(without_pd, "Service") == ["Service/dpd", "Service/dpd-router"]
    router_args = container(find(without_pd, "Deployment", "dpd-router"), "router")["args"]
    assert "--backend" in router_args and "--decode" not in router_args
    assert "--routing-threshold" not in router_args


def test_pod_labels_carry_the_role_and_the_recommended_app_labels() -> None:
    manifests = render(example("dpd"))
    for name, component in (("prefill-dpd", "prefill"), ("decode-dpd", "decode"), ("dpd-router", "router")):
        labels = _pod_labels(find(manifests, "Deployment", name))
        assert labels["app.kubernetes.io/name"] == "splitserve"
        assert labels["app.kubernetes.io/instance"] == "dpd"
        assert labels["app.kubernetes.io/component"] == component
        assert labels.get(LABEL_ROLE) == (component if component != "router" else None)
    colocated = _pod_labels(find(render(example("colocated")), "Deployment", "colocated"))
    assert colocated["app.kubernetes.io/component"] == "worker" and LABEL_ROLE not in colocated


def test_the_reference_api_group_adds_the_reference_systems_role_label_too() -> None:
    labels = _pod_labels(find(render(example("reference")), "Deployment", "decode-dpd-test"))
    assert labels[LABEL_ROLE] == "decode"
    assert labels["inference.sagemaker.aws.amazon.com/dpd-role"] == "decode"


def test_the_resources_labels_reach_every_object_without_overriding_ours() -> None:
    data = example_data("colocated")
    data["metadata"]["labels"] = {"team": "search", "app.kubernetes.io/component": "mine"}
    manifests = render(parse_endpoint(data))
    for m in manifests:
        assert m["metadata"]["labels"]["team"] == "search"
        assert m["metadata"]["labels"]["app.kubernetes.io/component"] != "mine"


def test_workers_run_the_plans_flags_bound_to_their_container_port() -> None:
    config = example("dpd")
    endpoint_plan = plan(config, Target.KUBERNETES)
    manifests = render(config)
    for role in endpoint_plan.roles:
        c = container(find(manifests, "Deployment", role.name))
        assert c["command"] == ["splitserve", "worker"]
        assert c["args"][: len(role.flags)] == list(role.flags)
        assert value_after(c["args"], "--port") == "8000"
        assert value_after(c["args"], "--advertise-url") == "http://$(SPLITSERVE_POD_IP):8000"
        assert value_after(c["args"], "--worker-id") == "$(SPLITSERVE_POD_NAME)"
        assert env_of(c)["SPLITSERVE_POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    prefill = container(find(manifests, "Deployment", "prefill-dpd"))
    decode = container(find(manifests, "Deployment", "decode-dpd"))
    assert value_after(prefill["args"], "--host") == "0.0.0.0"
    assert value_after(decode["args"], "--host") == "$(SPLITSERVE_POD_IP)"  # the KV receiver advertises its bind
    assert (value_after(prefill["args"], "--max-num-seqs"), value_after(decode["args"], "--max-num-seqs")) == (
        "16",
        "32",
    )
    assert value_after(prefill["args"], "--max-model-len") == value_after(decode["args"], "--max-model-len") == "8192"


def test_decode_workers_expose_a_fixed_kv_transfer_port_in_pod_and_service() -> None:
    manifests = render(example("dpd"))
    decode = container(find(manifests, "Deployment", "decode-dpd"))
    assert value_after(decode["args"], "--kv-transfer-port") == "8001"
    assert {"name": "kv-transfer", "containerPort": 8001, "protocol": "TCP"} in decode["ports"]
    service_ports = find(manifests, "Service", "decode-dpd")["spec"]["ports"]
    assert {"name": "kv-transfer", "port": 8001, "targetPort": "kv-transfer"} in service_ports
    prefill = container(find(manifests, "Deployment", "prefill-dpd"))
    assert "--kv-transfer-port" not in prefill["args"] and len(prefill["ports"]) == 1
    assert kv_transfer_port(8000) == 8001 and kv_transfer_port(65535) == 65534


def test_workers_are_probed_on_the_health_path_and_the_router_is_not_killed_for_sick_workers() -> None:
    data = example_data("colocated")
    data["spec"]["worker"]["modelInvocationPort"] = {"name": "api", "containerPort": 9000}
    manifests = render(parse_endpoint(data))
    worker = container(find(manifests, "Deployment", "colocated"))
    assert worker["ports"] == [{"name": "api", "containerPort": 9000, "protocol": "TCP"}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert worker[probe]["httpGet"] == {"path": "/health", "port": "api"}
    assert worker["startupProbe"]["periodSeconds"] * worker["startupProbe"]["failureThreshold"] >= 300  # model load
    router = container(find(manifests, "Deployment", "colocated-router"), "router")
    assert router["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert "tcpSocket" in router["livenessProbe"]  # its /health is 503 while no worker is healthy
    service_port = find(manifests, "Service", "colocated")["spec"]["ports"][0]
    assert service_port == {"name": "api", "port": 9000, "targetPort": "api"}


def test_environment_variables_reach_both_roles_after_the_downward_api_ones() -> None:
    manifests = render(example("dpd"))
    for name in ("prefill-dpd", "decode-dpd"):
        env = container(find(manifests, "Deployment", name))["env"]
        assert [e["name"] for e in env] == [
            "SPLITSERVE_POD_NAME",
            "SPLITSERVE_POD_IP",
            "SPLITSERVE_POD_NAMESPACE",
            "HOME",
            "SPLITSERVE_CLUSTER_SECRET",
            "PD_BUFFER_SIZE",
            "LMCACHE_SAVE_DECODE_CACHE",
        ]
        assert env[5:] == [
            {"name": "PD_BUFFER_SIZE", "value": "1073741824"},
            {"name": "LMCACHE_SAVE_DECODE_CACHE", "value": "False"},
        ]
    router_env = container(find(manifests, "Deployment", "dpd-router"), "router")["env"]
    assert [e["name"] for e in router_env] == ["HOME", "SPLITSERVE_CLUSTER_SECRET"]  # worker variables stay there


def test_secret_key_refs_in_the_environment_reach_the_pods_as_references() -> None:
    data = example_data("dpd")
    data["spec"]["worker"]["environmentVariables"] += [
        {"name": "SPLITSERVE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "client-keys", "key": "main"}}},
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token", "optional": True}}},
    ]
    manifests = render(parse_endpoint(data))
    api_key = {"secretKeyRef": {"name": "client-keys", "key": "main"}}
    for name in ("prefill-dpd", "decode-dpd"):
        env = env_of(container(find(manifests, "Deployment", name)))
        assert env["SPLITSERVE_API_KEY"] == api_key
        assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token", "optional": True}}
    router = env_of(container(find(manifests, "Deployment", "dpd-router"), "router"))
    assert router["SPLITSERVE_API_KEY"] == api_key and "HF_TOKEN" not in router  # the router checks client keys


def test_resources_are_per_role_and_the_top_level_ones_are_not_used_for_pd_pods() -> None:
    manifests = render(example("reference"))
    for name in ("prefill-dpd-test", "decode-dpd-test"):
        resources = container(find(manifests, "Deployment", name))["resources"]
        assert resources == {"requests": {"cpu": "1", "memory": "3Gi"}, "limits": {"cpu": "1", "memory": "6Gi"}}
    colocated = container(find(render(example("colocated")), "Deployment", "colocated"))
    assert colocated["resources"]["limits"] == {"cpu": "2", "memory": "4Gi"}
    assert value_after(colocated["args"], "--num-threads") == "2"


def test_replicas_come_from_each_role() -> None:
    data = example_data("dpd")
    data["spec"]["pdSpec"]["prefillSpec"]["replicas"] = 3
    data["spec"]["pdSpec"]["decodingSpec"]["replicas"] = 2
    manifests = render(parse_endpoint(data))
    replicas = {m["metadata"]["name"]: m["spec"]["replicas"] for m in manifests if m["kind"] == "Deployment"}
    assert replicas == {"prefill-dpd": 3, "decode-dpd": 2, "dpd-router": 1}
    assert find(render(example("kvaware")), "Deployment", "kvaware")["spec"]["replicas"] == 2
    assert not [m for m in manifests if m["kind"] == "PodDisruptionBudget"]  # one router: nothing to keep up


def test_an_autoscaled_role_gets_a_horizontal_pod_autoscaler_that_owns_its_replicas() -> None:
    manifests = render(example("autoscaling"))
    workers = find(manifests, "Deployment", "autoscaling")
    assert "replicas" not in workers["spec"]  # a re-apply must not set back what the autoscaler chose
    hpa = find(manifests, "HorizontalPodAutoscaler", "autoscaling")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "autoscaling"}
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (1, 2)
    pods, router = hpa["metrics"]
    assert pods["pods"] == {"metric": {"name": "splitserve_requests_in_flight"},
                            "target": {"type": "AverageValue", "averageValue": "4"}}  # fmt: skip
    assert router["object"]["describedObject"] == {"apiVersion": "v1", "kind": "Service", "name": "autoscaling-router"}
    assert router["object"]["target"] == {"type": "Value", "value": "2"}
    assert hpa["behavior"]["scaleDown"] == {"stabilizationWindowSeconds": 30}
    data = example_data("dpd")
    data["spec"]["autoscaling"] = {"decode": {"maxReplicas": 3, "targetConcurrency": 12.5}}
    manifests = render(parse_endpoint(data))
    assert [m["metadata"]["name"] for m in manifests if m["kind"] == "HorizontalPodAutoscaler"] == ["decode-dpd"]
    decode = find(manifests, "HorizontalPodAutoscaler", "decode-dpd")["spec"]["metrics"][0]["pods"]["target"]
    assert decode["averageValue"] == "12500m"
    assert find(manifests, "Deployment", "prefill-dpd")["spec"]["replicas"] == 1  # not scaled: the resource's
    data["spec"]["autoscaling"]["prefill"] = {"maxReplicas": 2, "decodeRatio": 0.5}
    manifests = render(parse_endpoint(data))
    assert [m["metadata"]["name"] for m in manifests if m["kind"] == "HorizontalPodAutoscaler"] == ["decode-dpd"]
    assert "replicas" not in find(manifests, "Deployment", "prefill-dpd")["spec"]  # the operator's (decodeRatio)
    # decode then scales by every request the router has in flight: those still in prefill decode next
    (metric,) = find(manifests, "HorizontalPodAutoscaler", "decode-dpd")["spec"]["metrics"]
    assert metric["object"]["metric"]["name"] == "splitserve_endpoint_requests_in_flight"
    assert metric["object"]["describedObject"] == {"apiVersion": "v1", "kind": "Service", "name": "dpd-router"}
    assert metric["object"]["target"] == {"type": "AverageValue", "averageValue": "12500m"}


def test_router_replicas_leave_one_at_a_time_and_spread_over_nodes() -> None:
    manifests = render(example("kvaware"))  # spec.router.replicas: 2
    router = find(manifests, "Deployment", "kvaware-router")
    assert router["spec"]["replicas"] == 2
    budget = find(manifests, "PodDisruptionBudget", "kvaware-router")
    assert budget["spec"] == {"maxUnavailable": 1, "selector": router["spec"]["selector"]}
    assert budget["spec"]["selector"]["matchLabels"].items() <= router["spec"]["template"]["metadata"]["labels"].items()
    spread = router["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    term = spread["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term == {"labelSelector": router["spec"]["selector"], "topologyKey": "kubernetes.io/hostname"}
    # each replica lists the workers itself (its own discovery sidecar) and pulls their KV events itself
    assert [c["name"] for c in router["spec"]["template"]["spec"]["containers"]][:2] == ["router", "discovery"]


def test_the_image_is_the_resources_or_the_documented_default() -> None:
    pods = [m["spec"]["template"]["spec"] for m in render(example("dpd")) if m["kind"] == "Deployment"]
    images = {c["image"] for pod in pods for c in pod["containers"]}
    assert images == {DEFAULT_IMAGE} == {"splitserve:latest"}
    reference = render(example("reference"))
    image = example_data("reference")["spec"]["worker"]["image"]
    assert container(find(reference, "Deployment", "decode-dpd-test"))["image"] == image
    assert container(find(reference, "Deployment", "dpd-test-router"), "router")["image"] == image
    router = find(render(example("dpd"), default_image="me/ss:1"), "Deployment", "dpd-router")
    assert container(router, "discovery")["image"] == container(router, "router")["image"] == "me/ss:1"


def test_the_model_volume_is_mounted_in_workers_and_router() -> None:
    manifests = render(example("reference"))
    for name, c in (("decode-dpd-test", "worker"), ("dpd-test-router", "router")):
        deployment = find(manifests, "Deployment", name)
        mount = {"name": "model-weights", "mountPath": "/opt/ml/model", "readOnly": True}
        assert container(deployment, c)["volumeMounts"][0] == mount
        volume = {"name": "model-weights", "persistentVolumeClaim": {"claimName": "model-weights", "readOnly": True}}
        assert deployment["spec"]["template"]["spec"]["volumes"][0] == volume
    prefill = container(find(manifests, "Deployment", "prefill-dpd-test"))
    assert value_after(prefill["args"], "--model") == "/opt/ml/model"
    volumes = find(render(example("dpd")), "Deployment", "prefill-dpd")["spec"]["template"]["spec"]["volumes"]
    assert "model-weights" not in {v["name"] for v in volumes}


def test_an_s3_model_without_a_volume_is_an_error_not_a_broken_manifest() -> None:
    data = example_data("dpd")
    data["spec"]["modelSourceConfig"] = {"modelSourceType": "s3", "modelLocation": "models/llama"}
    with pytest.raises(EndpointError, match=r"spec\.worker\.modelVolumeMount is required"):
        render(parse_endpoint(data))


# ---------------------------------------------------------------------------------------------- KV cache tiers


def test_redis_without_a_url_gets_its_own_redis_in_the_cluster() -> None:
    manifests = render(example("dpd-redis"))
    assert "Deployment/dpd-redis-redis" in names(manifests) and "Service/dpd-redis-redis" in names(manifests)
    url = "redis://dpd-redis-redis.default.svc:6379/0"
    assert in_cluster_redis_url(example("dpd-redis")) == url
    for name in ("prefill-dpd-redis", "decode-dpd-redis"):
        args = container(find(manifests, "Deployment", name))["args"]
        assert value_after(args, "--l2-url") == url and "--l1-cache" in args


def test_a_redis_url_in_the_resource_is_used_as_is() -> None:
    data = example_data("dpd-redis")
    data["spec"]["kvCacheSpec"]["l2CacheSpec"]["l2CacheLocalUrl"] = "redis://cache.infra:6379/2"
    manifests = render(parse_endpoint(data))
    assert not [n for n in names(manifests) if n.endswith("-redis-redis")]
    args = container(find(manifests, "Deployment", "decode-dpd-redis"))["args"]
    assert value_after(args, "--l2-url") == "redis://cache.infra:6379/2"


def test_tieredstorage_gets_a_directory_volume_at_its_path() -> None:
    data = example_data("colocated")
    data["spec"]["kvCacheSpec"] = {
        "enableL2Cache": True,
        "l2CacheSpec": {"l2CacheBackend": "tieredstorage", "l2CachePath": "/cache/l2"},
    }
    deployment = find(render(parse_endpoint(data)), "Deployment", "colocated")
    assert value_after(container(deployment)["args"], "--l2-path") == "/cache/l2"
    assert {"name": "l2-cache", "mountPath": "/cache/l2"} in container(deployment)["volumeMounts"]
    assert {"name": "l2-cache", "emptyDir": {}} in deployment["spec"]["template"]["spec"]["volumes"]


# ---------------------------------------------------------------------------------------------- the Secret


def test_each_endpoint_gets_a_secret_of_its_own_made_once_and_kept_when_given() -> None:
    config = example("dpd")
    first, second = render(config), render(config)
    secret = find(first, "Secret", secret_name("dpd"))
    assert secret["metadata"]["name"] == "dpd-cluster-secret" and secret["type"] == "Opaque"
    values = decode_secret(secret)
    assert set(values) == {"cluster-secret"} and len(values["cluster-secret"]) >= 43  # 32 random bytes
    assert values != decode_secret(find(second, "Secret", "dpd-cluster-secret"))  # random, not derived
    kept = render(config, secret_values=values)
    assert decode_secret(find(kept, "Secret", "dpd-cluster-secret")) == values
    assert kept == render(config, secret_values={**values, "stale": "x"})  # what the endpoint does not use goes


def test_pods_roll_when_the_secret_changes_and_only_then() -> None:
    def hashes(manifests: list[dict[str, Any]]) -> set[str]:
        pods = [m["spec"]["template"] for m in manifests if m["kind"] == "Deployment"]
        return {pod["metadata"]["annotations"][SECRET_HASH_ANNOTATION] for pod in pods}

    config = example("dpd-redis")
    same = hashes(render(config, secret_values=SECRETS))
    assert len(same) == 1 and same == hashes(render(config, secret_values=dict(SECRETS)))
    rotated = hashes(render(config, secret_values={**SECRETS, "redis-password": "new"}))
    assert len(rotated) == 1 and rotated != same
    assert SECRETS["cluster-secret"] not in str(same)


def test_the_endpoints_redis_takes_its_password_from_the_secret_on_stdin() -> None:
    manifests = render(example("dpd-redis"), secret_values=SECRETS)
    assert set(decode_secret(find(manifests, "Secret", "dpd-redis-cluster-secret"))) == {
        "cluster-secret",
        "redis-password",
    }
    redis = container(find(manifests, "Deployment", "dpd-redis-redis"), "redis")
    assert redis["command"][:2] == ["sh", "-c"] and "requirepass $REDIS_PASSWORD" in redis["command"][2]
    assert "redis-server" in redis["command"][2] and "$@" in redis["command"][2]  # the args follow
    ref = {"secretKeyRef": {"name": "dpd-redis-cluster-secret", "key": "redis-password"}}
    assert env_of(redis) == {"REDIS_PASSWORD": ref}
    for name in ("prefill-dpd-redis", "decode-dpd-redis"):
        assert env_of(container(find(manifests, "Deployment", name)))["SPLITSERVE_REDIS_PASSWORD"] == ref
    assert SECRETS["redis-password"] not in str([m for m in manifests if m["kind"] != "Secret"])


def test_the_redis_script_gives_redis_server_the_password_and_the_args(tmp_path: Path) -> None:
    """The Redis container's shell script, run with a stand-in redis-server that reports what it got."""
    import os
    import shutil
    import subprocess

    if shutil.which("sh") is None:
        pytest.skip("no sh")
    fake = tmp_path / "redis-server"
    fake.write_text('#!/bin/sh\necho "argv: $*"\ncat\n')
    fake.chmod(0o755)
    redis = container(find(render(example("dpd-redis")), "Deployment", "dpd-redis-redis"), "redis")
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "REDIS_PASSWORD": "pw-123"}
    out = subprocess.run([*redis["command"], *redis["args"]], env=env, capture_output=True, text=True, timeout=10)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"argv: {' '.join(redis['args'])} -", "requirepass pw-123"]
    assert "pw-123" not in out.stdout.splitlines()[0]  # never in argv


# ---------------------------------------------------------------------------------------------- router


def test_the_router_runs_the_plans_flags_with_the_worker_services_until_discovery_updates_it() -> None:
    config = example("dpd")
    router_plan = plan(config, Target.KUBERNETES).router
    router = container(find(render(config), "Deployment", "dpd-router"), "router")
    assert router["command"] == ["splitserve", "router"]
    assert router["args"] == [
        *router_plan.flags,
        "--host",
        "0.0.0.0",
        "--port",
        str(ROUTER_PORT),
        "--admin-port",
        str(ROUTER_ADMIN_PORT),
        "--shutdown-timeout",
        "30",
        "--prefill",
        "http://prefill-dpd.default.svc:8000",
        "--decode",
        "http://decode-dpd.default.svc:8000",
    ]


def test_workers_and_the_router_drain_within_their_grace_period() -> None:
    manifests = render(example("dpd"))
    for name, kind in (("prefill-dpd", "worker"), ("decode-dpd", "worker"), ("dpd-router", "router")):
        pod = find(manifests, "Deployment", name)["spec"]["template"]["spec"]
        main = container(find(manifests, "Deployment", name), kind)
        drain_s = int(value_after(main["args"], "--shutdown-timeout"))
        pause_s = int(main["lifecycle"]["preStop"]["exec"]["command"][1])
        assert pod["terminationGracePeriodSeconds"] > pause_s + drain_s  # SIGKILL only after the drain


def test_the_discovery_sidecar_lists_this_endpoints_worker_pods_with_its_own_service_account() -> None:
    config = example("dpd")
    manifests = render(config)
    pod = find(manifests, "Deployment", "dpd-router")["spec"]["template"]["spec"]
    sidecar = container(find(manifests, "Deployment", "dpd-router"), "discovery")
    assert sidecar["command"] == ["splitserve", "k8s-discovery"]
    assert value_after(sidecar["args"], "--selector") == worker_selector(config)
    assert worker_selector(config) == (
        "app.kubernetes.io/name=splitserve,app.kubernetes.io/instance=dpd,"
        "app.kubernetes.io/component in (prefill,decode)"
    )
    assert value_after(sidecar["args"], "--router") == f"http://127.0.0.1:{ROUTER_ADMIN_PORT}"  # the admin listener
    assert value_after(sidecar["args"], "--namespace") == "default"
    assert value_after(sidecar["args"], "--port") == "8000"
    assert pod["serviceAccountName"] == "dpd-router"
    role = find(manifests, "Role", "dpd-router")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = find(manifests, "RoleBinding", "dpd-router")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "dpd-router", "namespace": "default"}]
    assert binding["roleRef"]["name"] == "dpd-router"
    assert worker_selector(example("colocated")).endswith("app.kubernetes.io/component in (worker)")


def test_workers_send_kv_events_to_the_router_service_when_routing_uses_them() -> None:
    kvaware = container(find(render(example("kvaware")), "Deployment", "kvaware"))
    assert value_after(kvaware["args"], "--kv-events-url") == "http://kvaware-router.default.svc:8080/kv/events"
    dpd = container(find(render(example("dpd")), "Deployment", "decode-dpd"))
    assert "--kv-events-url" in dpd["args"]
    colocated = container(find(render(example("colocated")), "Deployment", "colocated"))
    assert "--kv-events-url" not in colocated["args"]  # roundrobin needs none


def test_metrics_enabled_annotates_pods_for_prometheus() -> None:
    manifests = render(example("kvaware"))
    worker = find(manifests, "Deployment", "kvaware")["spec"]["template"]["metadata"]
    assert worker["annotations"] == {
        SECRET_HASH_ANNOTATION: worker["annotations"][SECRET_HASH_ANNOTATION],
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "8000",
        "prometheus.io/path": "/metrics",
    }
    router = find(manifests, "Deployment", "kvaware-router")["spec"]["template"]["metadata"]
    assert router["annotations"]["prometheus.io/port"] == "8080"
    dpd = find(render(example("dpd")), "Deployment", "dpd-router")["spec"]["template"]["metadata"]
    assert not [key for key in dpd["annotations"] if key.startswith("prometheus.io/")]


def test_metrics_enabled_puts_a_trace_collector_beside_every_splitserve_process() -> None:
    """The reference system's observability path: a collector container in each model pod and the router pod,
    and each splitserve process sending its spans to the one on its pod's loopback."""
    manifests = render(example("kvaware"))  # metrics.enabled
    config = find(manifests, "ConfigMap", "kvaware-otel-collector")["data"][collector.CONFIG_KEY]
    pipeline = yaml.safe_load(config)
    assert pipeline["receivers"]["otlp"]["protocols"]["http"]["endpoint"] == "127.0.0.1:4318"
    assert pipeline["service"]["pipelines"]["traces"]["receivers"] == ["otlp"]
    for name, process in (("kvaware", "worker"), ("kvaware-router", "router")):
        deployment = find(manifests, "Deployment", name)
        assert (
            value_after(container(deployment, process)["args"], "--otlp-traces-endpoint") == collector.TRACES_ENDPOINT
        )
        sidecar = container(deployment, collector.CONTAINER_NAME)
        assert sidecar["image"] == collector.COLLECTOR_IMAGE and sidecar["resources"]["limits"]
        volumes = deployment["spec"]["template"]["spec"]["volumes"]
        assert {"name": collector.VOLUME, "configMap": {"name": "kvaware-otel-collector"}} in volumes
    dpd = render(example("dpd"))  # metrics off: no collector, no flag
    assert not names(dpd, "ConfigMap") and not any("--otlp-traces-endpoint" in c.get("args", [])
                                                   for m in dpd if m["kind"] == "Deployment"
                                                   for c in m["spec"]["template"]["spec"]["containers"])  # fmt: skip
    data = example_data("vllm")
    data["spec"]["metrics"] = {"enabled": True}
    vllm_pods = render(parse_endpoint(data))
    worker = find(vllm_pods, "Deployment", data["metadata"]["name"])  # vLLM traces only with OpenTelemetry
    assert [c["name"] for c in worker["spec"]["template"]["spec"]["containers"]] == ["worker"]
    router = find(vllm_pods, "Deployment", f"{data['metadata']['name']}-router")
    assert collector.CONTAINER_NAME in [c["name"] for c in router["spec"]["template"]["spec"]["containers"]]


def test_a_traces_exporter_endpoint_gets_the_collectors_exporter_and_the_egress_to_it() -> None:
    data = example_data("kvaware")
    data["spec"]["metrics"]["tracesExporterEndpoint"] = "http://tempo.monitoring.svc:4318"
    manifests = render(parse_endpoint(data))
    pipeline = yaml.safe_load(find(manifests, "ConfigMap", "kvaware-otel-collector")["data"][collector.CONFIG_KEY])
    assert pipeline["exporters"]["otlphttp"] == {"endpoint": "http://tempo.monitoring.svc:4318"}
    assert pipeline["service"]["pipelines"]["traces"]["exporters"] == ["debug", "otlphttp"]
    for name in ("kvaware-router", "kvaware-worker"):
        egress = find(manifests, "NetworkPolicy", name)["spec"]["egress"]
        assert {"ports": [{"protocol": "TCP", "port": 4318}]} in egress  # to any address: a policy names no host
    plain = render(example("kvaware"))
    assert "otlphttp" not in find(plain, "ConfigMap", "kvaware-otel-collector")["data"][collector.CONFIG_KEY]
    assert {"ports": [{"protocol": "TCP", "port": 4318}]} not in find(plain, "NetworkPolicy", "kvaware-worker")["spec"][
        "egress"
    ]
    data["spec"]["metrics"]["tracesExporterEndpoint"] = "https://traces.example.com"
    assert collector.exporter_port("https://traces.example.com") == 443
    for bad, message in (("tempo:4318", "must be an http(s)://host[:port] URL"), ("http://t:99999", "http(s)://")):
        data["spec"]["metrics"]["tracesExporterEndpoint"] = bad
        with pytest.raises(EndpointError, match=re.escape(message)):
            parse_endpoint(data)
    data["spec"]["metrics"] = {"enabled": False, "tracesExporterEndpoint": "http://tempo:4318"}
    with pytest.raises(EndpointError, match=re.escape("set metrics.enabled too")):
        parse_endpoint(data)


def test_objects_live_in_the_resources_namespace() -> None:
    data = example_data("dpd")
    data["metadata"]["namespace"] = "llm"
    manifests = render(parse_endpoint(data))
    assert {m["metadata"]["namespace"] for m in manifests} == {"llm"}
    router = container(find(manifests, "Deployment", "dpd-router"), "router")
    assert "http://decode-dpd.llm.svc:8000" in router["args"]
    assert find(manifests, "RoleBinding", "dpd-router")["subjects"][0]["namespace"] == "llm"


# ---------------------------------------------------------------------------------------------- the CRD


def test_crd_yaml_is_the_generated_crd() -> None:
    assert yaml.safe_load(CRD_PATH.read_text()) == crd(), "run: python -m splitserve.deploy.crd > " + str(CRD_PATH)
    assert CRD_PATH.read_text() == crd_yaml()


def test_the_crd_is_a_valid_crd_with_a_status_subresource() -> None:
    definition = crd()
    assert definition["metadata"]["name"] == "inferenceendpointconfigs.splitserve.io"
    spec = definition["spec"]
    assert (spec["group"], spec["names"]["kind"]) == ("splitserve.io", "InferenceEndpointConfig")
    assert spec["scope"] == "Namespaced"
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(definition, K8S_VERSION, strict=True)


def _schema_nodes(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if not isinstance(node, dict):
        return
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _schema_nodes(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield from _schema_nodes(node[key], f"{path}[{key}]")


def test_the_crd_schema_is_structural() -> None:
    """The API server's rules for a structural schema (what a CRD without them is rejected for)."""
    int_or_string = [{"type": "integer"}, {"type": "string"}]
    for path, node in _schema_nodes(openapi_schema()):
        assert "$ref" not in node and "default" not in node and "title" not in node, path
        assert not ("properties" in node and "additionalProperties" in node), path
        assert not isinstance(node.get("additionalProperties"), bool), path
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == int_or_string and "type" not in node, path
        else:
            assert "anyOf" not in node and "oneOf" not in node, path
            assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"{path} has no type"
    status = openapi_schema()["properties"]["status"]
    assert status == {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def _as_json_schema(node: Any) -> Any:
    """OpenAPI's ``nullable`` as JSON Schema's null type, to check resources with jsonschema."""
    if isinstance(node, list):
        return [_as_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _as_json_schema(value) for key, value in node.items() if key != "nullable"}
    if node.get("nullable"):
        out = {"anyOf": [out, {"type": "null"}]}
    return out


def _api_validator() -> Any:
    jsonschema = pytest.importorskip("jsonschema")
    schema = copy.deepcopy(_as_json_schema(openapi_schema()))
    for sub in (schema, *(n for _, n in _schema_nodes(schema))):
        if sub.get("type") == "object" and "properties" in sub:
            sub["additionalProperties"] = False  # what the API server prunes, and kubectl apply reports
    return jsonschema.Draft7Validator(schema)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_passes_the_crd_schema(path: Path) -> None:
    validator = _api_validator()
    data = yaml.safe_load(path.read_text())
    assert [e.message for e in validator.iter_errors({"spec": data["spec"]})] == []


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda s: s["intelligentRoutingSpec"].update(routingStrategy="fastest"), "fastest"),
        (lambda s: s["pdSpec"]["prefillSpec"].update(replicas=-1), "-1"),
        (lambda s: s["worker"].update(wokrer=1), "wokrer"),
        (lambda s: s.pop("modelName"), "modelName"),
    ],
    ids=["enum", "minimum", "unknown-field", "required"],
)
def test_the_crd_schema_rejects_what_the_model_rejects(change: Any, field: str) -> None:
    spec = yaml.safe_load(EXAMPLE["dpd"].read_text())["spec"]
    change(spec)
    errors = [e.message for e in _api_validator().iter_errors({"spec": spec})]
    assert errors and field in " ".join(errors)

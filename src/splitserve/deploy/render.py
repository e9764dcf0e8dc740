"""Kubernetes manifests for an endpoint: the same plan as ``splitserve up``, as Deployments and Services.

:func:`render` turns a validated ``InferenceEndpointConfig`` into plain manifests (dicts); ``splitserve render``
prints them (:func:`render_yaml`) and the operator applies them. Pure: no I/O, no cluster access.

What an endpoint becomes (``<name>`` is ``metadata.name``; every object is in ``metadata.namespace``):

- workers: a Deployment and a Service per role, named as the plan names them: ``<name>`` (colocated), or
  ``prefill-<name>`` and ``decode-<name>`` (with ``pdSpec``). Pods run ``splitserve worker`` with the plan's
  flags plus ``--host 0.0.0.0 --port <containerPort>``, ``--worker-id`` (the pod name) and ``--advertise-url``
  (the pod IP, from the downward API). Decode pods listen on the pod IP instead of 0.0.0.0 and take
  ``--kv-transfer-port <containerPort + 1>`` (container port and Service port ``kv-transfer``): the KV receiver
  advertises the address it binds, and a pod's host name does not resolve in a cluster, its IP does.
- the router: Deployment and Service ``<name>-router`` (port 8080). Its ``splitserve router`` starts with the
  worker Services as its workers; a ``discovery`` sidecar (``splitserve k8s-discovery``) lists the ready
  worker pods by label and replaces that list with the pods' own URLs through ``PUT /admin/workers``, so
  routing (prefix-aware, KV-aware, PD pairing) sees each pod. ServiceAccount, Role and RoleBinding
  ``<name>-router`` let the sidecar list pods.
- Redis: with ``l2CacheBackend: redis`` and no ``l2CacheLocalUrl``, a ``<name>-redis`` Deployment and Service
  (``REDIS_IMAGE``), as ``splitserve up`` starts a redis-server; every worker gets its URL.
- tieredstorage: an ``emptyDir`` at the L2 path in each worker pod (per pod; mount a ReadWriteMany volume
  there to share it).
- model weights: ``spec.worker.modelVolumeMount`` mounts the PersistentVolumeClaim named
  ``modelVolumeMount.name`` (read-only) at ``mountPath`` in workers and router (the router reads the tokenizer);
  create that claim (for s3 or fsx sources, backed by the Mountpoint for S3 or FSx CSI driver).

Labels: ``app.kubernetes.io/name=splitserve``, ``instance=<name>``, ``component=worker|prefill|decode|router|redis``,
``managed-by=splitserve``; prefill and decode pods also carry ``splitserve.io/dpd-role`` (and the plan's
role label, which for the reference apiVersion is the seed's). The resource's own labels are copied to every
object. Image: ``spec.worker.image``, else ``DEFAULT_IMAGE`` (build it from this repository).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from splitserve.config import Role
from splitserve.deploy.plan import ROLE_URL_FLAG, EndpointPlan, RolePlan, Target, plan
from splitserve.endpoint import InferenceEndpointConfig

Manifest = dict[str, Any]

DEFAULT_IMAGE = "splitserve:latest"  # the image this repository builds; spec.worker.image overrides it
ROUTER_PORT = 8080
REDIS_IMAGE = "redis:7-alpine"
REDIS_PORT = 6379
REDIS_MAX_MEMORY = "1536mb"  # evicts least recently used chunks beyond this (an L2 is a cache)
MANAGED_BY = "splitserve"

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_ROLE = "splitserve.io/dpd-role"  # prefill | decode, whatever the resource's apiVersion
COMPONENTS = {Role.COLOCATED: "worker", Role.PREFILL: "prefill", Role.DECODE: "decode"}

HTTP_PORT_NAME = "http"  # the router's and Redis' port name (workers use modelInvocationPort.name)
KV_TRANSFER_PORT_NAME = "kv-transfer"
L2_VOLUME = "l2-cache"
POD_NAME_ENV, POD_IP_ENV, POD_NAMESPACE_ENV = "SPLITSERVE_POD_NAME", "SPLITSERVE_POD_IP", "SPLITSERVE_POD_NAMESPACE"
ROUTER_RESOURCES = {"requests": {"cpu": "250m", "memory": "512Mi"}}
DISCOVERY_RESOURCES = {"requests": {"cpu": "20m", "memory": "96Mi"}, "limits": {"memory": "256Mi"}}
REDIS_RESOURCES = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "2Gi"}}
STARTUP_PROBE_S = 600  # a worker may take this long to load its model before liveness counts
# Pod termination: the preStop pause lets the Service endpoints and the router's pod watch drop the pod
# before SIGTERM; then the worker drains (--shutdown-timeout) and the router lets its streams finish; the
# grace period covers both with room to spare before Kubernetes' SIGKILL.
PRE_STOP_S = 5
SHUTDOWN_TIMEOUT_S = 30
TERMINATION_GRACE_S = PRE_STOP_S + SHUTDOWN_TIMEOUT_S + 10


@dataclass(frozen=True, slots=True)
class _Endpoint:
    """What every manifest builder needs: the resource, its Kubernetes plan and the image."""

    config: InferenceEndpointConfig
    plan: EndpointPlan  # for Target.KUBERNETES
    image: str

    @property
    def name(self) -> str:
        return self.config.metadata.name

    @property
    def namespace(self) -> str:
        return self.config.metadata.namespace


def render(config: InferenceEndpointConfig, *, default_image: str = DEFAULT_IMAGE) -> list[Manifest]:
    """The manifests of ``config``, in apply order: router RBAC, Redis (if any), workers, router.

    Raises EndpointError where :func:`splitserve.deploy.plan.plan` does (e.g. an s3 model without a volume).
    """
    endpoint_plan = plan(config, Target.KUBERNETES, redis_url=in_cluster_redis_url(config))
    ep = _Endpoint(config, endpoint_plan, config.spec.worker.image or default_image)
    manifests = _router_rbac(ep)
    if config.needs_local_redis:
        manifests += [_redis_deployment(ep), _service(ep, f"{ep.name}-redis", "redis", _redis_ports())]
    for role in endpoint_plan.roles:
        manifests += [
            _worker_deployment(ep, role),
            _service(ep, role.name, COMPONENTS[role.role], _worker_ports(ep, role)),
        ]
    router_port = [_port(HTTP_PORT_NAME, ROUTER_PORT)]
    manifests += [_router_deployment(ep), _service(ep, endpoint_plan.router.name, "router", router_port)]
    return manifests


def render_yaml(config: InferenceEndpointConfig, *, default_image: str = DEFAULT_IMAGE) -> str:
    """:func:`render` as multi-document YAML; the plan's warnings lead as comments."""
    warnings = plan(config, Target.KUBERNETES, redis_url=in_cluster_redis_url(config)).warnings
    header = "".join(f"# warning: {w}\n" for w in warnings)
    return header + yaml.safe_dump_all(render(config, default_image=default_image), sort_keys=False, width=4096)


def in_cluster_redis_url(config: InferenceEndpointConfig) -> str | None:
    """The URL of the Redis :func:`render` adds (Redis L2 without a URL), else None."""
    if not config.needs_local_redis:
        return None
    meta = config.metadata
    return f"redis://{meta.name}-redis.{meta.namespace}.svc:{REDIS_PORT}/0"


def kv_transfer_port(container_port: int) -> int:
    """The decode worker's KV receiver port: the next port after its HTTP port (the one before, at 65535)."""
    return container_port + 1 if container_port < 65535 else container_port - 1


def selector_labels(endpoint: str, component: str) -> dict[str, str]:
    """The labels that select one component's pods (a Deployment's selector; immutable once applied)."""
    return {LABEL_NAME: "splitserve", LABEL_INSTANCE: endpoint, LABEL_COMPONENT: component}


def worker_selector(config: InferenceEndpointConfig) -> str:
    """The label selector of the endpoint's worker pods, as the discovery sidecar passes it to the API."""
    components = "prefill,decode" if config.is_disaggregated else COMPONENTS[Role.COLOCATED]
    return f"{LABEL_NAME}=splitserve,{LABEL_INSTANCE}={config.metadata.name},{LABEL_COMPONENT} in ({components})"


def managed_selector(endpoint: str) -> str:
    """The label selector of every object rendered for ``endpoint`` (the operator prunes with it)."""
    return f"{LABEL_INSTANCE}={endpoint},{LABEL_MANAGED_BY}={MANAGED_BY}"


# ---------------------------------------------------------------------------------------------- workers


def _worker_deployment(ep: _Endpoint, role: RolePlan) -> Manifest:
    labels = {**_labels(ep, COMPONENTS[role.role]), **role.labels}
    if role.role != Role.COLOCATED:
        labels[LABEL_ROLE] = role.role.value
    container = {
        "name": "worker",
        "image": ep.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["splitserve", "worker"],
        "args": _worker_args(ep, role),
        "ports": _worker_ports(ep, role),
        "env": _downward_env() + [{"name": k, "value": v} for k, v in role.env.items()],
        "resources": _resources(role.resources.requests, role.resources.limits),
        **_worker_probes(ep.config.spec.load_balancer.health_check_path, _port_name(ep)),
        "lifecycle": _pre_stop(),
        "volumeMounts": _worker_mounts(ep),
    }
    volumes = _model_volumes(ep) + ([_l2_volume()] if ep.plan.l2_path is not None else [])
    pod_spec = {"containers": [_pruned(container)], "volumes": volumes, "enableServiceLinks": False,
                "terminationGracePeriodSeconds": TERMINATION_GRACE_S}  # fmt: skip
    pod = {"metadata": _pod_metadata(ep, labels, role.container_port), "spec": _pruned(pod_spec)}
    return _deployment(ep, role.name, COMPONENTS[role.role], role.replicas, pod)


def _worker_args(ep: _Endpoint, role: RolePlan) -> list[str]:
    """The plan's flags plus what each pod sets for itself (expanded by Kubernetes from the pod's env)."""
    port = role.container_port
    host = f"$({POD_IP_ENV})" if role.role == Role.DECODE else "0.0.0.0"  # the KV receiver advertises its bind
    args = [*role.flags, "--host", host, "--port", str(port), "--worker-id", f"$({POD_NAME_ENV})"]
    args += ["--advertise-url", f"http://$({POD_IP_ENV}):{port}", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    if role.role == Role.DECODE:
        args += ["--kv-transfer-port", str(kv_transfer_port(port))]
    if ep.plan.router.kv_events:
        args += ["--kv-events-url", f"{_service_url(ep, ep.plan.router.name, ROUTER_PORT)}/kv/events"]
    return args


def _worker_ports(ep: _Endpoint, role: RolePlan) -> list[Manifest]:
    ports = [_port(_port_name(ep), role.container_port)]
    if role.role == Role.DECODE:
        ports.append(_port(KV_TRANSFER_PORT_NAME, kv_transfer_port(role.container_port)))
    return ports


def _port_name(ep: _Endpoint) -> str:
    """The worker's HTTP port name: ``modelInvocationPort.name`` (Prometheus' Kubernetes config scrapes "http")."""
    return ep.config.spec.worker.model_invocation_port.name


def _worker_probes(path: str, port: str) -> Manifest:
    """Startup covers the model load (the worker answers 503 until then); liveness restarts a failed engine."""

    def probe(period_s: int, failures: int) -> Manifest:
        return {"httpGet": {"path": path, "port": port}, "periodSeconds": period_s, "failureThreshold": failures}

    return {
        "startupProbe": probe(5, STARTUP_PROBE_S // 5),
        "readinessProbe": {**probe(5, 3), "timeoutSeconds": 2},
        "livenessProbe": {**probe(15, 4), "timeoutSeconds": 5},
    }


def _pre_stop() -> Manifest:
    return {"preStop": {"exec": {"command": ["sleep", str(PRE_STOP_S)]}}}


def _worker_mounts(ep: _Endpoint) -> list[Manifest]:
    mounts = _model_mounts(ep)
    if ep.plan.l2_path is not None:
        mounts.append({"name": L2_VOLUME, "mountPath": ep.plan.l2_path})
    return mounts


def _model_mounts(ep: _Endpoint) -> list[Manifest]:
    mount = ep.config.spec.worker.model_volume_mount
    return [] if mount is None else [{"name": mount.name, "mountPath": mount.mount_path, "readOnly": True}]


def _model_volumes(ep: _Endpoint) -> list[Manifest]:
    mount = ep.config.spec.worker.model_volume_mount
    if mount is None:
        return []
    return [{"name": mount.name, "persistentVolumeClaim": {"claimName": mount.name, "readOnly": True}}]


def _l2_volume() -> Manifest:
    return {"name": L2_VOLUME, "emptyDir": {}}


def _downward_env() -> list[Manifest]:
    fields = ((POD_NAME_ENV, "metadata.name"), (POD_IP_ENV, "status.podIP"), (POD_NAMESPACE_ENV, "metadata.namespace"))
    return [{"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}} for name, path in fields]


# ---------------------------------------------------------------------------------------------- router


def _router_deployment(ep: _Endpoint) -> Manifest:
    router = ep.plan.router
    bootstrap = [
        token
        for role in ep.plan.roles
        for token in (ROLE_URL_FLAG[role.role], _service_url(ep, role.name, role.container_port))
    ]  # until the sidecar's first update: the Services (the router needs a worker of each kind to start)
    container = {
        "name": "router",
        "image": ep.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["splitserve", "router"],
        "args": [
            *router.flags,
            "--host",
            "0.0.0.0",
            "--port",
            str(ROUTER_PORT),
            "--shutdown-timeout",
            str(SHUTDOWN_TIMEOUT_S),
            *bootstrap,
        ],
        "ports": [_port(HTTP_PORT_NAME, ROUTER_PORT)],
        "resources": ROUTER_RESOURCES,
        # /health is 503 until a worker is healthy: right for readiness, wrong for liveness
        "readinessProbe": {"httpGet": {"path": router.health_check_path, "port": HTTP_PORT_NAME}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": HTTP_PORT_NAME}, "periodSeconds": 15, "failureThreshold": 4},
        "lifecycle": _pre_stop(),
        "volumeMounts": _model_mounts(ep),
    }
    discovery = {
        "name": "discovery",
        "image": ep.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["splitserve", "k8s-discovery"],
        "args": _discovery_args(ep),
        "resources": DISCOVERY_RESOURCES,
    }
    pod_spec = {
        "serviceAccountName": router.name,
        "containers": [_pruned(container), discovery],
        "volumes": _model_volumes(ep),
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
    }
    pod = {"metadata": _pod_metadata(ep, _labels(ep, "router"), ROUTER_PORT), "spec": _pruned(pod_spec)}
    return _deployment(ep, router.name, "router", 1, pod)


def _discovery_args(ep: _Endpoint) -> list[str]:
    port = ep.config.spec.worker.model_invocation_port.container_port
    return [
        "--namespace", ep.namespace,
        "--selector", worker_selector(ep.config),
        "--port", str(port),
        "--router", f"http://127.0.0.1:{ROUTER_PORT}",
    ]  # fmt: skip


def _router_rbac(ep: _Endpoint) -> list[Manifest]:
    """The router pod's identity: its discovery sidecar may get, list and watch pods in the namespace."""
    name = ep.plan.router.name
    subject = {"kind": "ServiceAccount", "name": name, "namespace": ep.namespace}
    rule = {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    role_ref = {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(ep, name, "router")},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _metadata(ep, name, "router"),
         "rules": [rule]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": _metadata(ep, name, "router"), "subjects": [subject], "roleRef": role_ref},
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------- redis


def _redis_deployment(ep: _Endpoint) -> Manifest:
    container = {
        "name": "redis",
        "image": REDIS_IMAGE,
        "args": ["--save", "", "--appendonly", "no", "--maxmemory", REDIS_MAX_MEMORY,
                 "--maxmemory-policy", "allkeys-lru"],
        "ports": _redis_ports(),
        "resources": REDIS_RESOURCES,
        "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 15},
    }  # fmt: skip
    pod_spec = {"containers": [container], "enableServiceLinks": False}
    pod = {"metadata": {"labels": _labels(ep, "redis")}, "spec": pod_spec}
    return _deployment(ep, f"{ep.name}-redis", "redis", 1, pod)


def _redis_ports() -> list[Manifest]:
    return [_port("redis", REDIS_PORT)]


# ---------------------------------------------------------------------------------------------- shared shapes


def _deployment(ep: _Endpoint, name: str, component: str, replicas: int, pod: Manifest) -> Manifest:
    """A Deployment of ``pod`` (its ``metadata`` and ``spec``), selected by ``selector_labels``."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(ep, name, component),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(ep.name, component)},
            "template": pod,
        },
    }


def _pod_metadata(ep: _Endpoint, labels: dict[str, str], port: int) -> Manifest:
    """Pod labels, and Prometheus' scrape annotations when ``spec.metrics.enabled``."""
    if not ep.config.spec.metrics.enabled:
        return {"labels": labels}
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}
    return {"labels": labels, "annotations": annotations}


def _service(ep: _Endpoint, name: str, component: str, ports: Sequence[Manifest]) -> Manifest:
    service_ports = [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"]} for p in ports]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(ep, name, component),
        "spec": {"selector": selector_labels(ep.name, component), "ports": service_ports},
    }


def _metadata(ep: _Endpoint, name: str, component: str) -> Manifest:
    return {"name": name, "namespace": ep.namespace, "labels": _labels(ep, component)}


def _labels(ep: _Endpoint, component: str) -> dict[str, str]:
    own = {**selector_labels(ep.name, component), LABEL_MANAGED_BY: MANAGED_BY}
    return {**ep.config.metadata.labels, **own}


def _port(name: str, number: int) -> Manifest:
    return {"name": name, "containerPort": number, "protocol": "TCP"}


def _resources(requests: dict[str, str], limits: dict[str, str]) -> Manifest:
    return {key: dict(value) for key, value in (("requests", requests), ("limits", limits)) if value}


def _service_url(ep: _Endpoint, service: str, port: int) -> str:
    return f"http://{service}.{ep.namespace}.svc:{port}"


def _pruned(mapping: Manifest) -> Manifest:
    """``mapping`` without empty lists and dicts (a manifest leaves out what it does not set)."""
    return {key: value for key, value in mapping.items() if value not in ([], {})}

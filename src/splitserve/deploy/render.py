"""Kubernetes manifests for an endpoint: the same plan as ``splitserve up``, as Deployments and Services.

:func:`render` turns a validated ``InferenceEndpointConfig`` into plain manifests (dicts); ``splitserve render``
prints them (:func:`render_yaml`) and the operator applies them. Pure: no I/O, no cluster access (the one
random thing is a new Secret's values, which the caller can pass in instead).

What an endpoint becomes (``<name>`` is ``metadata.name``; every object is in ``metadata.namespace``):

- the endpoint's Secret ``<name>-cluster-secret``: the cluster secret (key ``cluster-secret``, 32 random
  bytes, URL-safe base64) and, with the endpoint's own Redis, that Redis' password (``redis-password``). Every
  splitserve container gets ``SPLITSERVE_CLUSTER_SECRET`` from it through ``secretKeyRef``, never as a literal.
  Each pod template carries a digest of the values (``splitserve.io/secret-hash``), so pods roll when the
  Secret changes and never mix two secrets. The operator keeps an existing Secret's values.
- NetworkPolicies (``splitserve.deploy.netpol``): a default deny for the endpoint's pods, then clients reach the
  router only, the router the workers' HTTP port, prefill pods the decode KV port, workers Redis.
- workers: a Deployment and a Service per role, named as the plan names them: ``<name>`` (colocated), or
  ``prefill-<name>`` and ``decode-<name>`` (with ``pdSpec``). Pods run ``splitserve worker`` with the plan's
  flags plus ``--host 0.0.0.0 --port <containerPort>``, ``--worker-id`` (the pod name) and ``--advertise-url``
  (the pod IP, from the downward API). Decode pods listen on the pod IP instead of 0.0.0.0 and take
  ``--kv-transfer-port <containerPort + 1>`` (container port and Service port ``kv-transfer``): the KV receiver
  advertises the address it binds, and a pod's host name does not resolve in a cluster, its IP does.
- the router: Deployment and Service ``<name>-router`` (port 8080), with requests and limits. Its
  ``splitserve router`` starts with the worker Services as its workers; a ``discovery`` sidecar
  (``splitserve k8s-discovery``) lists the ready worker pods by label and replaces that list with the pods' own
  URLs through ``PUT /admin/workers`` on the router's loopback admin listener (``ROUTER_ADMIN_PORT``), so
  routing (prefix-aware, KV-aware, PD pairing) sees each pod.
  ServiceAccount, Role and RoleBinding ``<name>-router`` let the sidecar list pods. Only the sidecar mounts the
  account's token (a projected volume); the router container has none.
- tracing: with ``spec.metrics.enabled``, an ``otel-collector`` container beside each splitserve worker and the
  router, configured by the ConfigMap ``<name>-otel-collector``, and ``--otlp-traces-endpoint`` on their
  processes (``splitserve.deploy.collector``).
- Redis: with ``l2CacheBackend: redis`` and no ``l2CacheLocalUrl``, a ``<name>-redis`` Deployment and Service
  (``REDIS_IMAGE``), as ``splitserve up`` starts a redis-server. It reads its password from the Secret on
  stdin (never argv); every worker gets its URL and ``SPLITSERVE_REDIS_PASSWORD``.
- tieredstorage: an ``emptyDir`` at the L2 path (``KUBERNETES_L2_PATH`` without ``l2CachePath``) in each
  worker pod (per pod; mount a ReadWriteMany volume there to share it).
- model weights: ``spec.worker.modelVolumeMount`` mounts the PersistentVolumeClaim named
  ``modelVolumeMount.name`` (read-only) at ``mountPath`` in workers and router (the router reads the tokenizer);
  create that claim (for s3 or fsx sources, backed by the Mountpoint for S3 or FSx CSI driver).

Every pod runs restricted: user and group ``RUN_AS_ID`` (the Dockerfile's), no privilege escalation, every
capability dropped, seccomp ``RuntimeDefault``, a read-only root filesystem with ``emptyDir`` volumes where a
process writes (``/tmp``; ``HOME``, where the native kernels and other caches go; Redis' ``/data``), and no
service-account token (``automountServiceAccountToken: false``) except in the discovery sidecar.

vLLM workers (``spec.worker.engine: vllm``; ``splitserve.deploy.vllm``): the worker container runs
``vllm serve --model <model>`` from ``spec.worker.image`` with the plan's flags plus ``--host 0.0.0.0 --port
<containerPort>`` and, under a kvaware router, ``--kv-events-config`` publishing on ports ``kv-events`` (5557) and
``kv-replay`` (5558), which the Service exposes and the NetworkPolicies open to the router's pods only. vLLM's
key (``VLLM_API_KEY``) is the cluster secret, by reference, which the router sends; the resource's client keys
go to the router only. The pod also gets a memory ``emptyDir`` at ``/dev/shm`` (vLLM's processes share memory
there). The router and its sidecar keep splitserve's image (``default_image``).

Labels (``splitserve.deploy.labels``): ``app.kubernetes.io/name=splitserve``, ``instance=<name>``,
``component=worker|prefill|decode|router|redis``, ``managed-by=splitserve``; prefill and decode pods also carry
``splitserve.io/dpd-role`` (and the plan's role label, which for the reference apiVersion is the reference
system's). The resource's own labels are copied to every object. Image: ``spec.worker.image``, else
``DEFAULT_IMAGE`` (build it from this repository).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import yaml

from splitserve import envs
from splitserve.config import L2Backend, Role
from splitserve.deploy import collector, vllm
from splitserve.deploy.labels import (
    COMPONENTS,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_ROLE,
    MANAGED_BY,
    managed_selector,
    selector_labels,
)
from splitserve.deploy.netpol import Network, network_policies
from splitserve.deploy.plan import ROLE_URL_FLAG, EndpointPlan, RolePlan, Target, plan
from splitserve.endpoint import InferenceEndpointConfig, RoleScaling, WorkerEngine

__all__ = [
    "COMPONENTS", "LABEL_COMPONENT", "LABEL_INSTANCE", "LABEL_MANAGED_BY", "LABEL_NAME", "LABEL_ROLE", "MANAGED_BY",
    "Manifest", "decode_secret", "in_cluster_redis_url", "kv_transfer_port", "managed_selector", "render",
    "render_yaml", "secret_name", "selector_labels", "worker_selector",
]  # fmt: skip

from splitserve.kube import Manifest

DEFAULT_IMAGE = "splitserve:latest"  # the image this repository builds; spec.worker.image overrides it
ROUTER_PORT = 8080
ROUTER_ADMIN_PORT = 8081  # the router's admin listener (/admin/*): loopback only, for the discovery sidecar
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"  # a node, to spread router replicas over
# the custom metrics the HorizontalPodAutoscalers read (deploy/prometheus/adapter-rules.yaml serves them)
IN_FLIGHT_METRIC = "splitserve_requests_in_flight"  # per worker pod: running + waiting
ENDPOINT_IN_FLIGHT_METRIC = "splitserve_endpoint_requests_in_flight"  # on the router's Service: all it has in flight
TTFT_METRIC = "splitserve_ttft_p90_seconds"  # on the router's Service: over the last minute
REDIS_IMAGE = "redis:7-alpine"
REDIS_PORT = 6379
REDIS_MAX_MEMORY = "1536mb"  # evicts least recently used chunks beyond this (an L2 is a cache)
# Redis reads its password from stdin (a here-document: a pipe, no file), so it is in no argv; "$@": the args.
REDIS_SCRIPT = 'exec redis-server "$@" - <<EOF\nrequirepass $REDIS_PASSWORD\nEOF\n'

HTTP_PORT_NAME = "http"  # the router's and Redis' port name (workers use modelInvocationPort.name)
KV_TRANSFER_PORT_NAME = "kv-transfer"
L2_VOLUME, TMP_VOLUME, HOME_VOLUME, API_VOLUME, REDIS_DATA_VOLUME = "l2-cache", "tmp", "home", "kube-api", "data"
SHM_VOLUME, SHM_SIZE = "dshm", "1Gi"  # vLLM workers' /dev/shm (memory: counts against the pod's limit)
POD_NAME_ENV, POD_IP_ENV, POD_NAMESPACE_ENV = envs.POD_NAME.name, envs.POD_IP.name, envs.POD_NAMESPACE.name
# the resource's variables the router gets too: it checks the client keys and makes each one a tenant
ROUTER_ENV_NAMES = ("SPLITSERVE_API_KEY", "VLLM_API_KEY", "SPLITSERVE_SALT_PER_API_KEY")
ROUTER_RESOURCES = {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"cpu": "2", "memory": "2Gi"}}
DISCOVERY_RESOURCES = {"requests": {"cpu": "20m", "memory": "96Mi"}, "limits": {"cpu": "200m", "memory": "256Mi"}}
REDIS_RESOURCES = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "2Gi"}}
STARTUP_PROBE_S = 600  # a worker may take this long to load its model before liveness counts
# Pod termination: the preStop pause lets the Service endpoints and the router's pod watch drop the pod
# before SIGTERM; then the worker drains (--shutdown-timeout) and the router lets its streams finish; the
# grace period covers both with room to spare before Kubernetes' SIGKILL.
PRE_STOP_S = 5
SHUTDOWN_TIMEOUT_S = 30
TERMINATION_GRACE_S = PRE_STOP_S + SHUTDOWN_TIMEOUT_S + 10

# The endpoint's Secret: the cluster secret, and its own Redis' password.
SECRET_KEY = "cluster-secret"
REDIS_PASSWORD_KEY = "redis-password"
SECRET_HASH_ANNOTATION = "splitserve.io/secret-hash"  # a digest of the Secret's values: pods roll when they change
NUM_SECRET_BYTES = 32

# How every pod runs. RUN_AS_ID is the Dockerfile's splitserve user and group.
RUN_AS_ID = 10001
HOME_DIR = "/home/splitserve"  # HOME in every splitserve container: an emptyDir (native kernels, other caches)
SCRATCH_SIZE = "2Gi"  # the most each writable emptyDir may hold
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"  # where the discovery sidecar finds its token
TOKEN_EXPIRY_S = 3607  # the projected token's lifetime; the kubelet renews it (the sidecar re-reads the file)


@dataclass(frozen=True, slots=True)
class _Endpoint:
    """What every manifest builder needs: the resource, its Kubernetes plan, the image and the Secret's values."""

    config: InferenceEndpointConfig
    plan: EndpointPlan  # for Target.KUBERNETES
    image: str  # the workers'
    router_image: str  # the router's and its sidecar's: splitserve's, also in front of vLLM workers
    secrets: dict[str, str] = field(repr=False)  # the Secret's keys and values

    @property
    def is_vllm(self) -> bool:
        return self.plan.engine == WorkerEngine.VLLM

    @property
    def name(self) -> str:
        return self.config.metadata.name

    @property
    def traces(self) -> bool:
        """Whether the splitserve pods run an OpenTelemetry collector beside them (``deploy/collector.py``)."""
        return self.config.spec.metrics.enabled

    @property
    def namespace(self) -> str:
        return self.config.metadata.namespace


def render(
    config: InferenceEndpointConfig,
    *,
    default_image: str = DEFAULT_IMAGE,
    secret_values: Mapping[str, str] | None = None,
) -> list[Manifest]:
    """The manifests of ``config``, in apply order: the Secret, NetworkPolicies, router RBAC, Redis (if any),
    workers, router.

    ``secret_values``: the Secret's values to keep (an existing Secret's, :func:`decode_secret`); a key it lacks
    gets a new random value. Raises EndpointError where :func:`splitserve.deploy.plan.plan` does (e.g. an s3
    model without a volume).
    """
    endpoint_plan = plan(config, Target.KUBERNETES, redis_url=in_cluster_redis_url(config))
    values = _secret_values(config, secret_values or {})
    image = config.spec.worker.image or default_image
    router_image = default_image if endpoint_plan.engine == WorkerEngine.VLLM else image
    ep = _Endpoint(config, endpoint_plan, image, router_image, values)
    manifests = [_secret(ep), *network_policies(_network(ep)), *_router_rbac(ep)]
    if ep.traces:
        exporter = config.spec.metrics.traces_exporter_endpoint
        manifests.append(collector.config_map(ep.name, ep.namespace, _labels(ep, "router"), exporter))
    if config.needs_local_redis:
        manifests += [_redis_deployment(ep), _service(ep, f"{ep.name}-redis", "redis", _redis_ports())]
    for role in endpoint_plan.roles:
        manifests += [
            _worker_deployment(ep, role),
            _service(ep, role.name, COMPONENTS[role.role], _worker_ports(ep, role)),
        ]
        if (scaling := _scaling(ep, role)) is not None and scaling.decode_ratio is None:
            manifests.append(_autoscaler(ep, role, scaling))  # a decodeRatio's replicas are the operator's
    router_port = [_port(HTTP_PORT_NAME, ROUTER_PORT)]
    manifests += [_router_deployment(ep), _service(ep, endpoint_plan.router.name, "router", router_port)]
    if endpoint_plan.router.replicas > 1:
        manifests.append(_router_disruption_budget(ep))
    return manifests


def render_yaml(
    config: InferenceEndpointConfig,
    *,
    default_image: str = DEFAULT_IMAGE,
    secret_values: Mapping[str, str] | None = None,
) -> str:
    """:func:`render` as multi-document YAML; the plan's warnings lead as comments."""
    warnings = plan(config, Target.KUBERNETES, redis_url=in_cluster_redis_url(config)).warnings
    header = "".join(f"# warning: {w}\n" for w in warnings)
    manifests = render(config, default_image=default_image, secret_values=secret_values)
    return header + yaml.safe_dump_all(manifests, sort_keys=False, width=4096)


def in_cluster_redis_url(config: InferenceEndpointConfig) -> str | None:
    """The URL of the Redis :func:`render` adds (Redis L2 without a URL), else None."""
    if not config.needs_local_redis:
        return None
    meta = config.metadata
    return f"redis://{meta.name}-redis.{meta.namespace}.svc:{REDIS_PORT}/0"


def kv_transfer_port(container_port: int) -> int:
    """The decode worker's KV receiver port: the next port after its HTTP port (the one before, at 65535)."""
    return container_port + 1 if container_port < 65535 else container_port - 1


def worker_selector(config: InferenceEndpointConfig) -> str:
    """The label selector of the endpoint's worker pods, as the discovery sidecar passes it to the API."""
    components = "prefill,decode" if config.is_disaggregated else COMPONENTS[Role.COLOCATED]
    return f"{LABEL_NAME}=splitserve,{LABEL_INSTANCE}={config.metadata.name},{LABEL_COMPONENT} in ({components})"


def secret_name(endpoint: str) -> str:
    """The name of the endpoint's Secret."""
    return f"{endpoint}-cluster-secret"


def decode_secret(secret: Manifest) -> dict[str, str]:
    """A live Secret's values (``data``, base64-decoded), the keys that do not decode left out."""
    values = {}
    for key, encoded in (secret.get("data") or {}).items():
        try:
            values[key] = base64.b64decode(str(encoded), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            continue
    return values


# ---------------------------------------------------------------------------------------------- the Secret


def _secret_keys(config: InferenceEndpointConfig) -> tuple[str, ...]:
    return (SECRET_KEY, REDIS_PASSWORD_KEY) if config.needs_local_redis else (SECRET_KEY,)


def _secret_values(config: InferenceEndpointConfig, kept: Mapping[str, str]) -> dict[str, str]:
    """Every key the endpoint needs: ``kept``'s value, else a new random one."""
    return {key: kept.get(key) or secrets.token_urlsafe(NUM_SECRET_BYTES) for key in _secret_keys(config)}


def _secret(ep: _Endpoint) -> Manifest:
    data = {key: base64.b64encode(value.encode()).decode() for key, value in ep.secrets.items()}
    metadata = _metadata(ep, secret_name(ep.name), "secret")
    return {"apiVersion": "v1", "kind": "Secret", "metadata": metadata, "type": "Opaque", "data": data}


def _secret_hash(ep: _Endpoint) -> str:
    text = "\0".join(f"{key}={value}" for key, value in sorted(ep.secrets.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _secret_env(ep: _Endpoint, name: str, key: str = SECRET_KEY) -> Manifest:
    """The variable ``name`` from the endpoint's Secret (a reference: the value is in no manifest but the Secret)."""
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret_name(ep.name), "key": key}}}


# ---------------------------------------------------------------------------------------------- workers


def _worker_deployment(ep: _Endpoint, role: RolePlan) -> Manifest:
    labels = {**_labels(ep, COMPONENTS[role.role]), **role.labels}
    if role.role != Role.COLOCATED:
        labels[LABEL_ROLE] = role.role.value
    command = ["vllm", "serve"] if ep.is_vllm else ["splitserve", "worker"]
    args = _vllm_args(ep, role) if ep.is_vllm else _worker_args(ep, role)
    container = {
        "name": "worker",
        "image": ep.image,
        "imagePullPolicy": "IfNotPresent",
        "command": command,
        "args": args,
        "ports": _worker_ports(ep, role),
        "env": _vllm_env(ep, role) if ep.is_vllm else _worker_env(ep),
        "resources": _resources(role.resources.requests, role.resources.limits),
        **_worker_probes(ep.config.spec.load_balancer.health_check_path, _port_name(ep)),
        "lifecycle": _pre_stop(),
        "securityContext": _container_security(),
        "volumeMounts": _worker_mounts(ep),
    }
    volumes = _model_volumes(ep) + _scratch_volumes() + ([_l2_volume()] if ep.plan.l2_path is not None else [])
    if ep.is_vllm:
        volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}})
    containers = [_pruned(container)]
    if ep.traces and not ep.is_vllm:
        containers.append(collector.container(_container_security()))
        volumes.append(collector.volume(ep.name))
    pod_spec = _pod_spec(containers, volumes, terminationGracePeriodSeconds=TERMINATION_GRACE_S)
    pod = {"metadata": _pod_metadata(ep, labels, role.container_port), "spec": pod_spec}
    # an autoscaled role's replicas are its HorizontalPodAutoscaler's (with decodeRatio, the operator's, through the
    # scale subresource): a re-apply must not set them back
    replicas = None if _scaling(ep, role) is not None else role.replicas
    return _deployment(ep, role.name, COMPONENTS[role.role], replicas, pod)


def _scaling(ep: _Endpoint, role: RolePlan) -> RoleScaling | None:
    autoscaling = ep.config.spec.autoscaling
    return None if autoscaling is None else autoscaling.roles().get(role.role.value)


def _autoscaler(ep: _Endpoint, role: RolePlan, scaling: RoleScaling) -> Manifest:
    """The role's HorizontalPodAutoscaler (``deploy/autoscale.py``'s rules in HPA's terms): each pod's requests in
    flight against ``targetConcurrency`` (a Pods metric), the TTFT p90 at the router's Service against
    ``targetTtftSeconds`` (an Object metric), both from the custom metrics API a Prometheus adapter serves
    (``deploy/prometheus/adapter-rules.yaml``); scale-down over the resource's stabilization window."""
    metrics: list[Manifest] = []
    autoscaling = ep.config.spec.autoscaling
    assert autoscaling is not None
    follows = role.role == Role.DECODE and autoscaling.prefill_follows_decode
    if scaling.target_concurrency is not None and follows:  # decode counts the requests still in prefill too
        router = {"apiVersion": "v1", "kind": "Service", "name": ep.plan.router.name}
        target = {"type": "AverageValue", "averageValue": _milli(scaling.target_concurrency)}
        endpoint = {"describedObject": router, "metric": {"name": ENDPOINT_IN_FLIGHT_METRIC}, "target": target}
        metrics.append({"type": "Object", "object": endpoint})
    elif scaling.target_concurrency is not None:
        target = {"type": "AverageValue", "averageValue": _milli(scaling.target_concurrency)}
        metrics.append({"type": "Pods", "pods": {"metric": {"name": IN_FLIGHT_METRIC}, "target": target}})
    if scaling.target_ttft_seconds is not None:
        router = {"apiVersion": "v1", "kind": "Service", "name": ep.plan.router.name}
        target = {"type": "Value", "value": _milli(scaling.target_ttft_seconds)}
        metrics.append({"type": "Object", "object": {"describedObject": router, "metric": {"name": TTFT_METRIC},
                                                     "target": target}})  # fmt: skip
    assert ep.config.spec.autoscaling is not None
    window = round(ep.config.spec.autoscaling.scale_down_stabilization_seconds)
    spec = {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": role.name},
        "minReplicas": scaling.min_replicas,
        "maxReplicas": scaling.max_replicas,
        "metrics": metrics,
        "behavior": {"scaleUp": {"stabilizationWindowSeconds": 0},
                     "scaleDown": {"stabilizationWindowSeconds": window}},
    }  # fmt: skip
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": _metadata(ep, role.name, COMPONENTS[role.role]), "spec": spec}  # fmt: skip


def _milli(value: float) -> str:
    """A Kubernetes quantity for ``value``: whole, or in thousandths."""
    return str(int(value)) if value == int(value) else f"{round(value * 1000)}m"


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
    return args + _traces_args(ep)


def _traces_args(ep: _Endpoint) -> list[str]:
    """A splitserve process's tracing flag: its pod's collector, when there is one."""
    return ["--otlp-traces-endpoint", collector.TRACES_ENDPOINT] if ep.traces else []


def _vllm_args(ep: _Endpoint, role: RolePlan) -> list[str]:
    """``vllm serve``'s arguments: the plan's (from ``--model`` on), then the address and the KV events."""
    return [*role.flags, *vllm.instance_args("0.0.0.0", role.container_port, ep.plan.router.vllm_events, in_pod=True,
                                             connector=role.kv_connector)]  # fmt: skip


def _vllm_env(ep: _Endpoint, role: RolePlan) -> list[Manifest]:
    """HOME, the cluster secret as vLLM's key (a reference), the plan's engine settings, then the resource's
    variables but its client keys (the router checks those; vLLM's key is the one the router sends)."""
    own = [{"name": name, "value": value} for name, value in role.engine_env.items()]
    env = [_home_env(), _secret_env(ep, vllm.API_KEY_ENV), *own]
    if role.kv_connector is not None:  # the connector signs pushes and records, and checks the router's params
        env.insert(2, _secret_env(ep, envs.CLUSTER_SECRET.name))
    variables = ep.config.spec.worker.environment_variables
    return env + [var.manifest() for var in variables if var.name not in vllm.CLIENT_KEY_ENV]


def _worker_env(ep: _Endpoint) -> list[Manifest]:
    """The pod's own (downward API), HOME, the secrets (references), then the resource's, in its order."""
    env = [*_downward_env(), _home_env(), _secret_env(ep, envs.CLUSTER_SECRET.name)]
    if ep.config.needs_local_redis:
        env.append(_secret_env(ep, envs.REDIS_PASSWORD.name, REDIS_PASSWORD_KEY))
    return env + [var.manifest() for var in ep.config.spec.worker.environment_variables]


def _worker_ports(ep: _Endpoint, role: RolePlan) -> list[Manifest]:
    ports = [_port(_port_name(ep), role.container_port)]
    if ep.plan.router.vllm_events:
        events, replay = vllm.event_ports(role.container_port, in_pod=True)
        ports += [_port(vllm.EVENTS_PORT_NAME, events), _port(vllm.REPLAY_PORT_NAME, replay)]
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
    mounts = _model_mounts(ep) + _scratch_mounts()
    if ep.is_vllm:
        mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
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
        "image": ep.router_image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["splitserve", "router"],
        "args": [
            *router.flags,
            "--host",
            "0.0.0.0",
            "--port",
            str(ROUTER_PORT),
            "--admin-port",
            str(ROUTER_ADMIN_PORT),
            "--shutdown-timeout",
            str(SHUTDOWN_TIMEOUT_S),
            *_traces_args(ep),
            *bootstrap,
        ],
        "ports": [_port(HTTP_PORT_NAME, ROUTER_PORT)],
        "env": _router_env(ep),
        "resources": ROUTER_RESOURCES,
        # /health is 503 until a worker is healthy: right for readiness, wrong for liveness
        "readinessProbe": {"httpGet": {"path": router.health_check_path, "port": HTTP_PORT_NAME}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": HTTP_PORT_NAME}, "periodSeconds": 15, "failureThreshold": 4},
        "lifecycle": _pre_stop(),
        "securityContext": _container_security(),
        "volumeMounts": _model_mounts(ep) + _scratch_mounts(),
    }
    volumes = _model_volumes(ep) + _scratch_volumes() + [_api_access_volume()]
    containers = [_pruned(container), _discovery_container(ep)]
    if ep.traces:
        containers.append(collector.container(_container_security()))
        volumes.append(collector.volume(ep.name))
    spread = {"affinity": _spread_over_nodes(ep, "router")} if router.replicas > 1 else {}
    pod_spec = _pod_spec(containers, volumes, serviceAccountName=router.name,
                         terminationGracePeriodSeconds=TERMINATION_GRACE_S, **spread)  # fmt: skip
    pod = {"metadata": _pod_metadata(ep, _labels(ep, "router"), ROUTER_PORT), "spec": pod_spec}
    return _deployment(ep, router.name, "router", router.replicas, pod)


def _spread_over_nodes(ep: _Endpoint, component: str) -> Manifest:
    """Replicas on different nodes where the scheduler can: one node's loss takes one of them."""
    term = {"labelSelector": {"matchLabels": selector_labels(ep.name, component)}, "topologyKey": HOSTNAME_TOPOLOGY}
    return {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "podAffinityTerm": term}]}}  # fmt: skip


def _router_disruption_budget(ep: _Endpoint) -> Manifest:
    """Router replicas leave one at a time on a voluntary disruption (a node drain, an upgrade): the others serve."""
    selector = {"matchLabels": selector_labels(ep.name, "router")}
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(ep, ep.plan.router.name, "router"),
        "spec": {"maxUnavailable": 1, "selector": selector},
    }


def _router_env(ep: _Endpoint) -> list[Manifest]:
    """HOME, the cluster secret, and the client keys the resource sets (the router is where clients come in)."""
    keys = [var.manifest() for var in ep.config.spec.worker.environment_variables if var.name in ROUTER_ENV_NAMES]
    return [_home_env(), _secret_env(ep, envs.CLUSTER_SECRET.name), *keys]


def _discovery_container(ep: _Endpoint) -> Manifest:
    """The sidecar that lists worker pods: the one container with the service account's token."""
    token = {"name": API_VOLUME, "mountPath": SERVICE_ACCOUNT_DIR, "readOnly": True}
    return {
        "name": "discovery",
        "image": ep.router_image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["splitserve", "k8s-discovery"],
        "args": _discovery_args(ep),
        "env": [_secret_env(ep, envs.CLUSTER_SECRET.name)],  # its PUT /admin/workers carries the cluster secret
        "resources": DISCOVERY_RESOURCES,
        "securityContext": _container_security(),
        "volumeMounts": [{"name": TMP_VOLUME, "mountPath": "/tmp"}, token],
    }


def _discovery_args(ep: _Endpoint) -> list[str]:
    port = ep.config.spec.worker.model_invocation_port.container_port
    return [
        "--namespace", ep.namespace,
        "--selector", worker_selector(ep.config),
        "--port", str(port),
        "--router", f"http://127.0.0.1:{ROUTER_ADMIN_PORT}",
    ]  # fmt: skip


def _api_access_volume() -> Manifest:
    """What ``automountServiceAccountToken`` would mount in every container: a token (renewed by the kubelet),
    the cluster's CA and the namespace; here mounted by the discovery sidecar only."""
    sources = [
        {"serviceAccountToken": {"path": "token", "expirationSeconds": TOKEN_EXPIRY_S}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
    ]
    return {"name": API_VOLUME, "projected": {"sources": sources}}


def _router_rbac(ep: _Endpoint) -> list[Manifest]:
    """The router pod's identity: its discovery sidecar may get, list and watch pods in the namespace."""
    name = ep.plan.router.name
    subject = {"kind": "ServiceAccount", "name": name, "namespace": ep.namespace}
    rule = {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    role_ref = {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(ep, name, "router"),
         "automountServiceAccountToken": False},
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
        "command": ["sh", "-c", REDIS_SCRIPT, "redis-server"],
        "args": ["--save", "", "--appendonly", "no", "--maxmemory", REDIS_MAX_MEMORY,
                 "--maxmemory-policy", "allkeys-lru"],
        "ports": _redis_ports(),
        "env": [_secret_env(ep, "REDIS_PASSWORD", REDIS_PASSWORD_KEY)],
        "resources": REDIS_RESOURCES,
        "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 15},
        "securityContext": _container_security(),
        "volumeMounts": [{"name": REDIS_DATA_VOLUME, "mountPath": "/data"}],
    }  # fmt: skip
    volumes = [{"name": REDIS_DATA_VOLUME, "emptyDir": {"sizeLimit": SCRATCH_SIZE}}]
    pod = {"metadata": _pod_metadata(ep, _labels(ep, "redis"), None), "spec": _pod_spec([container], volumes)}
    return _deployment(ep, f"{ep.name}-redis", "redis", 1, pod)


def _redis_ports() -> list[Manifest]:
    return [_port("redis", REDIS_PORT)]


# ---------------------------------------------------------------------------------------------- the network


def _network(ep: _Endpoint) -> Network:
    port = ep.config.spec.worker.model_invocation_port.container_port
    return Network(
        namespace=ep.namespace,
        endpoint=ep.name,
        labels={k: v for k, v in _labels(ep, "").items() if k != LABEL_COMPONENT},  # netpol sets the component
        worker_components=tuple(COMPONENTS[role.role] for role in ep.plan.roles),
        worker_port=port,
        worker_event_ports=vllm.event_ports(port, in_pod=True) if ep.plan.router.vllm_events else (),
        kv_port=kv_transfer_port(port) if ep.plan.is_disaggregated else None,
        router_port=ROUTER_PORT,
        router_takes_events=ep.plan.router.kv_events,
        redis_port=REDIS_PORT if ep.config.needs_local_redis else None,
        external_redis_port=_external_redis_port(ep),
        traces_exporter_port=_traces_exporter_port(ep),
    )


def _traces_exporter_port(ep: _Endpoint) -> int | None:
    exporter = ep.config.spec.metrics.traces_exporter_endpoint
    return collector.exporter_port(exporter) if ep.traces and exporter is not None else None


def _external_redis_port(ep: _Endpoint) -> int | None:
    """The port of a Redis the resource names (``l2CacheLocalUrl``; 6379 when the URL gives none), else None."""
    if ep.plan.l2_backend != L2Backend.REDIS or ep.config.needs_local_redis or ep.plan.l2_url is None:
        return None
    url = urlsplit(ep.plan.l2_url)
    return None if url.scheme == "unix" else url.port or REDIS_PORT


# ---------------------------------------------------------------------------------------------- shared shapes


def _pod_spec(containers: list[Manifest], volumes: list[Manifest], **extra: Any) -> Manifest:
    """A restricted pod: non-root, seccomp, no service-account token, no service links."""
    spec = {"automountServiceAccountToken": False, "securityContext": _pod_security(), "enableServiceLinks": False,
            **extra, "containers": containers, "volumes": volumes}  # fmt: skip
    return _pruned(spec)


def _pod_security() -> Manifest:
    return {"runAsNonRoot": True, "runAsUser": RUN_AS_ID, "runAsGroup": RUN_AS_ID, "fsGroup": RUN_AS_ID,
            "seccompProfile": {"type": "RuntimeDefault"}}  # fmt: skip


def _container_security() -> Manifest:
    """Restricted (Pod Security Standards): no escalation, no capability, a read-only root filesystem."""
    return {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]}}  # fmt: skip


def _scratch_volumes() -> list[Manifest]:
    """The writable places of a splitserve container, whose root filesystem is read-only."""
    return [{"name": name, "emptyDir": {"sizeLimit": SCRATCH_SIZE}} for name in (TMP_VOLUME, HOME_VOLUME)]


def _scratch_mounts() -> list[Manifest]:
    return [{"name": TMP_VOLUME, "mountPath": "/tmp"}, {"name": HOME_VOLUME, "mountPath": HOME_DIR}]


def _home_env() -> Manifest:
    return {"name": "HOME", "value": HOME_DIR}


def _deployment(ep: _Endpoint, name: str, component: str, replicas: int | None, pod: Manifest) -> Manifest:
    """A Deployment of ``pod`` (its ``metadata`` and ``spec``), selected by ``selector_labels``; ``replicas`` None:
    left to an autoscaler."""
    spec = {"selector": {"matchLabels": selector_labels(ep.name, component)}, "template": pod}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(ep, name, component),
        "spec": spec if replicas is None else {"replicas": replicas, **spec},
    }


def _pod_metadata(ep: _Endpoint, labels: dict[str, str], port: int | None) -> Manifest:
    """Pod labels; the Secret's digest; Prometheus' scrape annotations when ``spec.metrics.enabled``."""
    annotations = {SECRET_HASH_ANNOTATION: _secret_hash(ep)}
    if ep.config.spec.metrics.enabled and port is not None:
        annotations |= {"prometheus.io/scrape": "true", "prometheus.io/port": str(port)}
        annotations["prometheus.io/path"] = "/metrics"
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

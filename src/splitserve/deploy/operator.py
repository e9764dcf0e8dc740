"""The operator: keeps each ``InferenceEndpointConfig`` in the cluster running as :func:`render` describes it.

Thin by design (kopf's habit): the handlers translate a kopf call into one pure-ish function here, and those
functions take the resource body and a :class:`KubeClient`, so tests drive them with a fake client and no
kopf. :func:`reconcile` (create, update, resume) parses the body with ``endpoint.parse_endpoint``, renders,
applies every manifest (server-side apply, owned by the resource) and deletes what an earlier render made
and this one does not (toggling ``pdSpec`` swaps the colocated Deployment for prefill and decode ones).
:func:`refresh` (a timer) reads the Deployments and sets the ``Ready`` condition (and keeps a prefill pool
that follows the decode pool at its ``decodeRatio``, :func:`keep_prefill_ratio`); :func:`teardown` (delete)
removes this endpoint's objects. A resource that does not validate is never an exception: its ``Ready``
condition is False with reason ``InvalidSpec`` and the EndpointError's text.

The operator never takes over what it does not own. An object is the endpoint's when the resource is its
controller (an owner reference with the resource's uid). When a rendered object's name is taken by another
object, nothing is applied: the ``Ready`` condition is False with reason ``Conflict`` and names the objects, and
the timer tries again. Only the endpoint's own objects are applied with ``force`` (taking back fields another
manager changed), pruned or deleted. The endpoint's Secret keeps its values: each reconcile renders with the
live Secret's (``render(secret_values=...)``), so the cluster secret is made once, not on every reconcile.

Namespaced by default: ``splitserve operator`` watches its own namespace (``--namespace`` for others,
``--all-namespaces`` for every one), and :func:`install_manifests` grants it a Role there; a ClusterRole only
with ``cluster_wide``.

kopf is imported only by :func:`run_operator` (``splitserve operator``); install it with the ``operator`` extra.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

from splitserve import envs
from splitserve.config import Role
from splitserve.deploy.autoscale import RoleLoad, recommend
from splitserve.deploy.crd import GROUP, PLURAL, VERSION, crd
from splitserve.deploy.labels import (
    COMPONENTS,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    MANAGED_BY,
    managed_selector,
)
from splitserve.deploy.netpol import API_SERVER_PORTS, DNS_PORT
from splitserve.deploy.plan import Target, plan
from splitserve.deploy.render import (
    DEFAULT_IMAGE,
    POD_NAMESPACE_ENV,
    ROUTER_PORT,
    RUN_AS_ID,
    Manifest,
    decode_secret,
    in_cluster_redis_url,
    render,
    secret_name,
)
from splitserve.endpoint import EndpointError, InferenceEndpointConfig, parse_endpoint
from splitserve.kube import SERVICE_ACCOUNT_DIR, KubeApi, KubeApiError

logger = logging.getLogger("splitserve.operator")

READY = "Ready"
CONFLICT = "Conflict"  # the Ready condition's reason while a rendered object's name is taken by another object
READY_DPD = "DPD prefill and decode deployments are ready"
READY_COLOCATED = "Endpoint deployment is ready"
FIELD_MANAGER = "splitserve-operator"
DEFAULT_INTERVAL_S = 10.0
RETRY_DELAY_S = 10.0
# What render() makes, pruned and deleted in this order (workloads first, their identity and secret last).
MANAGED_KINDS = (
    ("apps/v1", "Deployment"),
    ("policy/v1", "PodDisruptionBudget"),
    ("autoscaling/v2", "HorizontalPodAutoscaler"),
    ("v1", "Service"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("v1", "ServiceAccount"),
    ("v1", "ConfigMap"),
    ("v1", "Secret"),
)

Clock = Callable[[], datetime]


class KubeClient(Protocol):
    """The calls the operator makes (``kube.KubeApi``, or a fake). Namespaced objects only; errors raise
    KubeApiError, and the operator retries the handler later."""

    def apply(self, manifest: Manifest, *, force: bool = False) -> None:
        """Create or update ``manifest`` (server-side apply: fields it leaves out are released). ``force`` takes
        over fields another manager set; without it such a conflict is an KubeApiError."""
        ...

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Manifest | None:
        """The object, or None if there is none."""
        ...

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[Manifest]:
        """The objects of ``kind`` matching the label ``selector``."""
        ...

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        """Delete the object; one that is already gone is not an error."""
        ...

    def scale(self, api_version: str, kind: str, namespace: str, name: str, replicas: int) -> None:
        """Set the object's replicas through its scale subresource (as a HorizontalPodAutoscaler does)."""
        ...


# ---------------------------------------------------------------------------------------------- handlers


def reconcile(
    body: Mapping[str, Any], client: KubeClient, *, now: Clock | None = None, default_image: str = DEFAULT_IMAGE
) -> dict[str, Any]:
    """Make the cluster match the resource ``body``; returns the new ``status``.

    Renders with the live Secret's values, then, unless a rendered name is taken by an object the resource does
    not own (a ``Conflict`` condition, nothing applied), applies every manifest in order and deletes this
    endpoint's objects that the render no longer has. An invalid resource touches nothing and gets an
    ``InvalidSpec`` condition. Raises KubeApiError.
    """
    uid = _uid(body)
    try:
        config = parse_endpoint(_plain(body))
        manifests = render(config, default_image=default_image, secret_values=_kept_secret(client, config, uid))
    except EndpointError as exc:
        logger.warning("%s is invalid; nothing applied: %s", _source(body), exc)
        return _invalid_status(body, exc, now)
    live = {_key(m): client.get(m["apiVersion"], m["kind"], _namespace(m), m["metadata"]["name"]) for m in manifests}
    taken = [f"{kind}/{name}" for (_, kind, name), obj in live.items() if obj is not None and not _is_own(obj, uid)]
    if taken:
        logger.warning("%s: not applied, not its own: %s", _source(body), ", ".join(taken))
        return _conflict_status(body, taken, now)
    owner = _owner_reference(body)
    for manifest in manifests:
        client.apply(_owned(manifest, owner), force=live[_key(manifest)] is not None)
    keep = {(m["kind"], m["metadata"]["name"]) for m in manifests}
    _delete_managed(client, config.metadata.namespace, config.metadata.name, keep, uid)
    keep_prefill_ratio(config, manifests, client)
    return _valid_status(body, config, manifests, client, now)


def refresh(
    body: Mapping[str, Any], client: KubeClient, *, now: Clock | None = None, default_image: str = DEFAULT_IMAGE
) -> dict[str, Any]:
    """The resource's ``status`` from its Deployments' readiness (the timer); reads only, except that it keeps a
    prefill pool's ``decodeRatio`` (:func:`keep_prefill_ratio`) and retries a ``Conflict`` with :func:`reconcile`.
    Raises KubeApiError."""
    if _ready_reason(body) == CONFLICT:
        return reconcile(body, client, now=now, default_image=default_image)
    try:
        config = parse_endpoint(_plain(body))
        manifests = render(config, default_image=default_image)
    except EndpointError as exc:
        return _invalid_status(body, exc, now)
    keep_prefill_ratio(config, manifests, client)
    return _valid_status(body, config, manifests, client, now)


def keep_prefill_ratio(
    config: InferenceEndpointConfig, manifests: Sequence[Manifest], client: KubeClient
) -> int | None:
    """With ``spec.autoscaling.prefill.decodeRatio``, set the prefill Deployment's replicas from the decode
    Deployment's (its HorizontalPodAutoscaler's, or the resource's): the ratio times them, rounded up, within
    the prefill bounds (``deploy/autoscale.py``), through the scale subresource, on every reconcile and timer.
    ``manifests``: the resource's render, which names the two Deployments. Returns the replicas it wants (None: no
    ratio to keep, or no decode Deployment yet)."""
    scaling = config.spec.autoscaling
    if scaling is None or not scaling.prefill_follows_decode or config.spec.pd_spec is None:
        return None
    assert scaling.prefill is not None
    names = {_component(m): m["metadata"]["name"] for m in manifests if m["kind"] == "Deployment"}
    prefill, decode = names[COMPONENTS[Role.PREFILL]], names[COMPONENTS[Role.DECODE]]
    namespace = config.metadata.namespace
    live_decode = client.get("apps/v1", "Deployment", namespace, decode)
    live_prefill = client.get("apps/v1", "Deployment", namespace, prefill)
    if live_decode is None or live_prefill is None:
        return None
    written = config.spec.pd_spec.decoding_spec.replicas
    decode_replicas = int((live_decode.get("spec") or {}).get("replicas", written))
    wanted = recommend(scaling.prefill, RoleLoad(0, 0.0, decode_replicas=decode_replicas))
    if (live_prefill.get("spec") or {}).get("replicas") != wanted:
        logger.info("%s: prefill replicas %d (decodeRatio %g of %d decode)", prefill, wanted,
                    scaling.prefill.decode_ratio, decode_replicas)  # fmt: skip
        client.scale("apps/v1", "Deployment", namespace, prefill, wanted)
    return wanted


def teardown(body: Mapping[str, Any], client: KubeClient) -> list[str]:
    """Delete this endpoint's objects (whatever the resource now says, valid or not): those labelled as its,
    and owned by it when the body has a uid.

    Returns ``Kind/name`` of each deleted object. Raises KubeApiError.
    """
    metadata = body.get("metadata") or {}
    namespace = metadata.get("namespace", "default")
    return _delete_managed(client, namespace, metadata["name"], keep=set(), uid=_uid(body))


def ready_condition(config: InferenceEndpointConfig, deployments: Mapping[str, Manifest | None]) -> dict[str, str]:
    """``status``, ``reason`` and ``message`` of the Ready condition, from each rendered Deployment's live
    object (None: not there). Ready when every one has all its desired replicas updated and ready."""
    waiting = [line for name, live in deployments.items() if (line := _not_ready(name, live)) is not None]
    if waiting:
        return {"status": "False", "reason": "DeploymentsNotReady", "message": "waiting for " + "; ".join(waiting)}
    message = READY_DPD if config.is_disaggregated else READY_COLOCATED
    return {"status": "True", "reason": "DeploymentsReady", "message": message}


def _not_ready(name: str, live: Manifest | None) -> str | None:
    if live is None:
        return f"{name} (not created)"
    wanted = int((live.get("spec") or {}).get("replicas", 1))
    status = live.get("status") or {}
    ready, updated = int(status.get("readyReplicas") or 0), int(status.get("updatedReplicas") or 0)
    generation = int((live.get("metadata") or {}).get("generation") or 0)
    is_current = int(status.get("observedGeneration") or 0) >= generation
    if is_current and ready >= wanted and updated >= wanted:
        return None
    return f"{name} ({ready}/{wanted} ready)"


# ---------------------------------------------------------------------------------------------- status


def _valid_status(
    body: Mapping[str, Any], config: InferenceEndpointConfig, manifests: Sequence[Manifest], client: KubeClient,
    now: Clock | None,
) -> dict[str, Any]:  # fmt: skip
    namespace = config.metadata.namespace
    deployments = {
        m["metadata"]["name"]: client.get("apps/v1", "Deployment", namespace, m["metadata"]["name"])
        for m in manifests
        if m["kind"] == "Deployment"
    }
    warnings = plan(config, Target.KUBERNETES, redis_url=in_cluster_redis_url(config)).warnings
    router = next(m["metadata"]["name"] for m in manifests if _component(m) == "router" and m["kind"] == "Service")
    status = _status(body, ready_condition(config, deployments), now)
    return {**status, "url": f"http://{router}.{namespace}.svc:{ROUTER_PORT}", "warnings": list(warnings)}


def _invalid_status(body: Mapping[str, Any], error: EndpointError, now: Clock | None) -> dict[str, Any]:
    condition = {"status": "False", "reason": "InvalidSpec", "message": str(error)}
    return {**_status(body, condition, now), "url": None, "warnings": []}


def _conflict_status(body: Mapping[str, Any], taken: Sequence[str], now: Clock | None) -> dict[str, Any]:
    message = (
        f"nothing applied: {', '.join(taken)} already exist and are not this endpoint's "
        "(delete them, or give the endpoint another name)"
    )
    condition = {"status": "False", "reason": CONFLICT, "message": message}
    return {**_status(body, condition, now), "url": None, "warnings": []}


def _ready_reason(body: Mapping[str, Any]) -> str | None:
    return next((c.get("reason") for c in _conditions(body) if c.get("type") == READY), None)


def _status(body: Mapping[str, Any], condition: dict[str, str], now: Clock | None) -> dict[str, Any]:
    """``observedGeneration`` and the Ready condition; its ``lastTransitionTime`` moves only when its status does."""
    generation = (body.get("metadata") or {}).get("generation")
    previous = next((c for c in _conditions(body) if c.get("type") == READY), None)
    stamp = (now or _utcnow)().strftime("%Y-%m-%dT%H:%M:%SZ")
    if previous is not None and previous.get("status") == condition["status"]:
        stamp = previous["lastTransitionTime"]
    ready = {"type": READY, **condition, "lastTransitionTime": stamp}
    if generation is not None:
        ready["observedGeneration"] = generation
    others = [c for c in _conditions(body) if c.get("type") != READY]
    return {"observedGeneration": generation, "conditions": [ready, *others]}


def _conditions(body: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    conditions = (body.get("status") or {}).get("conditions") or []
    return [c for c in conditions if isinstance(c, Mapping) and "lastTransitionTime" in c]


def _utcnow() -> datetime:
    return datetime.now(UTC)


# ---------------------------------------------------------------------------------------------- objects


def _delete_managed(
    client: KubeClient, namespace: str, endpoint: str, keep: set[tuple[str, str]], uid: str | None
) -> list[str]:
    """Delete the endpoint's objects not in ``keep``: labelled as its, and owned by it (when ``uid`` is known)."""
    deleted = []
    for api_version, kind in MANAGED_KINDS:
        for obj in client.list(api_version, kind, namespace, managed_selector(endpoint)):
            name = obj["metadata"]["name"]
            if (kind, name) not in keep and (uid is None or _is_own(obj, uid)):
                client.delete(api_version, kind, namespace, name)
                deleted.append(f"{kind}/{name}")
    if deleted:
        logger.info("%s/%s: deleted %s", namespace, endpoint, ", ".join(deleted))
    return deleted


def _kept_secret(client: KubeClient, config: InferenceEndpointConfig, uid: str | None) -> dict[str, str]:
    """The values of the endpoint's live Secret when it is the endpoint's own; else none (render makes new ones)."""
    live = client.get("v1", "Secret", config.metadata.namespace, secret_name(config.metadata.name))
    return decode_secret(live) if live is not None and _is_own(live, uid) else {}


def _is_own(obj: Manifest, uid: str | None) -> bool:
    """The resource (``uid``) is the object's controller; without a uid (no API server: tests, dry runs), the
    object carries the managed-by label."""
    metadata = obj.get("metadata") or {}
    if uid is None:
        return (metadata.get("labels") or {}).get(LABEL_MANAGED_BY) == MANAGED_BY
    refs = metadata.get("ownerReferences") or []
    return any(ref.get("uid") == uid and ref.get("controller") for ref in refs)


def _uid(body: Mapping[str, Any]) -> str | None:
    return (body.get("metadata") or {}).get("uid") or None


def _key(manifest: Manifest) -> tuple[str, str, str]:
    return manifest["apiVersion"], manifest["kind"], manifest["metadata"]["name"]


def _namespace(manifest: Manifest) -> str:
    return str(manifest["metadata"]["namespace"])


def _owner_reference(body: Mapping[str, Any]) -> Manifest | None:
    """The resource as its objects' controller (Kubernetes then deletes them with it); None without a uid."""
    metadata = body.get("metadata") or {}
    if not metadata.get("uid"):
        return None
    return {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"), "name": metadata["name"],
            "uid": metadata["uid"], "controller": True, "blockOwnerDeletion": True}  # fmt: skip


def _owned(manifest: Manifest, owner: Manifest | None) -> Manifest:
    if owner is None:
        return manifest
    return {**manifest, "metadata": {**manifest["metadata"], "ownerReferences": [owner]}}


def _component(manifest: Manifest) -> str | None:
    return manifest["metadata"].get("labels", {}).get(LABEL_COMPONENT)


def _source(body: Mapping[str, Any]) -> str:
    metadata = body.get("metadata") or {}
    return (
        f"{body.get('kind', 'InferenceEndpointConfig')} {metadata.get('namespace', 'default')}/{metadata.get('name')}"
    )


def _plain(value: Any) -> Any:
    """kopf's mapping views (and any Mapping) as plain dicts and lists, for pydantic."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


# ---------------------------------------------------------------------------------------------- the real client


# ---------------------------------------------------------------------------------------------- running


def register(
    kopf: Any, client: KubeClient, *, interval_s: float = DEFAULT_INTERVAL_S, default_image: str = DEFAULT_IMAGE,
    registry: Any = None,
) -> None:  # fmt: skip
    """Register the handlers with ``registry`` (None: kopf's default one). ``kopf`` is the module, passed in so
    that tests can hand in a fake."""
    resource = (GROUP, VERSION, PLURAL)
    options = {} if registry is None else {"registry": registry}

    def on_apply(body: Any, patch: Any, **_: Any) -> None:
        status = _retrying(kopf, lambda: reconcile(body, client, default_image=default_image))
        patch.status.update(status)

    def on_timer(body: Any, patch: Any, **_: Any) -> None:
        patch.status.update(_retrying(kopf, lambda: refresh(body, client, default_image=default_image)))

    def on_delete(body: Any, **_: Any) -> None:
        _retrying(kopf, lambda: teardown(body, client))

    for decorator in (kopf.on.create, kopf.on.update, kopf.on.resume):
        decorator(*resource, id="apply", **options)(on_apply)
    kopf.on.delete(*resource, id="delete", **options)(on_delete)
    kopf.timer(*resource, id="status", interval=interval_s, initial_delay=interval_s, **options)(on_timer)


def _retrying(kopf: Any, call: Callable[[], Any]) -> Any:
    try:
        return call()
    except KubeApiError as exc:
        raise kopf.TemporaryError(str(exc), delay=RETRY_DELAY_S) from exc


def watched_namespaces(
    namespaces: Sequence[str], all_namespaces: bool, *, own_namespace: str | None = None
) -> list[str] | None:
    """The namespaces ``splitserve operator`` watches: ``namespaces``, else its own (``own_namespace``: the
    pod's, from the downward API or the service account); None: every namespace (``all_namespaces``).

    Raises RuntimeError when both are given, or neither and the operator's own namespace is unknown.
    """
    if all_namespaces:
        if namespaces:
            raise RuntimeError("--namespace and --all-namespaces exclude each other")
        return None
    if namespaces:
        return list(namespaces)
    if not own_namespace:
        raise RuntimeError("not in a pod, so no namespace of its own: give --namespace NAME or --all-namespaces")
    return [own_namespace]


def own_namespace() -> str | None:
    """The operator pod's namespace: ``SPLITSERVE_POD_NAMESPACE``, else the service account's; None outside a pod."""
    if namespace := envs.get(envs.POD_NAMESPACE):
        return namespace
    try:
        return (SERVICE_ACCOUNT_DIR / "namespace").read_text().strip() or None
    except OSError:
        return None


def run_operator(
    *, namespaces: Sequence[str] = (), all_namespaces: bool = False, api_server: str | None = None,
    interval_s: float = DEFAULT_INTERVAL_S, default_image: str = DEFAULT_IMAGE, liveness_port: int = 8081,
) -> int:  # fmt: skip
    """``splitserve operator``: watch :func:`watched_namespaces` until stopped.

    Namespaced, it neither lists namespaces nor watches CRDs (kopf's scanning is off), so a Role in each
    watched namespace is all it needs. Raises RuntimeError before starting when kopf is missing, there is no API
    server to talk to, or no namespace to watch.
    """
    watched = watched_namespaces(namespaces, all_namespaces, own_namespace=own_namespace())
    try:
        import kopf
    except ImportError:
        raise RuntimeError("splitserve operator needs kopf: pip install 'splitserve[operator]'") from None
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [%(name)s] %(message)s")
    register(
        kopf,
        KubeApi.connect(api_server, field_manager=FIELD_MANAGER),
        interval_s=interval_s,
        default_image=default_image,
    )
    settings = kopf.OperatorSettings()
    settings.scanning.disabled = watched is not None
    logger.info("watching %s", "every namespace" if watched is None else ", ".join(watched))
    kopf.run(
        standalone=True,
        clusterwide=watched is None,
        namespaces=watched or [],
        settings=settings,
        liveness_endpoint=f"http://0.0.0.0:{liveness_port}/healthz",
    )
    return 0


# ---------------------------------------------------------------------------------------------- installing


OPERATOR_NAME = "splitserve-operator"


def install_manifests(
    namespace: str = "splitserve-system", image: str = DEFAULT_IMAGE, liveness_port: int = 8081,
    *, cluster_wide: bool = False,
) -> list[Manifest]:  # fmt: skip
    """The CRD and the operator itself (ServiceAccount, its RBAC, Deployment and NetworkPolicy in ``namespace``,
    which must exist): ``splitserve render --operator | kubectl apply -f -``.

    Namespaced by default: a Role and RoleBinding in ``namespace``, and the operator watches that namespace
    only. ``cluster_wide``: a ClusterRole and ClusterRoleBinding, and it watches every namespace.
    """
    labels = {LABEL_NAME: "splitserve", LABEL_INSTANCE: OPERATOR_NAME, LABEL_COMPONENT: "operator",
              LABEL_MANAGED_BY: MANAGED_BY}  # fmt: skip
    role_kind = "ClusterRole" if cluster_wide else "Role"

    def meta(*, namespaced: bool = True) -> Manifest:  # a copy per object: YAML without aliases
        return {"name": OPERATOR_NAME, **({"namespace": namespace} if namespaced else {}), "labels": dict(labels)}

    subject = {"kind": "ServiceAccount", "name": OPERATOR_NAME, "namespace": namespace}
    role_ref = {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind, "name": OPERATOR_NAME}
    return [
        crd(),
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta()},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": role_kind, "metadata": meta(namespaced=not cluster_wide),
         "rules": _operator_rules(cluster_wide)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": f"{role_kind}Binding",
         "metadata": meta(namespaced=not cluster_wide), "subjects": [subject], "roleRef": role_ref},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(),
         "spec": _operator_deployment_spec(labels, image, liveness_port, cluster_wide)},
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta(),
         "spec": _operator_network_policy(labels)},
    ]  # fmt: skip


def _operator_network_policy(labels: dict[str, str]) -> Manifest:
    """The operator takes no connection (the kubelet's probes pass anyway) and opens only the API server's and DNS."""
    api = {"ports": [{"protocol": "TCP", "port": port} for port in API_SERVER_PORTS]}
    dns = {"ports": [{"protocol": protocol, "port": DNS_PORT} for protocol in ("UDP", "TCP")]}
    selector = {"matchLabels": {k: v for k, v in labels.items() if k != LABEL_MANAGED_BY}}
    return {"podSelector": selector, "policyTypes": ["Ingress", "Egress"], "egress": [api, dns]}


def _operator_deployment_spec(labels: dict[str, str], image: str, liveness_port: int, cluster_wide: bool) -> Manifest:
    """One operator (standalone: no peering), restricted like the endpoint's pods; it keeps its token (it talks to
    the API server) and learns its namespace from the downward API."""
    namespace_env = {"name": POD_NAMESPACE_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}
    container = {
        "name": "operator", "image": image, "imagePullPolicy": "IfNotPresent",
        "command": ["splitserve", "operator", *(["--all-namespaces"] if cluster_wide else [])],
        "env": [namespace_env],
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": liveness_port}, "periodSeconds": 15},
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": liveness_port}, "periodSeconds": 15},
        "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"cpu": "500m", "memory": "512Mi"}},
        "securityContext": {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }  # fmt: skip
    pod_security = {"runAsNonRoot": True, "runAsUser": RUN_AS_ID, "runAsGroup": RUN_AS_ID,
                    "seccompProfile": {"type": "RuntimeDefault"}}  # fmt: skip
    pod_spec = {"serviceAccountName": OPERATOR_NAME, "automountServiceAccountToken": True,
                "securityContext": pod_security, "containers": [container],
                "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}}]}  # fmt: skip
    return {
        "replicas": 1,
        "strategy": {"type": "Recreate"},
        "selector": {"matchLabels": {k: v for k, v in labels.items() if k != LABEL_MANAGED_BY}},
        "template": {"metadata": {"labels": dict(labels)}, "spec": pod_spec},
    }


def _operator_rules(cluster_wide: bool) -> list[Manifest]:
    """What the operator needs: the resource and its status, events, what render() makes, and pods (a Role can
    grant only what its creator holds; the router's discovery lists pods). Cluster-wide, kopf also watches
    namespaces and CRDs (its scanning, which is off for a namespaced operator)."""
    manage = ("get", "list", "watch", "create", "update", "patch", "delete")
    read = ("get", "list", "watch")
    rules: list[Manifest] = [
        {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": [*read, "patch", "update"]},
        {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["get", "patch", "update"]},
        {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
        {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": list(manage)},
        {"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["get", "patch", "update"]},
        {
            "apiGroups": [""],
            "resources": ["services", "serviceaccounts", "secrets", "configmaps"],
            "verbs": list(manage),
        },
        {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": list(manage)},
        {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": list(manage)},
        {"apiGroups": ["autoscaling"], "resources": ["horizontalpodautoscalers"], "verbs": list(manage)},
        {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles", "rolebindings"], "verbs": list(manage)},
        {"apiGroups": [""], "resources": ["pods"], "verbs": list(read)},
    ]
    if cluster_wide:
        rules.append(
            {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": list(read)}
        )
        rules.append({"apiGroups": [""], "resources": ["namespaces"], "verbs": list(read)})
    return rules

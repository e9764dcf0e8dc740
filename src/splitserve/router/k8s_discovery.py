"""Kubernetes discovery for the router: ready worker pods, found by label, become the router's worker list.

The router runs with this as a sidecar (``splitserve k8s-discovery``, see ``splitserve.deploy.render``). Every
``interval_s`` it lists the pods that match a label selector, keeps the ready ones, turns each into
``http://<pod IP>:<port>`` in its role's list (``splitserve.io/dpd-role`` prefill or decode, otherwise a
colocated backend), and when that differs from what the router holds (``GET /admin/workers``) it sends the
lists with ``PUT /admin/workers``. A worker's URL is the one it advertises (``--advertise-url``), so its KV
events match it. The lists are left alone while no pod of the kind the router needs is ready (it refuses an
update without decode workers, or without backends), so a rollout never empties the router.

Pods come from a :class:`PodLister`: :class:`ApiPodLister` speaks HTTP(S) to the API server with httpx (in a
pod: the service account's token and CA; elsewhere e.g. ``kubectl proxy``), :class:`ClientPodLister` uses the
``kubernetes`` package when it is installed. Tests inject a fake lister or an httpx mock transport.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from splitserve.auth import bearer_header
from splitserve.config import cluster_secret
from splitserve.kube import KubeApi
from splitserve.router.discovery import WorkerRole

logger = logging.getLogger("splitserve.k8s_discovery")

ROLE_LABEL = "splitserve.io/dpd-role"
DEFAULT_INTERVAL_S = 5.0
HTTP_TIMEOUT_S = 5.0

Pod = Mapping[str, Any]  # a Pod as the API returns it (camelCase JSON)


@dataclass(frozen=True, slots=True)
class WorkerLists:
    """The router's workers by role, as ``PUT /admin/workers`` takes them (each list sorted)."""

    backend: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()

    def body(self) -> dict[str, list[str]]:
        return {role.value: list(getattr(self, role.value)) for role in WorkerRole}

    @property
    def is_usable(self) -> bool:
        """The router accepts it: some decode workers (disaggregated) or some backends (colocated)."""
        return bool(self.decode or self.backend)

    @classmethod
    def from_router(cls, answer: Any) -> WorkerLists:
        """The lists in a ``GET /admin/workers`` answer (``{"workers": [{"url", "role", ...}]}``)."""
        workers = answer.get("workers", []) if isinstance(answer, dict) else []
        return cls._of((str(w.get("role")), str(w.get("url"))) for w in workers if isinstance(w, dict))

    @classmethod
    def _of(cls, pairs: Iterable[tuple[str, str]]) -> WorkerLists:
        by_role: dict[str, list[str]] = {role.value: [] for role in WorkerRole}
        for role, url in pairs:
            if role in by_role:
                by_role[role].append(url)
        return cls(**{role: tuple(sorted(set(urls))) for role, urls in by_role.items()})


def is_ready(pod: Pod) -> bool:
    """Running, Ready, with an IP, and not being deleted."""
    status, metadata = pod.get("status") or {}, pod.get("metadata") or {}
    conditions = status.get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return (
        ready
        and status.get("phase") == "Running"
        and bool(status.get("podIP"))
        and not metadata.get("deletionTimestamp")
    )


def pod_role(pod: Pod) -> WorkerRole:
    """prefill or decode from the ``splitserve.io/dpd-role`` label; a colocated backend without it."""
    label = ((pod.get("metadata") or {}).get("labels") or {}).get(ROLE_LABEL)
    return WorkerRole(label) if label in (WorkerRole.PREFILL, WorkerRole.DECODE) else WorkerRole.BACKEND


def worker_lists(pods: Iterable[Pod], port: int) -> WorkerLists:
    """The ready pods as router workers: ``http://<pod IP>:<port>`` by role (IPv6 addresses bracketed)."""
    pairs = []
    for pod in pods:
        if is_ready(pod):
            ip = str(pod["status"]["podIP"])
            host = f"[{ip}]" if ":" in ip else ip
            pairs.append((pod_role(pod).value, f"http://{host}:{port}"))
    return WorkerLists._of(pairs)


# ---------------------------------------------------------------------------------------------- listing pods


class PodLister(Protocol):
    def list_pods(self, namespace: str, selector: str) -> Sequence[Pod]:
        """The pods of ``namespace`` matching the label ``selector``; raises on any API failure."""
        ...


def default_pod_lister(api_server: str | None = None) -> PodLister:
    """``api_server`` given (e.g. ``kubectl proxy``'s http://127.0.0.1:8001): plain HTTP to it; otherwise HTTPS to
    the in-cluster API with the service account (``splitserve.kube``)."""
    return KubeApi.connect(api_server, timeout_s=HTTP_TIMEOUT_S)


# ---------------------------------------------------------------------------------------------- the loop


class KubernetesDiscovery:
    """Keeps the router's worker lists equal to the ready pods that match ``selector``.

    ``pods`` lists pods; ``router`` is an httpx client whose base URL is the router (``http://127.0.0.1:8080``).
    Not thread-safe; :meth:`run` is the only loop.
    """

    def __init__(
        self, pods: PodLister, router: httpx.Client, *, namespace: str, selector: str, port: int,
        interval_s: float = DEFAULT_INTERVAL_S,
    ) -> None:  # fmt: skip
        self.pods = pods
        self.router = router
        self.namespace = namespace
        self.selector = selector
        self.port = port
        self.interval_s = interval_s
        self.num_updates = 0  # PUTs the router accepted

    def sync_once(self) -> WorkerLists | None:
        """One round: list, compare, PUT if different. Returns the lists sent, or None when nothing was sent
        (no change, no usable lists, or an error, which is logged: the next round tries again)."""
        try:
            wanted = worker_lists(self.pods.list_pods(self.namespace, self.selector), self.port)
        except Exception as exc:  # any API failure: keep the router's lists, retry next round
            logger.warning("cannot list pods (%s): %s", self.selector, exc)
            return None
        if not wanted.is_usable:
            logger.warning("no ready worker pods the router can use yet (%s); its lists are kept", self.selector)
            return None
        try:
            held = WorkerLists.from_router(self._router_json("GET"))
            if held == wanted:
                return None
            self._router_json("PUT", wanted.body())
        except (httpx.HTTPError, ValueError) as exc:
            logger.warning("cannot update the router's workers: %s", exc)
            return None
        self.num_updates += 1
        logger.info("router workers: %s", _describe(wanted))
        return wanted

    def run(self, stop: threading.Event | None = None, *, sleep: Callable[[float], Any] | None = None) -> None:
        """Sync every ``interval_s`` until ``stop`` is set (forever without one)."""
        stop = stop or threading.Event()
        wait = sleep or stop.wait
        while not stop.is_set():
            self.sync_once()
            wait(self.interval_s)

    def _router_json(self, method: str, body: Any = None) -> Any:
        response = self.router.request(method, "/admin/workers", json=body)
        if response.status_code != 200:
            raise ValueError(f"{method} /admin/workers answered {response.status_code}: {response.text[:200]}")
        return response.json()


def _describe(lists: WorkerLists) -> str:
    parts = [f"{role.value} {', '.join(urls)}" for role in WorkerRole if (urls := getattr(lists, role.value))]
    return "; ".join(parts)


def run_discovery(
    *, namespace: str, selector: str, port: int, router_url: str, interval_s: float = DEFAULT_INTERVAL_S,
    api_server: str | None = None, log_level: str = "info",
) -> int:  # fmt: skip
    """``splitserve k8s-discovery``: sync the router's admin listener at ``router_url`` with the pods until killed.

    It authenticates with the cluster secret from ``SPLITSERVE_CLUSTER_SECRET``, as the router expects.
    """
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(asctime)s [%(name)s] %(message)s")
    pods = default_pod_lister(api_server)
    headers = bearer_header(cluster_secret(None))
    with httpx.Client(base_url=router_url, timeout=HTTP_TIMEOUT_S, trust_env=False, headers=headers) as router:
        discovery = KubernetesDiscovery(
            pods, router, namespace=namespace, selector=selector, port=port, interval_s=interval_s
        )
        logger.info("discovering %s in %s for %s every %.0f s", selector, namespace, router_url, interval_s)
        with contextlib.suppress(KeyboardInterrupt):
            discovery.run()
    return 0

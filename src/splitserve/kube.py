"""The one Kubernetes API client of splitserve: the operator's reads and server-side applies, the discovery
sidecar's pod listing. Plain HTTPS with httpx (the ``kubernetes`` package is not needed): ``kubectl proxy``'s
URL as given, or the in-cluster API with the pod's service account, whose token is read again on every request
(the kubelet rotates it). Namespaced objects only; every failure is an :class:`KubeApiError`.
"""

from __future__ import annotations

import builtins
from pathlib import Path
from typing import Any

import httpx

from splitserve import envs
from splitserve.errors import SplitserveError

Manifest = dict[str, Any]
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
PLURALS = {"Deployment": "deployments", "Service": "services", "ServiceAccount": "serviceaccounts",
           "Role": "roles", "RoleBinding": "rolebindings", "NetworkPolicy": "networkpolicies",
           "Secret": "secrets", "Pod": "pods", "ConfigMap": "configmaps",
           "PodDisruptionBudget": "poddisruptionbudgets",
           "HorizontalPodAutoscaler": "horizontalpodautoscalers"}  # fmt: skip


class KubeApiError(SplitserveError):
    """A Kubernetes API call that failed (unreachable, or answered 4xx/5xx)."""


class KubeApi:
    """The Kubernetes REST API over ``client`` (which holds the base URL and credentials)."""

    def __init__(self, client: httpx.Client, field_manager: str = "splitserve") -> None:
        self.client = client
        self.field_manager = field_manager

    @classmethod
    def connect(
        cls, api_server: str | None = None, timeout_s: float = 10.0, field_manager: str = "splitserve"
    ) -> KubeApi:
        """``api_server`` (e.g. ``kubectl proxy``'s http://127.0.0.1:8001) as is; None: the in-cluster API with
        the pod's service account (RuntimeError outside a pod)."""
        if api_server is not None:
            return cls(httpx.Client(base_url=api_server, timeout=timeout_s), field_manager)
        host, port = envs.get(envs.KUBERNETES_SERVICE_HOST), envs.get(envs.KUBERNETES_SERVICE_PORT)
        token = SERVICE_ACCOUNT_DIR / "token"
        if not host or not token.exists():
            raise RuntimeError("not in a Kubernetes pod: give --api-server (e.g. run kubectl proxy)")
        host = f"[{host}]" if ":" in host else host
        client = httpx.Client(
            base_url=f"https://{host}:{port}", verify=str(SERVICE_ACCOUNT_DIR / "ca.crt"), timeout=timeout_s,
            event_hooks={"request": [lambda request: _bearer(request, token)]},
        )  # fmt: skip
        return cls(client, field_manager)

    def apply(self, manifest: Manifest, *, force: bool = False) -> None:
        """Create or update ``manifest`` (server-side apply: fields it leaves out are released). ``force`` takes
        over fields another manager set; without it such a conflict is an KubeApiError."""
        meta = manifest["metadata"]
        path = _path(manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"])
        params = {"fieldManager": self.field_manager, "force": "true" if force else "false"}
        headers = {"Content-Type": "application/apply-patch+yaml"}
        self._call("PATCH", path, params=params, json=manifest, headers=headers)

    def scale(self, api_version: str, kind: str, namespace: str, name: str, replicas: int) -> None:
        """Set the replicas of a Deployment (or another scalable kind) through its scale subresource, as a
        HorizontalPodAutoscaler does: no field of the object's own is taken over."""
        path = _path(api_version, kind, namespace, name) + "/scale"
        headers = {"Content-Type": "application/merge-patch+json"}
        self._call("PATCH", path, json={"spec": {"replicas": replicas}}, headers=headers)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Manifest | None:
        """The object, or None if there is none."""
        found: Manifest | None = self._call("GET", _path(api_version, kind, namespace, name), missing_ok=True)
        return found

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[Manifest]:
        """The objects of ``kind`` matching the label ``selector``."""
        answer = self._call("GET", _path(api_version, kind, namespace), params={"labelSelector": selector})
        return list((answer or {}).get("items") or [])

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        """Delete the object; one that is already gone is not an error."""
        params = {"propagationPolicy": "Background"}
        self._call("DELETE", _path(api_version, kind, namespace, name), params=params, missing_ok=True)

    def list_pods(self, namespace: str, selector: str) -> builtins.list[Manifest]:
        """The pods of ``namespace`` matching the label ``selector`` (the discovery sidecar's one call)."""
        return self.list("v1", "Pod", namespace, selector)

    def _call(self, method: str, path: str, *, missing_ok: bool = False, **kwargs: Any) -> Any:
        try:
            response = self.client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise KubeApiError(f"{method} {path}: {exc}") from exc
        if response.status_code == 404 and missing_ok:
            return None
        if response.status_code >= 400:
            raise KubeApiError(f"{method} {path}: {response.status_code} {response.text[:300]}")
        try:
            return response.json()
        except ValueError as exc:
            raise KubeApiError(f"{method} {path}: the answer is not JSON") from exc


def _bearer(request: httpx.Request, token: Path) -> None:
    request.headers["Authorization"] = f"Bearer {token.read_text().strip()}"  # re-read: the kubelet rotates it


def _path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{PLURALS[kind]}"
    return f"{path}/{name}" if name else path

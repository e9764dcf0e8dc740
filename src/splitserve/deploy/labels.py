"""The labels every rendered object carries, and the selectors built from them (shared by ``render``, the
NetworkPolicies of ``netpol`` and the operator).

``app.kubernetes.io/name=splitserve``, ``instance=<endpoint>``, ``component=worker|prefill|decode|router|redis``
select one component's pods (a Deployment's selector: immutable once applied); ``managed-by=splitserve`` marks
what the renderer made, which the operator prunes.
"""

from __future__ import annotations

from splitserve.config import Role

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_ROLE = "splitserve.io/dpd-role"  # prefill | decode, whatever the resource's apiVersion
MANAGED_BY = "splitserve"
COMPONENTS = {Role.COLOCATED: "worker", Role.PREFILL: "prefill", Role.DECODE: "decode"}


def selector_labels(endpoint: str, component: str) -> dict[str, str]:
    """The labels that select one component's pods (a Deployment's selector; immutable once applied)."""
    return {LABEL_NAME: "splitserve", LABEL_INSTANCE: endpoint, LABEL_COMPONENT: component}


def endpoint_labels(endpoint: str) -> dict[str, str]:
    """The labels every pod of ``endpoint`` carries, whatever its component."""
    return {LABEL_NAME: "splitserve", LABEL_INSTANCE: endpoint}


def managed_selector(endpoint: str) -> str:
    """The label selector of every object rendered for ``endpoint`` (the operator prunes with it)."""
    return f"{LABEL_INSTANCE}={endpoint},{LABEL_MANAGED_BY}={MANAGED_BY}"

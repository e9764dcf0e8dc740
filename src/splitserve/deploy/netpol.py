"""The NetworkPolicies of an endpoint: who may open a connection to whom. Pure: plain manifests from a
:class:`Network`.

- ``<endpoint>-default-deny`` selects every pod of the endpoint and allows nothing, in or out; the policies
  below each open one path (policies add up).
- the router (``<endpoint>-router``): anyone may reach its HTTP port (the clients, and the workers' KV
  events); it reaches the workers' HTTP port (and vLLM workers' KV event ports), the API server (its discovery
  sidecar lists pods: TCP 443 and 6443 to any address, since a NetworkPolicy cannot name the API server) and DNS.
- workers (``<endpoint>-worker``, or ``-prefill`` and ``-decode``): only the router reaches their HTTP port
  (and a vLLM worker's ZMQ KV event and replay ports, which anyone reaching them could read);
  only prefill pods reach a decode pod's KV port. Prefill pods reach decode KV ports; every worker reaches the
  router (KV events, when the router takes them), Redis (the in-cluster one by its labels, a Redis the resource
  names by its port) and DNS.
- with ``spec.metrics.tracesExporterEndpoint``, the router and the workers reach its port (any address: their
  collectors send spans there).
- Redis (``<endpoint>-redis``): only the workers reach it; it reaches nothing.

DNS is UDP and TCP 53 to any address (kube-dns or a node-local cache alike). Kubelet probes are not subject to
NetworkPolicies. A Prometheus scraping the workers needs a policy of its own (docs/security.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from splitserve.deploy.labels import LABEL_COMPONENT, endpoint_labels, selector_labels
from splitserve.kube import Manifest

DNS_PORT = 53
API_SERVER_PORTS = (443, 6443)  # the kubernetes Service, and the API server behind it (after DNAT)
API_VERSION = "networking.k8s.io/v1"


@dataclass(frozen=True, slots=True)
class Network:
    """Who talks to whom in one endpoint: what its NetworkPolicies need to know."""

    namespace: str
    endpoint: str
    labels: dict[str, str]  # every policy's own labels (the resource's and the managed-by ones)
    worker_components: tuple[str, ...]  # ("worker",) or ("prefill", "decode")
    worker_port: int  # every worker's HTTP port
    worker_event_ports: tuple[int, ...]  # vLLM workers' KV event publisher and replay ports; () without
    kv_port: int | None  # decode workers' KV receiver; None when colocated
    router_port: int
    router_takes_events: bool  # workers send KV events to the router
    redis_port: int | None  # the endpoint's own Redis; None without one
    external_redis_port: int | None  # a Redis the resource names (l2CacheLocalUrl), reached by its port
    traces_exporter_port: int | None = None  # where the pods' collectors send spans (metrics.tracesExporterEndpoint)


def network_policies(net: Network) -> list[Manifest]:
    """The default deny, then one policy per component: router, each worker component, Redis (if any)."""
    policies = [_policy(net, f"{net.endpoint}-default-deny", "default-deny", endpoint_labels(net.endpoint), [], [])]
    policies.append(_policy(net, f"{net.endpoint}-router", "router", _pods(net, "router"), *_router_rules(net)))
    for component in net.worker_components:
        ingress, egress = _worker_rules(net, component)
        policies.append(_policy(net, f"{net.endpoint}-{component}", component, _pods(net, component), ingress, egress))
    if net.redis_port is not None:
        ingress = [_rule("from", _workers(net), [net.redis_port])]
        policies.append(_policy(net, f"{net.endpoint}-redis", "redis", _pods(net, "redis"), ingress, []))
    return policies


def _router_rules(net: Network) -> tuple[list[Manifest], list[Manifest]]:
    ingress = [_rule("from", None, [net.router_port])]  # clients, wherever they are
    worker_ports = [net.worker_port, *net.worker_event_ports]
    egress = [_rule("to", _workers(net), worker_ports), _rule("to", None, API_SERVER_PORTS), _dns()]
    if net.traces_exporter_port is not None:
        egress.append(_rule("to", None, [net.traces_exporter_port]))
    return ingress, egress


def _worker_rules(net: Network, component: str) -> tuple[list[Manifest], list[Manifest]]:
    from_router = [{"podSelector": {"matchLabels": _pods(net, "router")}}]
    ingress = [_rule("from", from_router, [net.worker_port, *net.worker_event_ports])]
    egress = [_dns()]
    if component == "decode" and net.kv_port is not None:
        ingress.append(_rule("from", [{"podSelector": {"matchLabels": _pods(net, "prefill")}}], [net.kv_port]))
    if component == "prefill" and net.kv_port is not None:
        egress.append(_rule("to", [{"podSelector": {"matchLabels": _pods(net, "decode")}}], [net.kv_port]))
    if net.router_takes_events:
        egress.append(_rule("to", [{"podSelector": {"matchLabels": _pods(net, "router")}}], [net.router_port]))
    if net.redis_port is not None:
        egress.append(_rule("to", [{"podSelector": {"matchLabels": _pods(net, "redis")}}], [net.redis_port]))
    if net.external_redis_port is not None:
        egress.append(_rule("to", None, [net.external_redis_port]))
    if net.traces_exporter_port is not None:
        egress.append(_rule("to", None, [net.traces_exporter_port]))
    return ingress, egress


def _policy(
    net: Network, name: str, component: str, pods: dict[str, str], ingress: list[Manifest], egress: list[Manifest]
) -> Manifest:
    """A policy for the pods labelled ``pods``, governing both directions (no rule in one: nothing allowed)."""
    spec: Manifest = {"podSelector": {"matchLabels": pods}, "policyTypes": ["Ingress", "Egress"]}
    spec |= {key: rules for key, rules in (("ingress", ingress), ("egress", egress)) if rules}
    labels = {**net.labels, LABEL_COMPONENT: component}
    metadata = {"name": name, "namespace": net.namespace, "labels": labels}
    return {"apiVersion": API_VERSION, "kind": "NetworkPolicy", "metadata": metadata, "spec": spec}


def _rule(direction: str, peers: list[Manifest] | None, ports: Sequence[int]) -> Manifest:
    """``ports`` (TCP) from or to ``peers``; None: any address."""
    rule: Manifest = {"ports": [{"protocol": "TCP", "port": port} for port in ports]}
    if peers is not None:
        rule[direction] = peers
    return rule


def _dns() -> Manifest:
    return {"ports": [{"protocol": protocol, "port": DNS_PORT} for protocol in ("UDP", "TCP")]}


def _pods(net: Network, component: str) -> dict[str, str]:
    return selector_labels(net.endpoint, component)


def _workers(net: Network) -> list[Manifest]:
    """Every worker pod of the endpoint, whatever its role."""
    expression = {"key": LABEL_COMPONENT, "operator": "In", "values": list(net.worker_components)}
    selector = {"matchLabels": endpoint_labels(net.endpoint), "matchExpressions": [expression]}
    return [{"podSelector": selector}]

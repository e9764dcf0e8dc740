"""The OpenTelemetry collector beside each pod on Kubernetes, with ``spec.metrics.enabled``: the reference system's
observability path, which runs a collector container in every model pod and in the router pod.

The render (``deploy/render.py``) then adds to each splitserve worker pod and to the router pod a ``otel-collector``
container (``COLLECTOR_IMAGE``, the collector's core distribution) that receives OTLP/HTTP on the pod's loopback
(``TRACES_ENDPOINT``), and starts ``splitserve worker`` and ``splitserve router`` with ``--otlp-traces-endpoint``
pointing at it: every hop of a request (router, prefill, the KV push, decode, a migration) is a span of one trace
(``splitserve.tracing``). Each collector reads the endpoint's ConfigMap ``<name>-otel-collector``
(:func:`config_map`): spans are batched and written to the container's log (``kubectl logs -c otel-collector``) by
the ``debug`` exporter. The resource has no field for another exporter yet, and the operator re-applies the
ConfigMap and the NetworkPolicies as rendered: to send spans to a tracing backend (Tempo, Jaeger, an OTLP
gateway), render with ``splitserve render``, add its exporter to the ConfigMap's ``exporters`` and
``service.pipelines.traces`` and the collector's egress to the NetworkPolicies, and apply that (a collector reads
its configuration when it starts). The image must have ``splitserve[tracing]`` (this repository's has). vLLM
workers get neither: ``vllm serve`` traces only where its image has OpenTelemetry installed, and a flag it
cannot honour stops it.
"""

from __future__ import annotations

from typing import Any

import yaml

from splitserve.kube import Manifest

COLLECTOR_IMAGE = "otel/opentelemetry-collector:0.116.0"
CONTAINER_NAME = "otel-collector"
OTLP_HTTP_PORT = 4318
TRACES_ENDPOINT = f"http://127.0.0.1:{OTLP_HTTP_PORT}/v1/traces"  # the splitserve processes' --otlp-traces-endpoint
CONFIG_KEY = "config.yaml"
CONFIG_DIR = "/etc/otelcol"
VOLUME = "otel-collector-config"
RESOURCES = {"requests": {"cpu": "20m", "memory": "64Mi"}, "limits": {"cpu": "500m", "memory": "256Mi"}}


def config_map_name(endpoint: str) -> str:
    return f"{endpoint}-otel-collector"


def collector_config() -> dict[str, Any]:
    """The collector's pipeline: OTLP/HTTP on loopback in, batched, the ``debug`` exporter out."""
    return {
        "receivers": {"otlp": {"protocols": {"http": {"endpoint": f"127.0.0.1:{OTLP_HTTP_PORT}"}}}},
        "processors": {"batch": {}},
        "exporters": {"debug": {"verbosity": "basic"}},
        "service": {
            "pipelines": {"traces": {"receivers": ["otlp"], "processors": ["batch"], "exporters": ["debug"]}},
            "telemetry": {"metrics": {"level": "none"}},
        },
    }


def config_map(endpoint: str, namespace: str, labels: dict[str, str]) -> Manifest:
    """The endpoint's collector configuration, which every collector container mounts."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": config_map_name(endpoint), "namespace": namespace, "labels": labels},
        "data": {CONFIG_KEY: yaml.safe_dump(collector_config(), sort_keys=False)},
    }


def container(security: Manifest) -> Manifest:
    """The collector container of a pod, restricted as the pod's others (``security``)."""
    return {
        "name": CONTAINER_NAME,
        "image": COLLECTOR_IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "args": [f"--config={CONFIG_DIR}/{CONFIG_KEY}"],
        "resources": RESOURCES,
        "securityContext": security,
        "volumeMounts": [{"name": VOLUME, "mountPath": CONFIG_DIR, "readOnly": True}],
    }


def volume(endpoint: str) -> Manifest:
    return {"name": VOLUME, "configMap": {"name": config_map_name(endpoint)}}

"""The OpenTelemetry collector beside each pod on Kubernetes, with ``spec.metrics.enabled``: the reference system's
observability path, which runs a collector container in every model pod and in the router pod.

The render (``deploy/render.py``) then adds to each splitserve worker pod and to the router pod a ``otel-collector``
container (``COLLECTOR_IMAGE``, the collector's core distribution) that receives OTLP/HTTP on the pod's loopback
(``TRACES_ENDPOINT``), and starts ``splitserve worker`` and ``splitserve router`` with ``--otlp-traces-endpoint``
pointing at it: every hop of a request (router, prefill, the KV push, decode, a migration) is a span of one trace
(``splitserve.tracing``). Each collector reads the endpoint's ConfigMap ``<name>-otel-collector``
(:func:`config_map`): spans are batched and written to the container's log (``kubectl logs -c otel-collector``) by
the ``debug`` exporter, and, with ``spec.metrics.tracesExporterEndpoint`` (a tracing backend or gateway that takes
OTLP/HTTP: Tempo, Jaeger, an OpenTelemetry gateway), sent there too by the ``otlphttp`` exporter; the
NetworkPolicies then let the router and worker pods reach that port (any address: a policy cannot name a host).
The image must have ``splitserve[tracing]`` (this repository's has). vLLM
workers get neither: ``vllm serve`` traces only where its image has OpenTelemetry installed, and a flag it
cannot honour stops it.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

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


def collector_config(exporter_endpoint: str | None = None) -> dict[str, Any]:
    """The collector's pipeline: OTLP/HTTP on loopback in, batched, the ``debug`` exporter out, and the
    ``otlphttp`` one to ``exporter_endpoint`` when given."""
    exporters: dict[str, Any] = {"debug": {"verbosity": "basic"}}
    if exporter_endpoint is not None:
        exporters["otlphttp"] = {"endpoint": exporter_endpoint}
    return {
        "receivers": {"otlp": {"protocols": {"http": {"endpoint": f"127.0.0.1:{OTLP_HTTP_PORT}"}}}},
        "processors": {"batch": {}},
        "exporters": exporters,
        "service": {
            "pipelines": {"traces": {"receivers": ["otlp"], "processors": ["batch"], "exporters": list(exporters)}},
            "telemetry": {"metrics": {"level": "none"}},
        },
    }


def exporter_port(exporter_endpoint: str) -> int:
    """The port the collectors send spans to: the URL's, else its scheme's."""
    url = urlsplit(exporter_endpoint)
    return url.port or (443 if url.scheme == "https" else 80)


def config_map(endpoint: str, namespace: str, labels: dict[str, str], exporter_endpoint: str | None = None) -> Manifest:
    """The endpoint's collector configuration, which every collector container mounts."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": config_map_name(endpoint), "namespace": namespace, "labels": labels},
        "data": {CONFIG_KEY: yaml.safe_dump(collector_config(exporter_endpoint), sort_keys=False)},
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

"""The ``InferenceEndpointConfig`` CustomResourceDefinition, generated from the pydantic model.

:func:`crd` turns ``InferenceEndpointConfig``'s JSON schema into a structural ``openAPIV3Schema``: references
inlined, ``Optional`` as ``nullable``, titles and defaults dropped (the API server would store defaults, and
the model tells a field written from one left out: ``spec.replicas`` with ``pdSpec`` warns only when written),
free-form maps (``status``) as ``x-kubernetes-preserve-unknown-fields``, and engine args, environment values and
resource quantities as int-or-string (YAML writes ``8000`` and ``"8000"`` alike). Unknown fields are pruned by
the API server, and ``kubectl apply`` (strict field validation) reports them. ``metadata`` and ``apiVersion``
are the API server's. ``crd.yaml`` beside this file is this output; regenerate it with
``python -m splitserve.deploy.crd > src/splitserve/deploy/crd.yaml`` (a test checks they agree).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from splitserve.endpoint import InferenceEndpointConfig

GROUP = "splitserve.io"
VERSION = "v1alpha1"
KIND = "InferenceEndpointConfig"
PLURAL = "inferenceendpointconfigs"
SINGULAR = "inferenceendpointconfig"
SHORT_NAMES = ["iec"]
CRD_PATH = Path(__file__).with_name("crd.yaml")

_DROPPED = frozenset({"title", "default", "$defs"})
# JSON-schema paths (definition, then keys) whose strings also take YAML numbers: the model converts them.
_INT_OR_STRING = {
    ("EnvVar", "properties", "value"),
    ("WorkerSpec", "properties", "args", "items"),
    ("RoleSpec", "properties", "args", "items"),
    ("ResourceRequirements", "properties", "requests", "additionalProperties"),
    ("ResourceRequirements", "properties", "limits", "additionalProperties"),
}
_PRINTER_COLUMNS = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.modelName"},
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    {"name": "Reason", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].reason'},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition (apiextensions.k8s.io/v1) of ``splitserve.io/v1alpha1`` endpoints, with a
    status subresource. Deterministic: equal calls give equal output."""
    version = {
        "name": VERSION,
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": openapi_schema()},
        "subresources": {"status": {}},
        "additionalPrinterColumns": _PRINTER_COLUMNS,
    }
    names = {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": SINGULAR, "shortNames": SHORT_NAMES}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {"group": GROUP, "names": names, "scope": "Namespaced", "versions": [version]},
    }


def openapi_schema() -> dict[str, Any]:
    """The resource's structural schema: ``spec`` (required) from the model, ``status`` free-form."""
    schema = InferenceEndpointConfig.model_json_schema(by_alias=True)
    defs = schema.get("$defs", {})
    spec = _structural(schema["properties"]["spec"], defs, ())
    status = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    description = "A whole inference endpoint: model, workers (colocated, or prefill and decode), KV cache, router."
    return {
        "type": "object",
        "description": description,
        "required": ["spec"],
        "properties": {"spec": spec, "status": status},
    }


def crd_yaml() -> str:
    return yaml.safe_dump(crd(), sort_keys=False, width=120)


def _structural(node: dict[str, Any], defs: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    """One JSON-schema node as a structural OpenAPI v3 node; ``path`` is (definition, keys...) for _INT_OR_STRING."""
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        extra = {k: v for k, v in node.items() if k not in ("$ref", *_DROPPED)}
        return {**_structural(defs[name], defs, (name,)), **extra}
    options = node.get("anyOf")
    if options is not None:
        return _any_of(node, options, defs, path)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED or (key == "additionalProperties" and isinstance(value, bool)):
            continue
        if key == "properties":
            out[key] = {name: _structural(sub, defs, (*path, key, name)) for name, sub in value.items()}
        elif key in ("items", "additionalProperties"):
            out[key] = _structural(value, defs, (*path, key))
        elif key == "const":
            out["enum"] = [value]
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            # JSON Schema's bound with its value; OpenAPI v3's is a flag beside minimum / maximum
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        else:
            out[key] = value
    if path in _INT_OR_STRING:
        return _int_or_string(out)
    if (out.get("type") == "object" and node.get("additionalProperties") is True) or "type" not in out:
        return {**out, "type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return out


def _any_of(node: dict[str, Any], options: list[Any], defs: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    """``X | None`` -> X with ``nullable``; any other union is kept free-form (none in the model today)."""
    kept = [option for option in options if option.get("type") != "null"]
    extra = {k: v for k, v in node.items() if k not in ("anyOf", *_DROPPED)}
    if len(kept) != 1:
        return {**extra, "x-kubernetes-preserve-unknown-fields": True}
    inner = _structural(kept[0], defs, path)
    return {**inner, **extra, "nullable": True} if len(kept) < len(options) else {**inner, **extra}


def _int_or_string(node: dict[str, Any]) -> dict[str, Any]:
    rest = {k: v for k, v in node.items() if k != "type"}
    return {**rest, "anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}


if __name__ == "__main__":
    print(crd_yaml(), end="")

"""The ``InferenceEndpointConfig`` resource: its model, validation, loading, and the merging rules of its args.

One resource file describes a whole endpoint (the README's "One resource file" section; ``examples/`` holds one of
each kind). This module reads it into a frozen
pydantic model, checks every rule across fields, and reports each problem as an :class:`EndpointError` line that
names the field path. It also holds the spec's rules for ``args`` lists (:func:`parse_args`,
:func:`merge_flags`: per-role args over ``worker.args``), which validation and planning share. What to run for
a resource (worker and router flags, resources, the model) is ``splitserve.deploy.plan``, which builds on this
module; nothing here imports ``splitserve.deploy``, starts a process, opens a socket or reads a file other than
the one ``load_endpoint`` is given. It imports pydantic and yaml only, never torch.

Where the reference system's documents are silent, the choices are made here and documented at the code that
makes them: colocated replicas come from ``spec.replicas`` (the reference's own field);
``spec.kvCacheSpec.l2CacheSpec`` gains ``l2CachePath`` (the tieredstorage directory; unset: :func:`local_l2_path`
for a local run, KUBERNETES_L2_PATH in a pod); a Redis L2 without a URL is valid (a local run starts its own
redis-server); ``environmentVariables`` take Kubernetes' ``valueFrom.secretKeyRef`` (and nothing else as a source), and
secrets (SECRET_ENV_NAMES: client keys, Redis' password) only from there: a literal in the resource is readable
by whoever reads the resource. The cluster secret is splitserve's to set (envs.CLUSTER_SECRET), never the resource's.
``spec.worker.engine`` (splitserve's own field, default ``splitserve``) says what the workers run: ``vllm`` makes
them vLLM's OpenAI server, which takes ``pdSpec`` and the L1/L2 tiers through splitserve's KV connector for vLLM.
"""

from __future__ import annotations

import difflib
import math
import re
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from splitserve import envs
from splitserve.config import L2Backend, RoutingStrategy
from splitserve.errors import SplitserveError

API_VERSION = "splitserve.io/v1alpha1"
REFERENCE_API_VERSION = "inference.sagemaker.aws.amazon.com/v1"  # the reference system's manifests load unchanged
KIND = "InferenceEndpointConfig"
KUBERNETES_L2_PATH = "/var/lib/splitserve/l2"  # tieredstorage in a pod without l2CachePath: the pod's own volume
# The environment variables of auth.py (not imported: this module imports pydantic and yaml only).
# Secrets a resource may hand the processes: from a secretKeyRef, never a literal (client keys, Redis' password).
SECRET_ENV_NAMES = (envs.API_KEY.name, envs.VLLM_API_KEY.name, envs.REDIS_PASSWORD.name)
INVOCATION_PATHS = ("/v1/chat/completions", "/v1/completions")


class EndpointError(SplitserveError, ValueError):
    """A resource that cannot be loaded, validated or planned.

    ``errors``: one line per problem, each starting with the field path (``spec.pdSpec.routingThreshold: ...``).
    ``source``: the file or other origin, or None. ``str(error)`` shows the source and every line.
    """

    def __init__(self, errors: str | Sequence[str], source: str | None = None) -> None:
        self.errors: tuple[str, ...] = (errors,) if isinstance(errors, str) else tuple(errors)
        self.source = source
        prefix = f"{source}: " if source else ""
        if len(self.errors) == 1:
            super().__init__(prefix + self.errors[0])
        else:
            super().__init__(f"{prefix}{len(self.errors)} errors:\n" + "\n".join(f"  {e}" for e in self.errors))


class WorkerEngine(StrEnum):
    """What the workers run (``spec.worker.engine``)."""

    SPLITSERVE = "splitserve"  # `splitserve worker`: every feature of the resource
    VLLM = "vllm"  # vLLM's OpenAI server (`vllm serve`); PD and the tiers through splitserve's KV connector


class ModelSourceType(StrEnum):
    S3 = "s3"  # the reference's
    FSX = "fsx"  # the reference's
    HUGGINGFACE = "huggingface"  # a Hub repository id in modelLocation (Kubernetes only)
    LOCAL = "local"  # splitserve's: a built-in model name or a path in modelLocation; runs anywhere


# ---------------------------------------------------------------------------------------------- quantities

_QUANTITY = re.compile(r"([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+|[KMGTPE]i|[numkMGTPE])?")
_SUFFIXES = {"": 1.0, "n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_SUFFIXES |= {"E": 1e18} | {f"{p}i": float(1 << (10 * (i + 1))) for i, p in enumerate("KMGTPE")}


def parse_quantity(value: str | int | float) -> float:
    """A Kubernetes quantity (``"2"``, ``"500m"``, ``"4Gi"``, ``"1e3"``, ``8``) -> its value.

    Raises ValueError naming the text for anything else, negative numbers included.
    """
    m = None if isinstance(value, bool) else _QUANTITY.fullmatch(str(value).strip())
    if m is None:
        raise ValueError(f"{value!r} is not a Kubernetes quantity (examples: 2, 500m, 1.5, 4Gi, 512M)")
    number, suffix = float(m.group(1)), m.group(2) or ""
    if suffix[:1] in ("e", "E") and len(suffix) > 1:
        return number * 10.0 ** int(suffix[1:])
    return number * _SUFFIXES[suffix]


def parse_memory_bytes(value: str | int | float) -> int:
    """A memory quantity -> bytes, rounded up (``"4Gi"`` -> 4294967296, ``"512M"`` -> 512000000)."""
    return math.ceil(parse_quantity(value))


# ---------------------------------------------------------------------------------------------- engine args


@dataclass(frozen=True, slots=True)
class Flag:
    """One entry of an ``args`` list: ``--name value``, ``--name=value`` or a bare ``--name``."""

    name: str  # without the dashes, ``_`` written as ``-``: "max-num-seqs", "no-enable-prefix-caching"
    value: str | None  # None for a bare (boolean) flag
    path: str  # where it was written, for errors: "spec.worker.args[3]"

    @property
    def key(self) -> str:
        """What merging compares: a bare ``--no-x`` and ``--x`` are the same flag."""
        return self.name[3:] if self.value is None and self.name.startswith("no-") else self.name

    def tokens(self) -> list[str]:
        return [f"--{self.name}"] if self.value is None else [f"--{self.name}", self.value]


def _is_value(token: str) -> bool:
    return not token.startswith("-") or re.match(r"-\.?[0-9]", token) is not None


def parse_args(args: Sequence[str], path: str = "args") -> list[Flag]:
    """Split an ``args`` list into flags. A token after a flag is its value unless it is a flag itself.

    Raises EndpointError (path ``{path}[i]``) for a stray value or a single-dash flag.
    """
    flags: list[Flag] = []
    i = 0
    while i < len(args):
        token, where = str(args[i]), f"{path}[{i}]"
        if not token.startswith("--") or token == "--":
            short = token.startswith("-") and token != "--" and not _is_value(token)
            why = "single-dash flags are not supported, use the long form" if short else "is not a flag"
            raise EndpointError(
                f"{where}: {token!r}: {why} (entries are --flag, --flag=value, or --flag then its value)"
            )
        name, eq, value = token[2:].partition("=")
        if not eq:
            has_value = i + 1 < len(args) and _is_value(str(args[i + 1]))
            value, i = (str(args[i + 1]), i + 1) if has_value else ("", i)
        flags.append(Flag(name.replace("_", "-"), value if eq or value else None, where))
        i += 1
    return flags


def merge_flags(base: Sequence[Flag], override: Sequence[Flag]) -> list[Flag]:
    """``override`` merged over ``base`` (per-role args over ``worker.args``, the reference system's rule).

    A flag in both takes ``override``'s occurrences at ``base``'s position; a flag only in ``override`` is
    appended in its order. A flag repeated in one list is kept as a group.
    """
    over = _group(override)
    merged: list[Flag] = []
    for key, group in _group(base).items():
        merged += over.pop(key, group)
    for group in over.values():
        merged += group
    return merged


def merge_args(base: Sequence[str], override: Sequence[str]) -> list[str]:
    """:func:`merge_flags` on raw ``args`` lists; ``--flag=value`` comes out as ``--flag value``."""
    merged = merge_flags(parse_args(base, "base"), parse_args(override, "override"))
    return [token for flag in merged for token in flag.tokens()]


def _group(flags: Sequence[Flag]) -> dict[str, list[Flag]]:
    groups: dict[str, list[Flag]] = {}
    for flag in flags:
        groups.setdefault(flag.key, []).append(flag)
    return groups


def last_flag(flags: Sequence[Flag], key: str) -> Flag | None:
    """The last flag of ``flags`` that merging calls ``key`` (the one that takes effect), or None."""
    return next((f for f in reversed(flags) if f.key == key), None)


# ---------------------------------------------------------------------------------------------- the resource


def _scalar_text(value: Any) -> Any:
    """YAML scalars as the strings Kubernetes wants: ``8000`` -> "8000", ``False`` -> "False" (as quoted)."""
    return str(value) if isinstance(value, int | float) else value


def _quantity_text(value: Any) -> Any:
    if not isinstance(value, str | int | float):
        return value  # pydantic reports the type
    parse_quantity(value)
    return str(value).strip()


_Text = Annotated[str, BeforeValidator(_scalar_text)]
Quantity = Annotated[str, BeforeValidator(_quantity_text)]


class _Spec(BaseModel):
    """camelCase in YAML, snake_case in Python; unknown fields are errors (they are typos)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class ResourceRequirements(_Spec):
    requests: dict[str, Quantity] = Field(default_factory=dict)  # "cpu", "memory", "nvidia.com/gpu", ...
    limits: dict[str, Quantity] = Field(default_factory=dict)


class SecretKeySelector(_Spec):
    """One key of a Secret in the endpoint's namespace (Kubernetes' ``secretKeyRef``)."""

    name: str  # the Secret
    key: str  # the key in its data
    optional: bool = False  # true: the variable is left unset when the Secret or key is missing


class EnvVarSource(_Spec):
    """``valueFrom``: only ``secretKeyRef`` (Kubernetes only; a local run cannot read a Secret)."""

    secret_key_ref: SecretKeySelector


class EnvVar(_Spec):
    name: str
    value: _Text | None = None  # unset (and no valueFrom): the empty string
    value_from: EnvVarSource | None = None  # instead of value

    def manifest(self) -> dict[str, Any]:
        """The container ``env`` entry: ``name`` and ``value``, or ``name`` and ``valueFrom.secretKeyRef``."""
        if self.value_from is None:
            return {"name": self.name, "value": self.value or ""}
        ref = self.value_from.secret_key_ref
        selector: dict[str, Any] = {"name": ref.name, "key": ref.key}
        if ref.optional:
            selector["optional"] = True
        return {"name": self.name, "valueFrom": {"secretKeyRef": selector}}


class ModelInvocationPort(_Spec):
    name: str = "http"
    container_port: int = Field(default=8000, ge=1, le=65535)  # the worker's HTTP port in its container


class ModelVolumeMount(_Spec):
    name: str = "model-weights"
    mount_path: str  # where the weights appear in the container (Kubernetes)


class WorkerSpec(_Spec):
    # splitserve (default) or vllm: vLLM's OpenAI server, whose flags spec.worker.args then are (deploy/vllm.py)
    engine: WorkerEngine = WorkerEngine.SPLITSERVE
    image: str | None = None  # container image (Kubernetes); unused locally; required with engine vllm
    args: list[_Text] = Field(default_factory=list)  # engine flags for every role
    model_invocation_port: ModelInvocationPort = Field(default_factory=ModelInvocationPort)
    model_volume_mount: ModelVolumeMount | None = None
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)  # colocated workers only
    environment_variables: list[EnvVar] = Field(default_factory=list)  # every worker, every role


class RoleSpec(_Spec):
    """``pdSpec.prefillSpec`` or ``pdSpec.decodingSpec``."""

    replicas: int = Field(default=1, ge=0)
    resources: ResourceRequirements | None = None  # replaces worker.resources for this role's pods
    args: list[_Text] = Field(default_factory=list)  # merged over worker.args


class PDSpec(_Spec):
    """Its presence makes the endpoint disaggregated. ``pdSpec: {}`` means one prefill and one decode worker."""

    prefill_spec: RoleSpec = Field(default_factory=RoleSpec)
    decoding_spec: RoleSpec = Field(default_factory=RoleSpec)
    routing_threshold: int = Field(default=4096, ge=1)  # prompt tokens from which a request is disaggregated


class L2CacheSpec(_Spec):
    l2_cache_backend: Literal["redis", "tieredstorage"]
    l2_cache_local_url: str | None = None  # redis only; unset: a local run starts its own redis-server
    l2_cache_path: str | None = None  # splitserve extension, tieredstorage only; unset: see local_l2_path


class KVCacheSpec(_Spec):
    enable_l1_cache: bool = False  # KV chunks in each worker's memory
    enable_l2_cache: bool = False  # KV chunks shared by every worker (needs l2CacheSpec)
    l2_cache_spec: L2CacheSpec | None = None


class IntelligentRoutingSpec(_Spec):
    enabled: bool = True  # writing the section asks for it; false: roundrobin
    routing_strategy: RoutingStrategy = RoutingStrategy.PREFIXAWARE


class RouterSpec(_Spec):
    """``spec.router`` (a splitserve extension): the router's replicas, interchangeable since each follows every
    worker's KV events and load itself (README, "One resource file")."""

    replicas: int = Field(default=1, ge=1)  # locally behind a TCP balancer; on Kubernetes behind the Service


class RoleScaling(_Spec):
    """One role's bounds and targets under ``spec.autoscaling`` (``deploy/autoscale.py``)."""

    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(ge=1)
    # requests in flight (running and waiting) per replica: Knative's concurrency target
    target_concurrency: float | None = Field(default=None, gt=0)
    # the 90th percentile of the time to first token clients see at the router; colocated and prefill only
    target_ttft_seconds: float | None = Field(default=None, gt=0)
    # prefill only, instead of targets: prefill replicas per decode replica (the P:D ratio `splitserve plan`
    # recommends), rounded up; the operator keeps it on Kubernetes
    decode_ratio: float | None = Field(default=None, gt=0)


class AutoscalingSpec(_Spec):
    """``spec.autoscaling`` (a splitserve extension): replicas that follow the load, per role, between bounds.
    Locally the supervisor scales; on Kubernetes, HorizontalPodAutoscalers do."""

    colocated: RoleScaling | None = None  # without pdSpec
    prefill: RoleScaling | None = None  # with pdSpec
    decode: RoleScaling | None = None  # with pdSpec
    interval_seconds: float = Field(default=5.0, gt=0)  # how often the load is read (locally)
    # a scale-down takes the highest recommendation of this window: no flapping (HPA's stabilization window)
    scale_down_stabilization_seconds: float = Field(default=60.0, ge=0)

    def roles(self) -> dict[str, RoleScaling]:
        """The scaled roles by name, in the order they are decided: decode before the prefill pool that may follow it
        (``decodeRatio``)."""
        scaled = {"colocated": self.colocated, "decode": self.decode, "prefill": self.prefill}
        return {role: scaling for role, scaling in scaled.items() if scaling is not None}

    @property
    def prefill_follows_decode(self) -> bool:
        """Whether the prefill pool follows the decode pool by ``decodeRatio`` (then decode's requests in flight are
        the endpoint's, those still in prefill included: ``deploy/autoscale.py``)."""
        return self.prefill is not None and self.prefill.decode_ratio is not None


class LoadBalancer(_Spec):
    health_check_path: str = "/health"


class ModelMetrics(_Spec):
    port: int | None = Field(default=None, ge=1, le=65535)  # must equal worker.modelInvocationPort.containerPort


class MetricsSpec(_Spec):
    enabled: bool = False
    model_metrics: ModelMetrics | None = None
    # splitserve extension: the OTLP/HTTP endpoint (a tracing backend or gateway, http://host:port) each pod's
    # collector also sends spans to; unset: only the collectors' logs (deploy/collector.py)
    traces_exporter_endpoint: str | None = None


class S3Storage(_Spec):
    bucket_name: str | None = None
    region: str | None = None


class FsxStorage(_Spec):
    file_system_id: str | None = None


class ModelSourceConfig(_Spec):
    model_source_type: ModelSourceType
    model_location: str | None = None  # s3 prefix, Hub id, built-in name or path; unset: spec.modelName
    s3_storage: S3Storage | None = None
    fsx_storage: FsxStorage | None = None
    prefetch_enabled: bool = False


class EndpointSpec(_Spec):
    model_name: str
    endpoint_name: str | None = None
    instance_type: str | None = None
    invocation_endpoint: str = "v1/chat/completions"  # one of INVOCATION_PATHS, leading "/" optional
    replicas: int = Field(default=1, ge=0)  # colocated workers (the reference's field); ignored with pdSpec
    model_source_config: ModelSourceConfig | None = None  # unset: modelName is a built-in name or a path
    load_balancer: LoadBalancer = Field(default_factory=LoadBalancer)
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)
    kv_cache_spec: KVCacheSpec | None = None
    intelligent_routing_spec: IntelligentRoutingSpec | None = None
    pd_spec: PDSpec | None = None
    worker: WorkerSpec = Field(default_factory=WorkerSpec)
    router: RouterSpec = Field(default_factory=RouterSpec)
    autoscaling: AutoscalingSpec | None = None


class Metadata(BaseModel):
    """The Kubernetes envelope: any other metadata (uid, resourceVersion, ...) is kept and ignored."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str
    namespace: str = "default"
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class InferenceEndpointConfig(_Spec):
    """The whole resource. Constructing one validates it (pydantic ValidationError); use parse_endpoint,
    loads_endpoint or load_endpoint to get EndpointError instead."""

    api_version: Literal["splitserve.io/v1alpha1", "inference.sagemaker.aws.amazon.com/v1"]
    kind: Literal["InferenceEndpointConfig"]
    metadata: Metadata
    spec: EndpointSpec
    status: dict[str, Any] | None = None  # written by the operator; never read here

    @model_validator(mode="after")
    def _check(self) -> InferenceEndpointConfig:
        errors = _semantic_errors(self)
        if errors:
            raise EndpointError(errors)
        return self

    @property
    def is_disaggregated(self) -> bool:
        return self.spec.pd_spec is not None

    @property
    def routing_strategy(self) -> RoutingStrategy:
        """The strategy in effect: the section's when enabled; without the section prefixaware for a
        disaggregated endpoint (the reference system's default) and roundrobin for a colocated one; roundrobin
        when disabled."""
        routing = self.spec.intelligent_routing_spec
        if routing is None:
            return RoutingStrategy.PREFIXAWARE if self.is_disaggregated else RoutingStrategy.ROUNDROBIN
        return routing.routing_strategy if routing.enabled else RoutingStrategy.ROUNDROBIN

    @property
    def l2_backend(self) -> L2Backend:
        kv = self.spec.kv_cache_spec
        if kv is None or not kv.enable_l2_cache or kv.l2_cache_spec is None:
            return L2Backend.NONE
        return L2Backend(kv.l2_cache_spec.l2_cache_backend)

    @property
    def needs_local_redis(self) -> bool:
        """L2 is Redis without a URL: a local run starts a redis-server and passes its URL to ``plan()``."""
        if self.l2_backend != L2Backend.REDIS:
            return False
        kv = self.spec.kv_cache_spec
        return kv is not None and kv.l2_cache_spec is not None and not kv.l2_cache_spec.l2_cache_local_url

    @property
    def api_group(self) -> str:
        return self.api_version.split("/", 1)[0]

    def to_manifest(self) -> dict[str, Any]:
        """The resource as YAML/JSON data (camelCase, unset optional fields left out)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


# ---------------------------------------------------------------------------------------------- validation

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
_SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]{1,253}")
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def _semantic_errors(config: InferenceEndpointConfig) -> list[str]:
    """Every rule across fields, as ``path: problem`` lines (the shapes were checked by pydantic)."""
    spec = config.spec
    errors: list[str] = []
    if not _DNS_LABEL.fullmatch(config.metadata.name):
        errors.append(
            f"metadata.name: {config.metadata.name!r} must be a DNS label: lowercase letters, digits and '-', "
            "starting and ending with a letter or digit, at most 63 characters"
        )
    errors += _port_errors(spec)
    errors += _cache_errors(spec.kv_cache_spec)
    if invocation_path(spec.invocation_endpoint) not in INVOCATION_PATHS:
        allowed = ", ".join(p.lstrip("/") for p in INVOCATION_PATHS)
        errors.append(f"spec.invocationEndpoint: {spec.invocation_endpoint!r} is not one of {allowed}")
    if not spec.load_balancer.health_check_path.startswith("/"):
        errors.append(f"spec.loadBalancer.healthCheckPath: {spec.load_balancer.health_check_path!r} must start with /")
    errors += _env_errors(spec.worker.environment_variables)
    errors += _autoscaling_errors(spec)
    errors += _exporter_errors(spec.metrics)
    for path, args in args_lists(spec):
        try:
            parse_args(args, path)
        except EndpointError as exc:
            errors += exc.errors
    return errors


def _exporter_errors(metrics: MetricsSpec) -> list[str]:
    endpoint = metrics.traces_exporter_endpoint
    if endpoint is None:
        return []
    where = "spec.metrics.tracesExporterEndpoint"
    bad = [f"{where}: {endpoint!r} must be an http(s)://host[:port] URL (an OTLP/HTTP receiver)"]
    url = urlsplit(endpoint)
    try:
        url.port  # noqa: B018 -- raises ValueError for a port out of range or not a number
    except ValueError:
        return bad
    if url.scheme not in ("http", "https") or not url.hostname:
        return bad
    return [] if metrics.enabled else [f"{where}: set metrics.enabled too: the collectors run only with it"]


def _autoscaling_errors(spec: EndpointSpec) -> list[str]:
    if spec.autoscaling is None:
        return []
    errors = []
    roles = spec.autoscaling.roles()
    allowed = ("prefill", "decode") if spec.pd_spec is not None else ("colocated",)
    for role, scaling in roles.items():
        where = f"spec.autoscaling.{role}"
        if role not in allowed:
            mode = "a disaggregated endpoint (pdSpec)" if spec.pd_spec is not None else "a colocated endpoint"
            errors.append(f"{where}: {mode} scales {' and '.join(allowed)}, not {role}")
        if scaling.min_replicas > scaling.max_replicas:
            errors.append(f"{where}: minReplicas ({scaling.min_replicas}) exceeds maxReplicas ({scaling.max_replicas})")
        targets = scaling.target_concurrency is not None or scaling.target_ttft_seconds is not None
        if scaling.decode_ratio is not None and role != "prefill":
            errors.append(f"{where}.decodeRatio: only the prefill pool follows the decode pool")
        elif scaling.decode_ratio is not None and targets:
            errors.append(f"{where}.decodeRatio: the prefill pool follows the decode pool by it; give it no "
                          "targetConcurrency or targetTtftSeconds beside it")  # fmt: skip
        elif not targets and scaling.decode_ratio is None:
            errors.append(f"{where}: needs a target: targetConcurrency, targetTtftSeconds or both"
                          + (" (or decodeRatio)" if role == "prefill" else ""))  # fmt: skip
        if role == "decode" and scaling.target_ttft_seconds is not None:
            errors.append(f"{where}.targetTtftSeconds: the time to first token is the prefill pool's; scale decode by "
                          "targetConcurrency")  # fmt: skip
    if not roles:
        errors.append(f"spec.autoscaling: names no role to scale ({' or '.join(allowed)})")
    return errors


def _port_errors(spec: EndpointSpec) -> list[str]:
    port = spec.worker.model_invocation_port.container_port
    where = "spec.worker.modelInvocationPort.containerPort"
    errors = []
    metrics = spec.metrics.model_metrics
    if metrics is not None and metrics.port is not None and metrics.port != port:
        errors.append(f"spec.metrics.modelMetrics.port ({metrics.port}) must equal {where} ({port})")
    for path, args in args_lists(spec):
        try:
            flag = last_flag(parse_args(args, path), "port")
        except EndpointError:
            continue  # reported once, by _semantic_errors
        if flag is not None and flag.value != str(port):
            errors.append(f"{flag.path}: --port {flag.value} must equal {where} ({port})")
    return errors


def _cache_errors(kv: KVCacheSpec | None) -> list[str]:
    if kv is None or kv.l2_cache_spec is None:
        if kv is not None and kv.enable_l2_cache:
            return ["spec.kvCacheSpec.l2CacheSpec is required when enableL2Cache is true (redis or tieredstorage)"]
        return []
    l2, where = kv.l2_cache_spec, "spec.kvCacheSpec.l2CacheSpec"
    errors = []
    if l2.l2_cache_local_url is not None and l2.l2_cache_backend != "redis":
        errors.append(f"{where}.l2CacheLocalUrl is only used when l2CacheBackend is redis")
    elif l2.l2_cache_local_url is not None and not l2.l2_cache_local_url.startswith(_REDIS_SCHEMES):
        schemes = ", ".join(_REDIS_SCHEMES)
        errors.append(f"{where}.l2CacheLocalUrl: {l2.l2_cache_local_url!r} must start with one of {schemes}")
    elif l2.l2_cache_local_url is not None and urlsplit(l2.l2_cache_local_url).password is not None:
        errors.append(
            f"{where}.l2CacheLocalUrl carries a password, which would sit in every worker's argv and in the "
            "resource: give it as SPLITSERVE_REDIS_PASSWORD (valueFrom.secretKeyRef) in "
            "spec.worker.environmentVariables"
        )
    if l2.l2_cache_path is not None and l2.l2_cache_backend != "tieredstorage":
        errors.append(f"{where}.l2CachePath is only used when l2CacheBackend is tieredstorage")
    return errors


def _env_errors(env: Sequence[EnvVar]) -> list[str]:
    errors, seen = [], set()
    for i, var in enumerate(env):
        where = f"spec.worker.environmentVariables[{i}]"
        if not _ENV_NAME.fullmatch(var.name):
            errors.append(f"{where}.name: {var.name!r} is not a valid environment variable name")
        elif var.name in seen:
            errors.append(f"{where}.name: {var.name!r} is set twice")
        seen.add(var.name)
        errors += _env_source_errors(var, where)
    return errors


def _env_source_errors(var: EnvVar, where: str) -> list[str]:
    """value or valueFrom (not both); a well-formed secretKeyRef; no literal secret; not the cluster secret."""
    if var.name == envs.CLUSTER_SECRET.name:
        return [
            f"{where}.name: {envs.CLUSTER_SECRET.name} is set by splitserve (the endpoint's Secret on Kubernetes, "
            "its cluster-secret file locally); remove it"
        ]
    if var.value_from is None:
        if var.name in SECRET_ENV_NAMES and var.value:
            return [
                f"{where}.value: {var.name} must not be a literal (whoever reads the resource reads it): use "
                "valueFrom.secretKeyRef on Kubernetes, or set it in the environment of splitserve up locally"
            ]
        return []
    if var.value is not None:
        return [f"{where}: set value or valueFrom, not both"]
    ref, errors = var.value_from.secret_key_ref, []
    if not _DNS_SUBDOMAIN.fullmatch(ref.name):
        errors.append(f"{where}.valueFrom.secretKeyRef.name: {ref.name!r} is not a Secret name (a DNS subdomain)")
    if not _SECRET_KEY.fullmatch(ref.key):
        errors.append(f"{where}.valueFrom.secretKeyRef.key: {ref.key!r} is not a Secret key ([-._a-zA-Z0-9]+)")
    return errors


def secret_refs(config: InferenceEndpointConfig) -> list[str]:
    """The field paths of every ``valueFrom.secretKeyRef`` in the resource (a local run cannot resolve them)."""
    env = config.spec.worker.environment_variables
    return [f"spec.worker.environmentVariables[{i}].valueFrom" for i, var in enumerate(env) if var.value_from]


def local_l2_path(namespace: str, name: str) -> str:
    """The tieredstorage directory of a local run without ``l2CachePath``:
    ``$XDG_CACHE_HOME/splitserve/l2/<namespace>/<name>`` (``~/.cache`` without XDG_CACHE_HOME).

    In the user's own cache, never under a world-writable ``/tmp`` where another user could create the path
    first or read the records. Reads the environment (its only I/O).
    """
    return str(envs.cache_home() / "splitserve" / "l2" / namespace / name)


def args_lists(spec: EndpointSpec) -> list[tuple[str, list[str]]]:
    """Every ``args`` list of the resource with its field path: ``spec.worker.args`` first, then the roles'."""
    lists = [("spec.worker.args", spec.worker.args)]
    if spec.pd_spec is not None:
        lists.append(("spec.pdSpec.prefillSpec.args", spec.pd_spec.prefill_spec.args))
        lists.append(("spec.pdSpec.decodingSpec.args", spec.pd_spec.decoding_spec.args))
    return lists


def invocation_path(endpoint: str) -> str:
    """``spec.invocationEndpoint`` as a URL path: ``"v1/completions"`` -> ``"/v1/completions"``."""
    return "/" + endpoint.strip().strip("/")


# ---------------------------------------------------------------------------------------------- loading


def parse_endpoint(data: Any, source: str | None = None) -> InferenceEndpointConfig:
    """A resource as YAML/JSON data (a mapping, e.g. the operator's body) -> the validated model.

    Raises EndpointError with one line per problem, each naming its field path and, for a closed set, the
    allowed values.
    """
    if not isinstance(data, Mapping):
        raise EndpointError(f"expected a mapping (apiVersion, kind, metadata, spec), got {type(data).__name__}", source)
    try:
        return InferenceEndpointConfig.model_validate(data)
    except ValidationError as exc:
        raise EndpointError([line for e in exc.errors() for line in _describe(e)], source) from None


def loads_endpoint(text: str, source: str = "<string>") -> InferenceEndpointConfig:
    """YAML text holding exactly one resource -> the validated model; EndpointError (with ``source``) if not."""
    try:
        documents = [d for d in yaml.load_all(text, Loader=_StrictLoader) if d is not None]
    except yaml.YAMLError as exc:
        raise EndpointError(f"not valid YAML: {_yaml_problem(exc)}", source) from None
    if len(documents) != 1:
        raise EndpointError(f"expected one YAML document, found {len(documents)}", source)
    return parse_endpoint(documents[0], source)


def load_endpoint(path: str | Path) -> InferenceEndpointConfig:
    """Read and validate a resource file; every error is an EndpointError naming the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise EndpointError(f"cannot read: {exc}", str(path)) from None
    return loads_endpoint(text, str(path))


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key written twice in one mapping (YAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        keys = [self.construct_object(key_node, deep=deep) for key_node, _ in node.value]
        for i, key in enumerate(keys):
            if key in keys[:i]:
                mark = node.value[i][0].start_mark
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is written twice", mark)
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None else problem


def _describe(error: Any) -> list[str]:
    """One pydantic error -> ``path: problem`` lines."""
    loc, kind, ctx = error["loc"], error["type"], error.get("ctx") or {}
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    shown = repr(error.get("input"))[:80]
    if kind == "value_error" and isinstance(ctx.get("error"), EndpointError):
        return list(ctx["error"].errors)
    if kind in ("enum", "literal_error"):
        allowed = ctx["expected"].replace("'", "").replace(" or ", ", ")
        return [f"{path}: {shown} is not one of {allowed}"]
    if kind == "extra_forbidden":
        return [f"{path}: unknown field{_field_hint(loc)}"]
    if kind == "missing":
        return [f"{path}: required field is missing"]
    message = error["msg"].removeprefix("Value error, ")
    return [f"{path}: {message}" if kind == "value_error" else f"{path}: {message}, got {shown}"]


def _field_hint(loc: tuple[Any, ...]) -> str:
    model = _model_at(loc[:-1])
    if model is None:
        return ""
    allowed = [f.alias or name for name, f in model.model_fields.items()]
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    guess = f" (did you mean {close[0]}?)" if close else ""
    return f"{guess}; allowed: {', '.join(allowed)}"


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class that validates the mapping at ``loc`` (walking field types from the root)."""
    current: Any = InferenceEndpointConfig
    for part in loc:
        if isinstance(part, int):
            continue  # a list item: _unwrap already stepped into the list
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        found = [f for name, f in current.model_fields.items() if part in (name, f.alias)]
        if not found:
            return None
        current = _unwrap(found[0].annotation)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _unwrap(annotation: Any) -> Any:
    while get_origin(annotation) in (list, Union, types.UnionType):
        annotation = next(a for a in get_args(annotation) if a is not type(None))
    return annotation

"""The ``InferenceEndpointConfig`` resource: its model, validation and merging rules, and the plan of what to run.

One resource file describes a whole endpoint (``spec/SPEC.md`` section 1). This module reads it and turns it
into plain data: the ``splitserve worker`` processes each role needs (flags, environment, resources) and the
``splitserve router`` in front of them. The local supervisor, ``splitserve render`` and the operator all build
on these functions; nothing here starts a process, opens a socket or reads a file other than the one
``load_endpoint`` is given. It imports pydantic and yaml only, never torch.

Where the seeds are silent, the choices are made here and documented at the code that makes them:
colocated replicas come from ``spec.replicas`` (the reference's own field); ``spec.kvCacheSpec.l2CacheSpec``
gains ``l2CachePath`` (the tieredstorage directory); a Redis L2 without a URL is valid and planned against the
Redis the caller starts; engine flags that splitserve does not know are errors, except a short list of vLLM
flags that mean nothing here, which are dropped with a warning.
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
from typing import Annotated, Any, Literal, NamedTuple, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from splitserve.config import L2Backend, Role, RoutingStrategy

API_VERSION = "splitserve.io/v1alpha1"
REFERENCE_API_VERSION = "inference.sagemaker.aws.amazon.com/v1"  # the seeds' manifests load unchanged
KIND = "InferenceEndpointConfig"
DEFAULT_L2_PATH = "/tmp/splitserve/{namespace}/{name}/l2"  # tieredstorage without spec...l2CachePath
INVOCATION_PATHS = ("/v1/chat/completions", "/v1/completions")
ROLE_URL_FLAG = {Role.COLOCATED: "--backend", Role.PREFILL: "--prefill", Role.DECODE: "--decode"}  # router flags


class EndpointError(ValueError):
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


class ModelSourceType(StrEnum):
    S3 = "s3"  # the reference's
    FSX = "fsx"  # the reference's
    HUGGINGFACE = "huggingface"  # a Hub repository id in modelLocation (Kubernetes only)
    LOCAL = "local"  # splitserve's: a built-in model name or a path in modelLocation; runs anywhere


class Target(StrEnum):
    LOCAL = "local"  # processes on this machine (splitserve up)
    KUBERNETES = "kubernetes"  # pods (splitserve render, the operator)


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


def cpu_threads(cpu: str | int | float) -> int:
    """Engine threads for a CPU share: its whole cores, at least 1 (``"2"`` -> 2, ``"1500m"`` -> 1, ``"500m"`` -> 1).

    Rounding down keeps a worker inside its quota (a thread more than the quota is throttled, not faster).
    """
    return max(1, math.floor(parse_quantity(cpu) + 1e-9))


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
    """``override`` merged over ``base`` (per-role args over ``worker.args``, the seeds' rule).

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


def _last(flags: Sequence[Flag], key: str) -> Flag | None:
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


class EnvVar(_Spec):
    name: str
    value: _Text = ""


class ModelInvocationPort(_Spec):
    name: str = "http"
    container_port: int = Field(default=8000, ge=1, le=65535)  # the worker's HTTP port in its container


class ModelVolumeMount(_Spec):
    name: str = "model-weights"
    mount_path: str  # where the weights appear in the container (Kubernetes)


class WorkerSpec(_Spec):
    image: str | None = None  # container image (Kubernetes); unused locally
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
    l2_cache_path: str | None = None  # splitserve extension, tieredstorage only; unset: DEFAULT_L2_PATH


class KVCacheSpec(_Spec):
    enable_l1_cache: bool = False  # KV chunks in each worker's memory
    enable_l2_cache: bool = False  # KV chunks shared by every worker (needs l2CacheSpec)
    l2_cache_spec: L2CacheSpec | None = None


class IntelligentRoutingSpec(_Spec):
    enabled: bool = True  # writing the section asks for it; false: roundrobin
    routing_strategy: RoutingStrategy = RoutingStrategy.PREFIXAWARE


class LoadBalancer(_Spec):
    health_check_path: str = "/health"


class ModelMetrics(_Spec):
    port: int | None = Field(default=None, ge=1, le=65535)  # must equal worker.modelInvocationPort.containerPort


class MetricsSpec(_Spec):
    enabled: bool = False
    model_metrics: ModelMetrics | None = None


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
        disaggregated endpoint (the seeds) and roundrobin for a colocated one; roundrobin when disabled."""
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
        """L2 is Redis and no URL is given: a local run starts a redis-server and passes plan() its URL."""
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
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
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
    for path, args in _args_lists(spec):
        try:
            parse_args(args, path)
        except EndpointError as exc:
            errors += exc.errors
    return errors


def _port_errors(spec: EndpointSpec) -> list[str]:
    port = spec.worker.model_invocation_port.container_port
    where = "spec.worker.modelInvocationPort.containerPort"
    errors = []
    metrics = spec.metrics.model_metrics
    if metrics is not None and metrics.port is not None and metrics.port != port:
        errors.append(f"spec.metrics.modelMetrics.port ({metrics.port}) must equal {where} ({port})")
    for path, args in _args_lists(spec):
        try:
            flag = _last(parse_args(args, path), "port")
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
    if l2.l2_cache_path is not None and l2.l2_cache_backend != "tieredstorage":
        errors.append(f"{where}.l2CachePath is only used when l2CacheBackend is tieredstorage")
    return errors


def _env_errors(env: Sequence[EnvVar]) -> list[str]:
    errors, seen = [], set()
    for i, var in enumerate(env):
        where = f"spec.worker.environmentVariables[{i}].name"
        if not _ENV_NAME.fullmatch(var.name):
            errors.append(f"{where}: {var.name!r} is not a valid environment variable name")
        elif var.name in seen:
            errors.append(f"{where}: {var.name!r} is set twice")
        seen.add(var.name)
    return errors


def _args_lists(spec: EndpointSpec) -> list[tuple[str, list[str]]]:
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


# ---------------------------------------------------------------------------------------------- the model to run


def local_model(config: InferenceEndpointConfig) -> str:
    """The ``--model`` value for a local run: a built-in model name (``smollm2``) or a path.

    Taken from ``modelSourceConfig.modelLocation`` (``modelSourceType: local``; ``modelName`` when it has no
    location), or from ``spec.modelName`` when there is no ``modelSourceConfig``. Raises EndpointError for
    s3, fsx and huggingface sources (Kubernetes only) and for a name that is neither built in nor a path.
    Reads no file: a missing path is the worker's error.
    """
    source = config.spec.model_source_config
    if source is not None and source.model_source_type != ModelSourceType.LOCAL:
        raise EndpointError(
            f"spec.modelSourceConfig.modelSourceType: {source.model_source_type.value} models cannot run locally; "
            f"use modelSourceType local with modelLocation set to a built-in model ({', '.join(_builtin_names())}) "
            "or a path to a GGUF file or Hugging Face folder"
        )
    if source is not None and source.model_location:
        location, where = source.model_location, "spec.modelSourceConfig.modelLocation"
    else:
        location, where = config.spec.model_name, "spec.modelName"
    text = location.strip()
    if text.lower() in (n.lower() for n in _builtin_names()) or _looks_like_path(text):
        return text
    raise EndpointError(
        f"{where}: {location!r} is neither a built-in model ({', '.join(_builtin_names())}) nor a path "
        "(write ./NAME for a folder here)"
    )


def _builtin_names() -> list[str]:
    from splitserve.model.registry import known_names  # torch-free, but only needed here

    return known_names()


def _looks_like_path(text: str) -> bool:
    return "/" in text or "\\" in text or text.startswith(("~", ".")) or text.lower().endswith(".gguf")


def _plan_model(config: InferenceEndpointConfig, target: Target, warnings: list[str]) -> str:
    """The one model of every worker and of the router's tokenizer (KV keys name it: never per role)."""
    for path, args in _args_lists(config.spec)[1:]:
        if (flag := _last(parse_args(args, path), "model")) is not None:
            raise EndpointError(f"{flag.path}: --model cannot differ per role; set spec.modelSourceConfig")
    written = _last(parse_args(config.spec.worker.args, "spec.worker.args"), "model")
    if target == Target.KUBERNETES:
        return _kubernetes_model(config) if written is None else written.value or ""
    model = local_model(config)
    if written is not None and written.value != model:
        warnings.append(f"{written.path}: --model {written.value} is replaced by {model} for a local run")
    return model


def _kubernetes_model(config: InferenceEndpointConfig) -> str:
    source = config.spec.model_source_config
    if source is None or source.model_source_type == ModelSourceType.LOCAL:
        return local_model(config)
    mount = config.spec.worker.model_volume_mount
    if mount is None:
        raise EndpointError(
            f"spec.worker.modelVolumeMount is required for modelSourceType {source.model_source_type.value} "
            "(the weights are mounted there), or give --model in spec.worker.args"
        )
    return mount.mount_path


# ---------------------------------------------------------------------------------------------- worker flags

# `splitserve worker` flags an args list may set, with the kind of value each takes ("one": only 1 works).
WORKER_FLAGS: dict[str, str] = {
    "served-model-name": "str", "dtype": "str", "device": "str", "max-model-len": "int", "max-num-seqs": "int",
    "max-num-batched-tokens": "int", "enable-chunked-prefill": "bool", "seed": "int", "quantization": "str",
    "num-threads": "int", "tensor-parallel-size": "one", "pipeline-parallel-size": "one", "block-size": "int",
    "kv-cache-memory": "str", "gpu-memory-utilization": "float", "enable-prefix-caching": "bool",
    "l1-cache-bytes": "str", "l2-max-bytes": "str", "kv-chunk-size": "int", "save-decode-cache": "bool",
    "pd-buffer-size": "str", "kv-transfer-timeout": "float", "uvicorn-log-level": "str",
}  # fmt: skip
# Flags the resource itself sets: writing them in args is an error that points at the field.
SET_BY_RESOURCE: dict[str, str] = {
    "role": "spec.pdSpec (its presence and the role)",
    "l1-cache": "spec.kvCacheSpec.enableL1Cache",
    "l2-backend": "spec.kvCacheSpec.l2CacheSpec.l2CacheBackend",
    "l2-url": "spec.kvCacheSpec.l2CacheSpec.l2CacheLocalUrl",
    "l2-path": "spec.kvCacheSpec.l2CacheSpec.l2CachePath",
}
# Flags the supervisor or operator sets per instance: errors in args (host and port are dropped instead).
PER_INSTANCE_FLAGS = ("host", "port", "kv-events-url", "worker-id", "advertise-url", "kv-transfer-port")
# vLLM flags that mean nothing to splitserve's engine: dropped with a warning, so vLLM manifests still load.
IGNORED_VLLM_FLAGS = frozenset({
    "trust-remote-code", "enforce-eager", "disable-log-requests", "disable-log-stats", "enable-log-requests",
    "swap-space", "load-format", "download-dir", "disable-custom-all-reduce", "distributed-executor-backend",
    "max-log-len", "kv-transfer-config", "tokenizer-mode", "disable-frontend-multiprocessing",
})  # fmt: skip


def _worker_flags(flags: Sequence[Flag], warnings: list[str]) -> list[Flag]:
    """The merged args as ``splitserve worker`` flags; EndpointError listing every flag it cannot take."""
    passed: list[Flag] = []
    errors: list[str] = []
    for flag in flags:
        try:
            checked = _worker_flag(flag, warnings)
        except EndpointError as exc:
            errors += exc.errors
            continue
        if checked is not None:
            passed.append(checked)
    if errors:
        raise EndpointError(errors)
    return passed


def _worker_flag(flag: Flag, warnings: list[str]) -> Flag | None:
    key, shown = flag.key, f"--{flag.name}"
    if key in ("model", "host", "port"):
        return None  # the model is planned once; the runner binds each instance (port checked at load)
    if key in SET_BY_RESOURCE:
        raise EndpointError(f"{flag.path}: {shown} is set by {SET_BY_RESOURCE[key]}; remove it from args")
    if key in PER_INSTANCE_FLAGS:
        raise EndpointError(f"{flag.path}: {shown} is set per instance by the supervisor or operator")
    if key in IGNORED_VLLM_FLAGS:
        warnings.append(f"{flag.path}: {shown} has no effect in splitserve and is dropped")
        return None
    kind = WORKER_FLAGS.get(key)
    if kind is None:
        close = difflib.get_close_matches(key, [*WORKER_FLAGS, *IGNORED_VLLM_FLAGS], n=1)
        guess = f" (did you mean --{close[0]}?)" if close else ""
        raise EndpointError(
            f"{flag.path}: {shown} is not a splitserve worker flag{guess}; see splitserve worker --help"
        )
    return _typed(flag, kind)


def _typed(flag: Flag, kind: str) -> Flag:
    value, shown = flag.value, f"{flag.path}: --{flag.name}"
    if kind == "bool":
        if value is None or value.lower() in ("true", "false"):
            negate = value is not None and value.lower() == "false"
            return Flag(f"no-{flag.key}" if negate else flag.name, None, flag.path)
        raise EndpointError(f"{shown} takes no value (or true/false), got {value!r}")
    if value is None:
        raise EndpointError(f"{shown} needs a value")
    number: Any = {"int": int, "one": int, "float": float}.get(kind, str)
    try:
        parsed = number(value)
    except ValueError:
        raise EndpointError(f"{shown} needs {'a number' if kind == 'float' else 'an integer'}, got {value!r}") from None
    if kind == "one" and parsed != 1:
        raise EndpointError(f"{shown} {value} is not supported: splitserve runs one engine per worker (use 1)")
    return flag


# ---------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True, slots=True)
class ResourcePlan:
    """A role's Kubernetes resources, as written and parsed."""

    requests: dict[str, str]  # as written, for manifests
    limits: dict[str, str]
    cpu_request: float | None  # cores
    cpu_limit: float | None
    memory_request_bytes: int | None
    memory_limit_bytes: int | None
    num_gpus: int  # nvidia.com/gpu (limit, else request); 0 without

    @property
    def num_threads(self) -> int | None:
        """Engine threads: cpu_threads() of the CPU limit, else of the request; None without either."""
        cpu = self.cpu_limit if self.cpu_limit is not None else self.cpu_request
        return None if cpu is None else cpu_threads(cpu)


def resource_plan(resources: ResourceRequirements) -> ResourcePlan:
    """Parse a resources block (cpu in cores, memory in bytes, GPUs as a count)."""

    def pick(table: dict[str, str], key: str, parse: Any) -> Any:
        return parse(table[key]) if key in table else None

    gpus = resources.limits.get("nvidia.com/gpu", resources.requests.get("nvidia.com/gpu", "0"))
    return ResourcePlan(
        requests=dict(resources.requests),
        limits=dict(resources.limits),
        cpu_request=pick(resources.requests, "cpu", parse_quantity),
        cpu_limit=pick(resources.limits, "cpu", parse_quantity),
        memory_request_bytes=pick(resources.requests, "memory", parse_memory_bytes),
        memory_limit_bytes=pick(resources.limits, "memory", parse_memory_bytes),
        num_gpus=math.ceil(parse_quantity(gpus)),
    )


@dataclass(frozen=True, slots=True)
class RolePlan:
    """The workers of one role: ``replicas`` identical ``splitserve worker`` processes or pods."""

    role: Role
    name: str  # "<endpoint>" (colocated), "prefill-<endpoint>", "decode-<endpoint>": the deployment's name
    replicas: int
    flags: tuple[str, ...]  # `splitserve worker` arguments, without --host, --port and the per-instance flags
    env: dict[str, str]  # spec.worker.environmentVariables, in order
    resources: ResourcePlan
    container_port: int  # the port a worker listens on in its pod (locally, each instance gets its own)
    num_threads: int | None  # --num-threads in flags (from args, else from the CPU resources); None: all CPUs
    labels: dict[str, str]  # "<api group>/dpd-role": "prefill" | "decode"; empty when colocated


@dataclass(frozen=True, slots=True)
class RouterPlan:
    """The router in front of the workers."""

    name: str  # "<endpoint>-router"
    strategy: RoutingStrategy
    routing_threshold: int | None  # prompt tokens from which a request is disaggregated; None when colocated
    invocation_path: str  # "/v1/chat/completions" or "/v1/completions"
    health_check_path: str  # probed on the router and on every worker
    flags: tuple[str, ...]  # `splitserve router` arguments, without --host, --port and the worker URLs
    kv_events: bool  # workers should send --kv-events-url <router>/kv/events (kvaware; DPD's cache-aware split)


@dataclass(frozen=True, slots=True)
class EndpointPlan:
    """Everything to run for one endpoint. Append per instance: worker --host/--port (and --kv-events-url,
    --worker-id, --advertise-url, --kv-transfer-port as needed); router --host/--port and one
    ``ROLE_URL_FLAG[role] URL`` per worker."""

    name: str
    namespace: str
    target: Target
    model: str  # the --model of every worker and of the router
    is_disaggregated: bool
    roles: tuple[RolePlan, ...]  # (colocated,) or (prefill, decode)
    router: RouterPlan
    l2_backend: L2Backend
    l2_url: str | None  # the Redis in use (the resource's, else plan()'s redis_url)
    l2_path: str | None  # the tieredstorage directory (the runner creates it)
    warnings: tuple[str, ...]  # what was ignored or dropped; show them to the user

    def role(self, role: Role) -> RolePlan:
        """The plan of ``role``; KeyError if this endpoint has none."""
        for planned in self.roles:
            if planned.role == role:
                return planned
        raise KeyError(role)


class _RoleInput(NamedTuple):
    role: Role
    name: str
    replicas: int
    flags: list[Flag]
    resources: ResourceRequirements


def plan(
    config: InferenceEndpointConfig, target: Target = Target.LOCAL, *, redis_url: str | None = None
) -> EndpointPlan:
    """What to run for ``config``: one RolePlan per role and the RouterPlan. Pure: no I/O.

    ``target`` LOCAL takes the model from local_model(); KUBERNETES from ``--model`` in worker.args, else the
    model volume's mount path. ``redis_url`` is the Redis the caller started, used only when the resource
    asks for Redis without a URL (``config.needs_local_redis``). Raises EndpointError for engine flags
    splitserve cannot take, a model a local run cannot load, a Redis L2 with no URL at all, and KV block or
    chunk sizes that differ between roles.
    """
    warnings = _config_warnings(config)
    model = _plan_model(config, target, warnings)
    cache_flags, l2_url, l2_path = _cache_flags(config, target, redis_url)
    roles = tuple(_role_plan(config, part, model, cache_flags, warnings) for part in _role_inputs(config))
    return EndpointPlan(
        name=config.metadata.name,
        namespace=config.metadata.namespace,
        target=target,
        model=model,
        is_disaggregated=config.is_disaggregated,
        roles=roles,
        router=_router_plan(config, model, roles),
        l2_backend=config.l2_backend,
        l2_url=l2_url,
        l2_path=l2_path,
        warnings=tuple(dict.fromkeys(warnings)),  # worker.args warnings come once, not once per role
    )


def _role_inputs(config: InferenceEndpointConfig) -> list[_RoleInput]:
    spec, name = config.spec, config.metadata.name
    base = parse_args(spec.worker.args, "spec.worker.args")
    if spec.pd_spec is None:
        return [_RoleInput(Role.COLOCATED, name, spec.replicas, base, spec.worker.resources)]
    parts = [(Role.PREFILL, "prefillSpec", spec.pd_spec.prefill_spec)]
    parts.append((Role.DECODE, "decodingSpec", spec.pd_spec.decoding_spec))
    return [
        _RoleInput(
            role,
            f"{role.value}-{name}",
            role_spec.replicas,
            merge_flags(base, parse_args(role_spec.args, f"spec.pdSpec.{field}.args")),
            role_spec.resources or ResourceRequirements(),  # worker.resources never applies to PD pods
        )
        for role, field, role_spec in parts
    ]


def _role_plan(
    config: InferenceEndpointConfig, part: _RoleInput, model: str, cache_flags: list[str], warnings: list[str]
) -> RolePlan:
    passed = _worker_flags(part.flags, warnings)
    resources = resource_plan(part.resources)
    written_threads = _last(passed, "num-threads")
    num_threads = int(written_threads.value or 0) if written_threads is not None else resources.num_threads
    flags = ["--model", model, "--role", part.role.value, *(t for f in passed for t in f.tokens()), *cache_flags]
    if written_threads is None and num_threads is not None:
        flags += ["--num-threads", str(num_threads)]
    if resources.num_gpus > 1:
        warnings.append(f"{part.name}: {resources.num_gpus} GPUs requested; a splitserve worker uses one")
    labels = {} if part.role == Role.COLOCATED else {f"{config.api_group}/dpd-role": part.role.value}
    return RolePlan(
        role=part.role,
        name=part.name,
        replicas=part.replicas,
        flags=tuple(flags),
        env={var.name: var.value for var in config.spec.worker.environment_variables},
        resources=resources,
        container_port=config.spec.worker.model_invocation_port.container_port,
        num_threads=num_threads,
        labels=labels,
    )


def _cache_flags(
    config: InferenceEndpointConfig, target: Target, redis_url: str | None
) -> tuple[list[str], str | None, str | None]:
    """The KV tier flags every worker gets, the Redis URL and the tieredstorage directory."""
    kv = config.spec.kv_cache_spec
    flags = ["--l1-cache"] if kv is not None and kv.enable_l1_cache else []
    backend = config.l2_backend
    if backend == L2Backend.NONE or kv is None or kv.l2_cache_spec is None:
        return flags, None, None
    l2 = kv.l2_cache_spec
    if backend == L2Backend.TIEREDSTORAGE:
        meta = config.metadata
        path = l2.l2_cache_path or DEFAULT_L2_PATH.format(namespace=meta.namespace, name=meta.name)
        return [*flags, "--l2-backend", backend.value, "--l2-path", path], None, path
    url = l2.l2_cache_local_url or redis_url
    if url is None:
        where = "spec.kvCacheSpec.l2CacheSpec.l2CacheLocalUrl"
        raise EndpointError(
            f"{where} is required when l2CacheBackend is redis on Kubernetes"
            if target == Target.KUBERNETES
            else f"{where} is not set: start a redis-server and pass its URL as plan(..., redis_url=...) "
            "(splitserve up does this)"
        )
    return [*flags, "--l2-backend", backend.value, "--l2-url", url], url, None


def _router_plan(config: InferenceEndpointConfig, model: str, roles: Sequence[RolePlan]) -> RouterPlan:
    spec, strategy = config.spec, config.routing_strategy
    threshold = spec.pd_spec.routing_threshold if spec.pd_spec is not None else None
    flags = ["--model", model, "--routing-strategy", strategy.value]
    if threshold is not None:
        flags += ["--routing-threshold", str(threshold)]
    for flag, default in (("--block-size", "16"), ("--kv-chunk-size", "256")):
        values = {role.name: _token_value(role.flags, flag) or default for role in roles}
        if len(set(values.values())) > 1:
            shown = ", ".join(f"{name} {value}" for name, value in values.items())
            raise EndpointError(f"spec.pdSpec: {flag} differs between roles ({shown}); the KV keys would not match")
        if set(values.values()) != {default}:
            flags += [flag, next(iter(values.values()))]
    return RouterPlan(
        name=f"{config.metadata.name}-router",
        strategy=strategy,
        routing_threshold=threshold,
        invocation_path=invocation_path(spec.invocation_endpoint),
        health_check_path=spec.load_balancer.health_check_path,
        flags=tuple(flags),
        kv_events=strategy == RoutingStrategy.KVAWARE or config.is_disaggregated,
    )


def _token_value(tokens: Sequence[str], flag: str) -> str | None:
    positions = [i for i, token in enumerate(tokens[:-1]) if token == flag]
    return tokens[positions[-1] + 1] if positions else None


def _config_warnings(config: InferenceEndpointConfig) -> list[str]:
    """What the resource says that has no effect (kept apart from errors: the seeds allow it)."""
    spec, warnings = config.spec, []
    if spec.pd_spec is not None:
        if "replicas" in spec.model_fields_set:
            warnings.append("spec.replicas is ignored with spec.pdSpec: set prefillSpec and decodingSpec replicas")
        for field, role_spec in (
            ("prefillSpec", spec.pd_spec.prefill_spec),
            ("decodingSpec", spec.pd_spec.decoding_spec),
        ):
            if role_spec.resources is None and (spec.worker.resources.requests or spec.worker.resources.limits):
                warnings.append(f"spec.worker.resources does not apply to PD pods: set spec.pdSpec.{field}.resources")
            if role_spec.replicas == 0:
                effect = "every request goes straight to decode" if field == "prefillSpec" else "nothing can serve"
                warnings.append(f"spec.pdSpec.{field}.replicas is 0: {effect}")
    elif spec.replicas == 0:
        warnings.append("spec.replicas is 0: the endpoint has no workers")
    kv = spec.kv_cache_spec
    if kv is not None and kv.l2_cache_spec is not None and not kv.enable_l2_cache:
        warnings.append("spec.kvCacheSpec.l2CacheSpec is ignored: enableL2Cache is false")
    routing = spec.intelligent_routing_spec
    if routing is not None and not routing.enabled and "routing_strategy" in routing.model_fields_set:
        warnings.append("spec.intelligentRoutingSpec.routingStrategy is ignored: enabled is false (roundrobin)")
    if spec.load_balancer.health_check_path != "/health":
        path = spec.load_balancer.health_check_path
        warnings.append(f"spec.loadBalancer.healthCheckPath {path}: splitserve serves /health; other probes fail")
    return warnings

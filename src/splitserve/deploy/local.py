"""The local commands: ``splitserve up`` (foreground) and ``apply`` / ``get`` / ``logs`` / ``delete`` (background).

Each endpoint has a run directory, ``$SPLITSERVE_HOME/endpoints/<name>`` (``~/.splitserve`` by default): the
applied resource (``endpoint.yaml``), the supervisor's pid and log, ``state.json``, the cluster secret and one
log per pod. It is the user's alone (mode 0700, as every directory made on the way; logs 0600), and so is the
default disk L2 (``endpoint.local_l2_path``, in the user's cache, not ``/tmp``). A local run cannot read a
Kubernetes Secret: a ``valueFrom.secretKeyRef`` in the resource is an error that says to set the variable in
the environment of ``splitserve up`` or ``apply`` instead, which every pod inherits. ``up``
runs the supervisor in this process until Ctrl-C or SIGTERM, then stops every pod. ``apply`` starts the same
supervisor in the background, or, when one already runs for that endpoint, hands it the new resource (SIGHUP)
to reconcile. ``get`` and ``logs`` read the run directory; ``delete`` stops the supervisor, which stops its pods.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from splitserve import envs
from splitserve.config import L2Backend
from splitserve.deploy import vllm
from splitserve.deploy.plan import local_model
from splitserve.deploy.pods import format_pods, open_private_log
from splitserve.deploy.supervisor import READY_TIMEOUT_S, Supervisor, default_run_root, splitserve_command
from splitserve.endpoint import (
    EndpointError,
    InferenceEndpointConfig,
    WorkerEngine,
    load_endpoint,
    local_l2_path,
    secret_refs,
)

logger = logging.getLogger("splitserve.supervisor")

LOG_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"
TICK_S = 0.5


def run_dir_for(name: str, root: Path | None = None) -> Path:
    return (root or default_run_root()) / name


def revision_of(path: Path) -> str:
    """A digest of a resource file's bytes: what ``state.json``'s ``revision`` reports once applied."""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def load_for_local_run(path: Path) -> InferenceEndpointConfig:
    """The resource, checked for a local run (a model that needs no network, no Secret to read). Raises
    ``EndpointError``."""
    config = load_endpoint(path)
    (vllm.local_model if config.spec.worker.engine == WorkerEngine.VLLM else local_model)(config)
    refs = secret_refs(config)
    if refs:
        why = (
            "secretKeyRef: a local run cannot read a Kubernetes Secret; remove the variable and set it in the "
            "environment of splitserve up or apply instead (every pod inherits it)"
        )
        raise EndpointError([f"{ref}.{why}" for ref in refs], str(path))
    return config


def private_dir(path: Path) -> Path:
    """``path``, made mode 0700 with every missing parent (existing parents are left as they are)."""
    for directory in reversed((path, *path.parents)):
        if not directory.exists():
            directory.mkdir(mode=0o700, exist_ok=True)
    path.chmod(0o700)
    return path


def _private_l2(config: InferenceEndpointConfig) -> None:
    """The default disk L2 directory, made private before any worker writes to it."""
    kv = config.spec.kv_cache_spec
    if config.l2_backend != L2Backend.TIEREDSTORAGE or kv is None or kv.l2_cache_spec is None:
        return
    if not kv.l2_cache_spec.l2_cache_path:
        private_dir(Path(local_l2_path(config.metadata.namespace, config.metadata.name)))


def up(path: Path, *, router_port: int = 8080, host: str = "127.0.0.1", root: Path | None = None) -> int:
    """Run the endpoint in the foreground until SIGINT/SIGTERM. ``path`` is copied to the run directory's
    ``endpoint.yaml``; SIGHUP (``splitserve apply -f`` sends it after replacing that file) re-reads it."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per readiness probe otherwise
    config = load_for_local_run(path)
    run_dir = private_dir(run_dir_for(config.metadata.name, root))
    applied = run_dir / "endpoint.yaml"  # what SIGHUP re-reads; `splitserve apply -f` replaces it
    if path.resolve() != applied.resolve():
        shutil.copyfile(path, applied)
    path = applied
    supervisor = Supervisor(run_dir, host=host, router_port=router_port)
    stop, reload = threading.Event(), threading.Event()

    def on_stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    def on_reload(signum: int, frame: FrameType | None) -> None:
        reload.set()

    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGHUP, on_reload)
    _write_pid_file(run_dir / "supervisor.pid")  # after the handlers: SIGHUP must not kill us
    try:
        _private_l2(config)
        supervisor.apply(config, revision_of(path))
        _report(supervisor, stop)
        while not stop.is_set():
            if reload.is_set():
                reload.clear()
                _reapply(supervisor, path, stop)
            supervisor.tick()
            stop.wait(TICK_S)
    finally:
        logger.info("stopping endpoint %s", config.metadata.name)
        supervisor.shutdown()
        (run_dir / "supervisor.pid").unlink(missing_ok=True)
    return 0


def _reapply(supervisor: Supervisor, path: Path, stop: threading.Event) -> None:
    try:
        config = load_for_local_run(path)
    except EndpointError as exc:
        logger.error("not applied: %s", exc)
        return
    logger.info("reconciling %s", config.metadata.name)
    try:
        _private_l2(config)
        supervisor.apply(config, revision_of(path))
    except (EndpointError, RuntimeError) as exc:  # checked before anything changed: the endpoint keeps running
        logger.error("not applied: %s", exc)
        return
    _report(supervisor, stop)


def _report(supervisor: Supervisor, stop: threading.Event) -> None:
    """Wait until every pod is ready (or a stop), then print the pods and where their metrics are."""
    deadline = time.time() + READY_TIMEOUT_S
    while not supervisor.is_ready and not stop.is_set() and time.time() < deadline:
        supervisor.tick()
        stop.wait(0.3)
    if stop.is_set():
        return
    print(supervisor.pods.table(), flush=True)
    print(f"\nrouter: {supervisor.router_url}  (OpenAI API: {supervisor.router_url}/v1)", flush=True)
    for pod in supervisor.pods.pods:
        if pod.spec.health_path is not None:
            print(f"metrics: {pod.spec.url}/metrics  ({pod.name})", flush=True)
    if supervisor.is_ready:
        print(f"\ncondition Ready: {supervisor.ready_message}", flush=True)


def apply(path: Path, *, router_port: int = 8080, root: Path | None = None, wait_s: float = 600.0) -> int:
    """Start the endpoint in the background, or reconcile the running one; print its pods when ready."""
    config = load_for_local_run(path)
    run_dir = private_dir(run_dir_for(config.metadata.name, root))
    target = run_dir / "endpoint.yaml"
    shutil.copyfile(path, target)
    pid = _supervisor_pid(run_dir)
    revision = revision_of(target)
    if pid is not None:
        os.kill(pid, signal.SIGHUP)
        print(f"endpoint {config.metadata.name} reconfigured")
    else:
        command = [*splitserve_command("up", "-f", str(target), "--port", str(router_port))]
        env = {**envs.copy(), envs.HOME.name: str(run_dir.parent.parent)}
        with open_private_log(run_dir / "supervisor.log") as log:
            subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        print(f"endpoint {config.metadata.name} created")
    state = _wait_state(run_dir, lambda s: bool(s["condition"]["status"]) and s.get("revision") == revision, wait_s)
    if state is None:
        print(f"not ready after {wait_s:.0f} s; see `splitserve get {config.metadata.name}` and the pod logs")
        return 1
    print(format_pods(state["pods"]))
    print(f"\ncondition Ready: {state['condition']['message']}")
    return 0


def get(name: str | None = None, *, root: Path | None = None) -> int:
    root = root or default_run_root()
    names = [name] if name else sorted(p.name for p in root.glob("*") if (p / "state.json").exists())
    if not names:
        print("No endpoints found.")
        return 0
    for endpoint in names:
        state = _read_state(run_dir_for(endpoint, root))
        if state is None:
            print(f"endpoint {endpoint} not found", file=sys.stderr)
            return 1
        alive = _supervisor_pid(run_dir_for(endpoint, root)) is not None
        condition = state["condition"]
        status = "Stopped" if not alive else condition["message"] if condition["status"] else "NotReady"
        pods = state["pods"]
        if not alive:  # its supervisor was killed: nothing keeps these rows current (and its pods died with it)
            pods = [pod | {"ready": False, "status": "Unknown"} for pod in pods]
        print(f"ENDPOINT {endpoint}   ROUTER {state['router_url']}   {status}")
        print(format_pods(pods))
        print()
    return 0


def logs(pod: str, *, lines: int = 100, root: Path | None = None) -> int:
    root = root or default_run_root()
    for log in root.glob(f"*/logs/{pod}.log"):
        text = log.read_text(errors="replace").splitlines()
        print("\n".join(text[-lines:]))
        return 0
    print(f"pod {pod} not found (see `splitserve get`)", file=sys.stderr)
    return 1


def delete(name: str, *, root: Path | None = None, timeout_s: float = 60.0) -> int:
    run_dir = run_dir_for(name, root)
    pid = _supervisor_pid(run_dir)
    if pid is None:
        print(f"endpoint {name} is not running", file=sys.stderr)
        return 1
    os.kill(pid, signal.SIGTERM)
    deadline = time.time() + timeout_s
    while time.time() < deadline and _is_alive(pid):
        time.sleep(0.2)
    if _is_alive(pid):
        print(f"endpoint {name} is still stopping (supervisor pid {pid})", file=sys.stderr)
        return 1
    print(f"endpoint {name} deleted")
    return 0


def _write_pid_file(path: Path) -> None:
    """``<pid> <start time>``: a later reader signals this process only, never one that reused its pid."""
    pid = os.getpid()
    path.write_text(f"{pid} {_start_time(pid) or ''}".strip())


def _supervisor_pid(run_dir: Path) -> int | None:
    """The pid of the endpoint's running supervisor; None when none runs (or the file names a process that
    has since ended, its pid maybe reused by another)."""
    try:
        fields = (run_dir / "supervisor.pid").read_text().split()
        pid = int(fields[0])
    except (OSError, ValueError, IndexError):
        return None
    if not _is_alive(pid):
        return None
    if len(fields) > 1 and fields[1] != _start_time(pid):
        return None  # another process now has that pid
    return pid


def _start_time(pid: int) -> str | None:
    """When ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat`` field 22); None off Linux."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # fields after the name, which may hold spaces and ")"


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_state(run_dir: Path) -> dict[str, Any] | None:
    try:
        state: dict[str, Any] = json.loads((run_dir / "state.json").read_text())
    except (OSError, ValueError):
        return None
    return state


def _wait_state(run_dir: Path, predicate: Any, timeout_s: float) -> dict[str, Any] | None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        state = _read_state(run_dir)
        if state is not None and predicate(state):
            return state
        time.sleep(0.5)
    return None

"""Local processes run the way Kubernetes runs pods: start, probe readiness, restart with back-off, stop.

A :class:`Pod` is one process with a stable name (``prefill-<endpoint>-<id>``), a command, a log file and a
readiness probe (an HTTP ``/health``, or a Redis ``PING``). :class:`PodSet` keeps pods running: a pod that exits
is restarted after a back-off that doubles up to ``MAX_BACKOFF_S`` (shown as ``CrashLoopBackOff`` meanwhile,
counted in ``RESTARTS``) and that resets once it has stayed up ``STABLE_AFTER_S``. Status rows look like
``kubectl get pods``. Nothing here knows about endpoints; ``supervisor`` decides which pods should exist.

Like a kubelet's liveness probe, a ready pod is probed every ``LIVENESS_PERIOD_S``: an answer other than 200
makes it not ready (until it answers 200 again), and ``LIVENESS_FAILURES`` probes in a row without any answer
get it killed and restarted. Pods die with the supervisor, even a SIGKILLed one: each gets SIGTERM when its
parent dies (Linux's ``PR_SET_PDEATHSIG``), and drains.

Logs are the user's alone: a 0700 directory, 0600 files (:func:`open_private_log`). Secrets never reach a log:
commands are logged :func:`redacted` (the value of ``--api-key``, the password in a URL), and secrets travel
in files or the environment, never in argv.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import secrets
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import httpx

from splitserve import envs

logger = logging.getLogger("splitserve.supervisor")

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_AFTER_S = 60.0
STOP_TIMEOUT_S = 20.0
LIVENESS_PERIOD_S = 5.0
LIVENESS_FAILURES = 3  # probes in a row without an answer before a ready pod is killed and restarted
PROBE_TIMEOUT_S = 2.0
PR_SET_PDEATHSIG = 1


SECRET_FLAGS = frozenset({"--api-key"})  # flags whose value must never reach a log
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/@:\s]*:)[^@/\s]+@")  # scheme://user:PASSWORD@


def redacted(command: Sequence[str]) -> list[str]:
    """``command`` with every secret hidden: the value of a secret-bearing flag (``--api-key KEY``,
    ``--api-key=KEY``) and the password of a URL (``redis://user:PASSWORD@host``)."""
    out: list[str] = []
    for token in command:
        flag = token.split("=", 1)[0]
        if out and out[-1] in SECRET_FLAGS:
            out.append("***")
        elif flag in SECRET_FLAGS and "=" in token:
            out.append(f"{flag}=***")
        else:
            out.append(_URL_PASSWORD.sub(r"\g<head>***@", token))
    return out


def open_private_log(path: Path) -> BinaryIO:
    """``path`` opened for appending, created 0600 (and its directory 0700) when missing."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")


def pod_name(role: str, endpoint: str) -> str:
    """``<role>-<endpoint>-<5 random chars>``, as a Deployment's pods are named."""
    return f"{role}-{endpoint}-{secrets.token_hex(3)[:5]}"


@dataclass
class PodSpec:
    """What to run; two pods with equal specs are interchangeable (a reapply keeps them)."""

    role: str  # colocated, prefill, decode, router, redis
    command: tuple[str, ...]
    port: int
    env: tuple[tuple[str, str], ...] = ()
    cpus: tuple[int, ...] = ()  # CPU affinity; empty: any
    health_path: str | None = "/health"  # None: probe with a Redis PING instead

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Pod:
    name: str
    spec: PodSpec
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    created_at: float = field(default_factory=time.time)
    started_at: float = 0.0
    is_ready: bool = False
    restart_at: float | None = None  # set while waiting out a back-off
    backoff_s: float = FIRST_BACKOFF_S
    is_stopping: bool = False
    probed_at: float = 0.0  # last liveness probe
    num_unanswered: int = 0  # liveness probes in a row that got no answer
    group_is_gone: bool = False  # the process group was killed once its main process exited

    @property
    def status(self) -> str:
        if self.is_stopping:
            return "Terminating"
        if self.restart_at is not None:
            return "CrashLoopBackOff" if self.restarts > 1 else "Error"
        if self.process is None:
            return "Pending"
        return "Running" if self.is_ready else "ContainerCreating"

    def start(self) -> None:
        log = open_private_log(self.log_path)
        self.process = subprocess.Popen(
            self.spec.command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**envs.copy(), **dict(self.spec.env)},
            start_new_session=True,
            preexec_fn=child_setup(self.spec.cpus),
        )
        log.close()
        self.started_at = time.time()
        self.group_is_gone = False
        self.is_ready = False
        self.restart_at = None
        self.num_unanswered = 0

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM the process group, SIGKILL after ``timeout_s``."""
        self.is_stopping = True
        process = self.process
        if process is None:
            return
        if process.poll() is not None:
            self.kill_leftovers()
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        except ProcessLookupError:
            pass
        self.kill_leftovers()

    def probe(self) -> bool:
        """Readiness: the process answers its probe with 200 (Redis: PONG)."""
        return self.check() == 200

    def check(self) -> int | None:
        """The probe's HTTP status (200 for a Redis PONG), or None when the process did not answer at all."""
        if self.process is None or self.process.poll() is not None:
            return None
        if self.spec.health_path is None:
            return 200 if _redis_ping(self.spec.port) else None
        try:
            return httpx.get(
                self.spec.url + self.spec.health_path, timeout=PROBE_TIMEOUT_S, trust_env=False
            ).status_code
        except httpx.HTTPError:
            return None

    def kill(self) -> None:
        """SIGKILL the process group (the pod is then restarted like one that exited)."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)

    def kill_leftovers(self) -> None:
        """SIGKILL what is left of the process group of a pod whose main process exited (a vLLM server's engine
        and workers outlive it when it is killed), as a container's end takes every process in it. Once per
        exit, as soon as it is seen: later, the group's number could belong to another process."""
        if self.process is not None and self.process.poll() is not None and not self.group_is_gone:
            self.group_is_gone = True
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)

    def state(self) -> dict[str, Any]:
        """What ``state.json`` keeps of the pod."""
        return {
            "name": self.name,
            "role": self.spec.role,
            "ready": self.is_ready,
            "status": self.status,
            "restarts": self.restarts,
            "created_at": self.created_at,
            "url": self.spec.url,
            "metrics": f"{self.spec.url}/metrics" if self.spec.health_path else None,
            "log": str(self.log_path),
            "pid": self.process.pid if self.process is not None else None,
            "cpus": list(self.spec.cpus),
        }


def child_setup(cpus: Sequence[int] = ()) -> Callable[[], None]:
    """A ``preexec_fn`` for a process started on the user's behalf: pinned to ``cpus`` (when given), and sent
    SIGTERM when this process dies, even by SIGKILL (Linux's ``PR_SET_PDEATHSIG``).

    The signal follows the *thread* that started the child, so start children from a thread that lives as long
    as they should (the main thread, here)."""
    parent = os.getpid()

    def setup() -> None:  # in the child, between fork and exec
        if cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)
        _die_with_parent(parent)

    return setup


def _die_with_parent(parent: int) -> None:
    """In a child before exec: get SIGTERM when the parent dies (Linux); exit now if it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: pods outlive a killed supervisor
        return
    if os.getppid() != parent:
        os._exit(1)


def _redis_ping(port: int) -> bool:
    import redis

    try:
        return bool(redis.Redis(port=port, socket_timeout=1.0).ping())
    except redis.AuthenticationError:  # it answers: a password-protected Redis is up
        return True
    except redis.RedisError:
        return False


def _human_age(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h"


class PodSet:
    """The running pods of one endpoint; :meth:`tick` keeps them alive and their readiness current."""

    def __init__(self, log_dir: Path, on_change: Callable[[], None] | None = None) -> None:
        self.log_dir = log_dir
        self.pods: list[Pod] = []
        self._on_change = on_change or (lambda: None)

    def add(self, spec: PodSpec, name: str) -> Pod:
        pod = Pod(name, spec, self.log_dir / f"{name}.log")
        self.pods.append(pod)
        pod.start()
        logger.info("pod %s started: %s", name, " ".join(redacted(spec.command)))
        self._on_change()
        return pod

    def remove(self, pod: Pod) -> None:
        pod.stop()
        self.pods.remove(pod)
        logger.info("pod %s deleted", pod.name)
        self._on_change()

    def by_role(self, *roles: str) -> list[Pod]:
        return [p for p in self.pods if p.spec.role in roles]

    def tick(self) -> bool:
        """Restart exited pods (after their back-off) and refresh readiness; True if anything changed."""
        now = time.time()
        changed = False
        for pod in self.pods:
            process = pod.process
            if pod.restart_at is None and process is not None and process.poll() is not None:
                pod.kill_leftovers()
                uptime = now - pod.started_at
                pod.backoff_s = FIRST_BACKOFF_S if uptime > STABLE_AFTER_S else min(pod.backoff_s * 2, MAX_BACKOFF_S)
                pod.restart_at = now + pod.backoff_s
                pod.restarts += 1
                pod.is_ready = False
                logger.warning("pod %s exited with %s; restarting in %.0f s (restart %d)",
                               pod.name, process.returncode, pod.backoff_s, pod.restarts)  # fmt: skip
                changed = True
            elif pod.restart_at is not None and now >= pod.restart_at:
                pod.start()
                changed = True
            elif pod.restart_at is None and not pod.is_ready and pod.probe():
                pod.is_ready = True
                pod.probed_at, pod.num_unanswered = now, 0
                logger.info("pod %s is ready at %s", pod.name, pod.spec.url)
                changed = True
            elif pod.restart_at is None and pod.is_ready and now - pod.probed_at >= LIVENESS_PERIOD_S:
                changed = self._check_live(pod, now) or changed
        if changed:
            self._on_change()
        return changed

    def _check_live(self, pod: Pod, now: float) -> bool:
        """Liveness of a ready pod; True if its state changed."""
        pod.probed_at = now
        status = pod.check()
        if status is not None:
            pod.num_unanswered = 0
            if status != 200:
                logger.warning("pod %s is not ready: its probe answered %d", pod.name, status)
                pod.is_ready = False
                return True
            return False
        pod.num_unanswered += 1
        if pod.num_unanswered < LIVENESS_FAILURES or pod.process is None or pod.process.poll() is not None:
            return False
        logger.warning("pod %s did not answer %d liveness probes; killing it", pod.name, pod.num_unanswered)
        pod.kill()
        pod.is_ready = False
        return True

    def wait_ready(self, pods: Sequence[Pod], timeout_s: float, poll_s: float = 0.3) -> bool:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            self.tick()
            if all(p.is_ready for p in pods):
                return True
            time.sleep(poll_s)
        return False

    def stop_all(self) -> None:
        for pod in reversed(self.pods):  # the router first, Redis last
            pod.stop()
        self.pods.clear()

    def table(self, now: float | None = None) -> str:
        return format_pods([p.state() for p in self.pods], now)


def format_pods(pods: Sequence[dict[str, Any]], now: float | None = None) -> str:
    """``kubectl get pods`` rows from :meth:`Pod.state` entries (as kept in ``state.json``)."""
    now = now or time.time()
    rows = [("NAME", "READY", "STATUS", "RESTARTS", "AGE")]
    for pod in pods:
        ready = "1/1" if pod["ready"] else "0/1"
        rows.append((pod["name"], ready, pod["status"], str(pod["restarts"]), _human_age(now - pod["created_at"])))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)

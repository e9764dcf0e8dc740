"""Run an ``InferenceEndpointConfig`` on this machine: Redis if asked, the workers of each role, the router.

:class:`Supervisor` turns the ``deploy.plan`` plan into pods (``deploy.pods``) and reconciles: :meth:`apply` with a
changed resource keeps the pods whose role, flags and environment did not change, adds the missing replicas,
drains and removes the surplus ones (the router stops sending them requests first, then they finish what
they have), and tells the router its new worker lists through ``PUT /admin/workers``. Only a change of
the router's own settings (strategy, threshold, DPD on or off) restarts the router.

Each worker gets ``resources.limits.cpu`` (or ``--num-threads``) threads and as many cores of its own
(``sched_setaffinity``, handed out in turn, so a 2-core machine runs a prefill and a decode worker on one core
each), ``CUDA_VISIBLE_DEVICES`` for a GPU request, a free port, and ``--kv-events-url`` to the router when the
router uses KV events. The state (pods, the ``Ready`` condition) is written to ``state.json`` in the run
directory, where ``splitserve get`` and ``logs`` read it.

With ``spec.autoscaling``, each tick past its interval reads the load (the requests in flight on each scaled
role's pods, the time to first token at the routers) and :class:`~splitserve.deploy.autoscale.Autoscaler` decides
each role's replicas; a change is applied as a re-apply of the resource with those replica counts (the user's
file is kept as written: a later ``apply`` keeps the scaled counts, within its bounds). So a new replica is ready
before it takes traffic, and a removed one leaves the routers' lists, then finishes its requests, before it stops.

With ``spec.router.replicas`` above 1, that many routers run, each on a port and an admin port of its own and
each told the worker lists, behind a TCP balancer on the endpoint's port (``deploy.balancer``, a pod of its own),
as a Kubernetes Service is in front of the router pods: a killed replica is restarted, and meanwhile the
balancer sends new connections to the others.

vLLM workers (``spec.worker.engine: vllm``, ``deploy.vllm``) run ``vllm serve`` from the environment
``vllm.local_command`` finds (``SPLITSERVE_VLLM_PYTHON``, else ``vllm`` on PATH, else the peer environment of
``scripts/setup_vllm_cpu.sh``), checked before anything changes. Each gets a free port with the two after it
free too (its KV event and replay sockets, under a kvaware router), binds the supervisor's host, takes the
cluster secret as ``VLLM_API_KEY`` (its environment, never argv) and binds its threads to its own cores.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import shutil
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from splitserve import envs
from splitserve.auth import bearer_header
from splitserve.config import Role
from splitserve.deploy import vllm
from splitserve.deploy.autoscale import TTFT_QUANTILE, Autoscaler, RoleLoad, quantile_of, recommend
from splitserve.deploy.plan import ROLE_URL_FLAG, EndpointPlan, RolePlan, Target, plan
from splitserve.deploy.pods import Pod, PodSet, PodSpec, pod_name
from splitserve.deploy.render import REDIS_MAX_MEMORY
from splitserve.endpoint import EndpointError, InferenceEndpointConfig, RoleSpec, WorkerEngine
from splitserve.metrics import ROUTER_TTFT_SECONDS, histogram_buckets, sum_samples

logger = logging.getLogger("splitserve.supervisor")

READY_TIMEOUT_S = 600.0
WORKER_ROLES = ("colocated", "prefill", "decode")
DRAIN_TIMEOUT_S = 60.0
DPD_READY_MESSAGE = "DPD prefill and decode deployments are ready"
COLOCATED_READY_MESSAGE = "Endpoint deployment is ready"


def splitserve_command(*args: str) -> tuple[str, ...]:
    """``splitserve <args>`` with this interpreter (no reliance on PATH)."""
    return (sys.executable, "-c", "from splitserve.cli import main; main()", *args)


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_LISTEN_PORT = 10000


def listen_port_range() -> range:
    """Ports a pod may be given to listen on: below the kernel's ephemeral range (``ip_local_port_range``), from
    which every outgoing connection takes its local port. A port handed out there can be taken by one of them
    in the seconds before the pod binds it: a vLLM pod's EngineCore, binding its event sockets late in its
    start, failed with "Address already in use" that way. Empty where the range is unknown."""
    try:
        low = int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return range(0)
    return range(LOWEST_LISTEN_PORT, low)


_issued_ports: set[int] = set()  # handed out by this process: two pods started together never share one
_issued_lock = threading.Lock()


def free_port(num_ports: int = 1, attempts: int = 100) -> int:
    """A free port on 127.0.0.1 whose next ``num_ports - 1`` ports are free too (a vLLM worker's event sockets),
    none handed out before by this process, below the ephemeral range where there is room
    (``listen_port_range``), else one the kernel picks."""
    span = listen_port_range()
    pick = secrets.SystemRandom()
    for attempt in range(attempts):
        if len(span) > 100 * num_ports and attempt < max(1, attempts // 2):
            port = pick.randrange(span.start, span.stop - num_ports + 1)
            if not _is_free(port):
                continue
        else:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = int(sock.getsockname()[1])
        ports = set(range(port, port + num_ports))
        if port + num_ports > 65536 or not all(_is_free(p) for p in range(port + 1, port + num_ports)):
            continue
        with _issued_lock:
            if ports & _issued_ports:
                continue
            _issued_ports.update(ports)
        return port
    raise RuntimeError(f"found no {num_ports} free ports in a row on 127.0.0.1")


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def default_run_root() -> Path:
    return Path(envs.get(envs.HOME) or Path.home() / ".splitserve") / "endpoints"


class DeviceAllocator:
    """Hands out the least used devices (cores, GPUs) first, and takes them back when a pod goes, so pods that
    together ask for no more than the machine has do not overlap."""

    def __init__(self, devices: Sequence[int]) -> None:
        self.users = dict.fromkeys(devices or [0], 0)

    def take(self, num: int) -> tuple[int, ...]:
        num = min(max(num, 1), len(self.users))
        taken = tuple(sorted(sorted(self.users), key=lambda d: self.users[d])[:num])
        for device in taken:
            self.users[device] += 1
        return taken

    def release(self, devices: Sequence[int]) -> None:
        for device in devices:
            if self.users.get(device, 0) > 0:
                self.users[device] -= 1


@dataclass(frozen=True)
class _Template:
    """What makes two worker pods interchangeable (ports, cores and names aside)."""

    role: Role
    flags: tuple[str, ...]
    env: tuple[tuple[str, str], ...]  # the engine's and the resource's
    num_threads: int | None
    num_gpus: int
    vllm_events: bool  # a vLLM worker publishes KV events (--kv-events-config): kvaware only


class Supervisor:
    def __init__(self, run_dir: Path, *, host: str = "127.0.0.1", router_port: int = 8080) -> None:
        self.run_dir = run_dir
        self.host = host
        self.router_port = router_port
        self.admin_port = free_port()
        self.pods = PodSet(run_dir / "logs", on_change=self.write_state)
        self.plan: EndpointPlan | None = None
        self.config: InferenceEndpointConfig | None = None  # what runs: the user's, with the autoscaled replicas
        self.user_config: InferenceEndpointConfig | None = None  # as applied
        self._autoscaler: Autoscaler | None = None
        self._scaled: dict[str, int] = {}  # role -> replicas the autoscaler chose
        self._next_scale_at = 0.0
        self._ttft_seen: dict[str, dict[float, float]] = {}  # router pod -> its TTFT buckets at the last read
        self._templates: dict[str, _Template] = {}
        self._routers: list[Pod] = []
        self._admin_ports: list[int] = [self.admin_port]  # each router's, in the order of _routers
        self._balancer: Pod | None = None  # in front of the routers, when there are several
        self._router_flags: tuple[str, ...] = ()
        self._redis: Pod | None = None
        self._vllm_command: tuple[str, ...] = ()  # `vllm serve` here (vllm.local_command), for vLLM workers
        self._cpus = DeviceAllocator(sorted(os.sched_getaffinity(0)))
        self._gpus = DeviceAllocator(list(range(_num_gpus())))
        self._gpus_of: dict[str, tuple[int, ...]] = {}
        self._was_ready = False
        self.revision = ""  # of the last resource applied in full
        self.secret_file = run_dir / "cluster-secret"
        self._secret = _cluster_secret(self.secret_file)  # closes every pod's internal routes to outsiders

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    @property
    def admin_url(self) -> str:
        """The (first) router's admin listener (loopback), where the worker lists are published."""
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def admin_urls(self) -> list[str]:
        """Every router replica's admin listener."""
        return [f"http://127.0.0.1:{port}" for port in self._admin_ports[: max(1, len(self._routers))]]

    # -- reconcile ----------------------------------------------------------------------------------------

    def apply(self, config: InferenceEndpointConfig, revision: str = "") -> None:
        """Make the running pods match ``config`` (raises ``EndpointError`` for a resource that cannot run).

        ``revision`` names what was applied (a digest of the file); ``state.json`` reports it once done.
        """
        plan(config, Target.LOCAL, redis_url="redis://127.0.0.1:6379/0")  # every EndpointError before any change
        if config.spec.worker.engine == WorkerEngine.VLLM:
            self._vllm_command = vllm.local_command(envs.copy())  # RuntimeError before any change, too
        redis_url = self._ensure_redis(config)  # RuntimeError without a redis-server, before the pods change
        if config.spec.autoscaling != (self.user_config.spec.autoscaling if self.user_config is not None else None):
            scaling = config.spec.autoscaling
            self._autoscaler = Autoscaler(scaling) if scaling is not None else None
        self.user_config = config  # taken as current once nothing before the pods' changes can fail
        config = self._with_scaled_replicas(config)
        new_plan = plan(config, Target.LOCAL, redis_url=redis_url)
        for warning in new_plan.warnings:
            logger.warning("%s", warning)
        self.config, self.plan = config, new_plan
        router_changes = self._router_flags != self._router_base_flags(new_plan)
        kept: list[Pod] = []
        added: list[Pod] = []
        for role_plan in new_plan.roles:
            template = self._template(role_plan, new_plan.router.vllm_events)
            same = [p for p in self.pods.by_role(role_plan.role.value) if self._templates.get(p.name) == template]
            kept += same[: role_plan.replicas]
            added += [self._start_worker(new_plan, role_plan, template) for _ in range(role_plan.replicas - len(same))]
        removed = [p for p in self.pods.pods if p.spec.role in WORKER_ROLES and p not in kept and p not in added]
        if added and not router_changes and self._routers:
            self.pods.wait_ready(added, READY_TIMEOUT_S)  # new pods join the router's list once they can serve
        kept += added
        if router_changes or not self._routers:
            self._restart_router(new_plan, kept)
        else:
            self._publish_workers(kept)
        for pod in removed:
            self._drain(pod)
            self.pods.remove(pod)
            self._templates.pop(pod.name, None)
            self._cpus.release(pod.spec.cpus)
            self._gpus.release(self._gpus_of.pop(pod.name, ()))
        if self._redis is not None and not config.needs_local_redis:
            self.pods.remove(self._redis)
            self._redis = None
        self.revision = revision
        self.write_state()

    def tick(self) -> None:
        """Keep pods alive (restarts with back-off), scale (``spec.autoscaling``) and report the endpoint's
        readiness when it changes."""
        self.pods.tick()
        self._autoscale()
        ready = self.is_ready
        if ready != self._was_ready:
            self._was_ready = ready
            if ready:
                logger.info("%s", self.ready_message)
            self.write_state()

    def shutdown(self) -> None:
        self.pods.stop_all()
        self._routers, self._balancer, self._redis = [], None, None
        self.write_state()

    @property
    def is_ready(self) -> bool:
        return bool(self.pods.pods) and all(p.is_ready for p in self.pods.pods)

    @property
    def ready_message(self) -> str:
        return DPD_READY_MESSAGE if self.plan is not None and self.plan.is_disaggregated else COLOCATED_READY_MESSAGE

    # -- autoscaling --------------------------------------------------------------------------------------

    def _with_scaled_replicas(self, config: InferenceEndpointConfig) -> InferenceEndpointConfig:
        """``config`` with each autoscaled role's replicas: the autoscaler's, else the file's, within the bounds."""
        scaling = config.spec.autoscaling
        if scaling is None:
            self._scaled = {}
            return config
        spec = config.spec
        for role, bounds in scaling.roles().items():
            written = spec.replicas if role == "colocated" else _role_spec(config, role).replicas
            if role == "prefill" and bounds.decode_ratio is not None and role not in self._scaled:
                decode = self._scaled.get("decode", _role_spec(config, "decode").replicas)
                written = recommend(bounds, RoleLoad(written, 0.0, decode_replicas=decode))
            replicas = min(bounds.max_replicas, max(bounds.min_replicas, self._scaled.get(role, written)))
            self._scaled[role] = replicas
            if role == "colocated":
                spec = spec.model_copy(update={"replicas": replicas})
            else:
                assert spec.pd_spec is not None
                key = "prefill_spec" if role == "prefill" else "decoding_spec"
                role_spec = getattr(spec.pd_spec, key).model_copy(update={"replicas": replicas})
                spec = spec.model_copy(update={"pd_spec": spec.pd_spec.model_copy(update={key: role_spec})})
        return config.model_copy(update={"spec": spec})

    def _autoscale(self) -> None:
        """Once per interval: each scaled role's load, the autoscaler's decision, and a re-apply if one changed."""
        if self._autoscaler is None or self.user_config is None or time.monotonic() < self._next_scale_at:
            return
        self._next_scale_at = time.monotonic() + self._autoscaler.spec.interval_seconds
        ttft_p90 = self._router_ttft_p90()
        changed = False
        for role in self._autoscaler.spec.roles():
            pods = self.pods.by_role(role)
            follows = role == "decode" and self._autoscaler.spec.prefill_follows_decode
            counted = [*pods, *self.pods.by_role("prefill")] if follows else pods
            in_flight = sum(_requests_in_worker(p) for p in counted)
            decode = self._scaled.get("decode", len(self.pods.by_role("decode"))) if role == "prefill" else None
            load = RoleLoad(len(pods), in_flight, ttft_p90 if role != "decode" else None, decode)
            wanted = self._autoscaler.decide(role, load)
            if wanted != load.replicas:
                ttft = "none" if load.ttft_p90_s is None else f"{load.ttft_p90_s:.2f} s"
                logger.info("autoscaling %s: %d -> %d replicas (%.0f requests in flight, time to first token p90 %s)",
                            role, load.replicas, wanted, load.in_flight, ttft)  # fmt: skip
                self._scaled[role] = wanted
                changed = True
        if changed:
            try:
                self.apply(self.user_config, self.revision)
            except (EndpointError, RuntimeError) as exc:  # the endpoint keeps running as it is
                logger.error("autoscaling not applied: %s", exc)

    def _router_ttft_p90(self) -> float | None:
        """The 90th percentile of the time to first token the routers saw since the last read (None: no first
        token since). A router that restarted counts from zero."""
        total: dict[float, float] = {}
        for router in self._routers:
            try:
                text = httpx.get(f"{router.spec.url}/metrics", timeout=2, trust_env=False).text
            except httpx.HTTPError:
                continue
            now = histogram_buckets(text, ROUTER_TTFT_SECONDS)
            before = self._ttft_seen.get(router.name, {})
            if any(now.get(bound, 0.0) < count for bound, count in before.items()):
                before = {}  # restarted
            self._ttft_seen[router.name] = now
            for bound, count in now.items():
                total[bound] = total.get(bound, 0.0) + count - before.get(bound, 0.0)
        return quantile_of(total, TTFT_QUANTILE)

    # -- pods ---------------------------------------------------------------------------------------------

    def _template(self, role_plan: RolePlan, vllm_events: bool) -> _Template:
        env = {**role_plan.engine_env, **role_plan.env}
        connector = role_plan.kv_connector  # a pod whose connector changes (its tiers, say) is replaced
        flags = (*role_plan.flags, *([json.dumps(connector, sort_keys=True)] if connector is not None else []))
        return _Template(role_plan.role, flags, tuple(sorted(env.items())),
                         role_plan.num_threads, role_plan.resources.num_gpus, vllm_events)  # fmt: skip

    def _start_worker(self, endpoint: EndpointPlan, role_plan: RolePlan, template: _Template) -> Pod:
        is_vllm = endpoint.engine == WorkerEngine.VLLM
        port = free_port(vllm.LOCAL_TRANSFER_OFFSET + 1 if is_vllm else 1)  # HTTP, events, replay, KV receiver
        name = pod_name(role_plan.role.value, endpoint.name)
        env = dict(template.env)
        if self._redis is not None:
            env[envs.REDIS_PASSWORD.name] = self.redis_password
        gpus: tuple[int, ...] = ()
        if template.num_gpus:
            gpus = self._gpus.take(template.num_gpus)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        cpus = self._cpus.take(template.num_threads) if template.num_threads else ()
        if is_vllm:
            connector = role_plan.kv_connector
            path = vllm.connector_pythonpath(self.run_dir) if connector is not None else None
            env |= vllm.local_env(() if gpus else cpus, role_plan.env, self._secret, path)
            own = vllm.instance_args(self.host, port, template.vllm_events, in_pod=False, connector=connector)
            command = (*self._vllm_command, *role_plan.flags, *own)
        else:
            command = splitserve_command("worker", *self._worker_flags(endpoint, role_plan, name, port))
        spec = PodSpec(role_plan.role.value, command, port, tuple(env.items()), cpus)
        pod = self.pods.add(spec, name)
        self._templates[name] = template
        self._gpus_of[name] = gpus
        return pod

    def _worker_flags(self, endpoint: EndpointPlan, role_plan: RolePlan, name: str, port: int) -> list[str]:
        """`splitserve worker`'s flags: the plan's, its address and name, the secret file, the router's events."""
        flags = [*role_plan.flags, "--host", self.host, "--port", str(port), "--worker-id", name,
                 "--advertise-url", f"http://127.0.0.1:{port}",
                 "--cluster-secret-file", str(self.secret_file)]  # fmt: skip
        if endpoint.router.kv_events:
            flags += ["--kv-events-url", f"{self.router_url}/kv/events"]
        return flags

    def _router_base_flags(self, endpoint: EndpointPlan) -> tuple[str, ...]:
        mode = "--disaggregated" if endpoint.is_disaggregated else "--colocated"
        return (*endpoint.router.flags, mode, f"replicas={endpoint.router.replicas}")

    def _restart_router(self, endpoint: EndpointPlan, workers: list[Pod]) -> None:
        """(Re)start the router replicas, and the balancer in front of them when there are several."""
        for pod in [*self._routers, *([self._balancer] if self._balancer is not None else [])]:
            self.pods.remove(pod)
        self._routers, self._balancer = [], None
        replicas = endpoint.router.replicas
        while len(self._admin_ports) < replicas:
            self._admin_ports.append(free_port())
        ports = [self.router_port] if replicas == 1 else [free_port() for _ in range(replicas)]
        for port, admin_port in zip(ports, self._admin_ports, strict=False):
            spec = PodSpec("router", self._router_command(endpoint, workers, port, admin_port), port)
            self._routers.append(self.pods.add(spec, pod_name("router", endpoint.name)))
        if replicas > 1:
            targets = [a for port in ports for a in ("--target", f"127.0.0.1:{port}")]
            command = (sys.executable, "-m", "splitserve.deploy.balancer", "--host", self.host,
                       "--port", str(self.router_port), *targets)  # fmt: skip
            spec = PodSpec("balancer", command, self.router_port, health_path=endpoint.router.health_check_path)
            self._balancer = self.pods.add(spec, pod_name("balancer", endpoint.name))
        self._router_flags = self._router_base_flags(endpoint)

    def _router_command(
        self, endpoint: EndpointPlan, workers: list[Pod], port: int, admin_port: int
    ) -> tuple[str, ...]:
        urls = [f for p in workers for f in (ROLE_URL_FLAG[Role(p.spec.role)], p.spec.url)]
        return splitserve_command(
            "router", *endpoint.router.flags, "--host", self.host, "--port", str(port),
            "--admin-port", str(admin_port), *urls,
            "--cluster-secret-file", str(self.secret_file),
        )  # fmt: skip

    def _publish_workers(self, workers: list[Pod]) -> None:
        """Tell every running router replica its worker lists (its discovery feed)."""
        lists: dict[str, list[str]] = {"backend": [], "prefill": [], "decode": []}
        for pod in workers:
            lists[ROLE_URL_FLAG[Role(pod.spec.role)].removeprefix("--")].append(pod.spec.url)
        assert self.plan is not None and self._routers
        headers = bearer_header(self._secret)
        for router, admin_port in zip(self._routers, self._admin_ports, strict=False):
            # a restarted router starts current
            router.spec.command = self._router_command(self.plan, workers, router.spec.port, admin_port)
            try:
                url = f"http://127.0.0.1:{admin_port}/admin/workers"
                response = httpx.put(url, json=lists, headers=headers, timeout=10, trust_env=False)
                response.raise_for_status()
            except httpx.HTTPError as exc:
                logger.warning("could not update router %s's workers (%s); restarting the routers", router.name, exc)
                self._restart_router(self.plan, workers)
                return

    def _drain(self, pod: Pod, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Wait (bounded) until a worker the router no longer uses has finished its requests."""
        deadline = time.time() + timeout_s
        while time.time() < deadline and _requests_in_worker(pod) > 0:
            time.sleep(0.5)

    def _ensure_redis(self, config: InferenceEndpointConfig) -> str | None:
        if not config.needs_local_redis:
            return None
        if self._redis is None:
            binary = shutil.which("redis-server")
            if binary is None:
                raise RuntimeError("the resource asks for a Redis L2 without a URL, and redis-server is not installed")
            port = free_port()
            command = (binary, str(self._redis_config(port)))
            name = pod_name("redis", config.metadata.name)
            self._redis = self.pods.add(PodSpec("redis", command, port, health_path=None), name)
            self.pods.wait_ready([self._redis], 30)
        return f"redis://127.0.0.1:{self._redis.spec.port}/0"

    def _redis_config(self, port: int) -> Path:
        """The local Redis's configuration file (0600): loopback only, a password, no persistence, and, as an L2
        is a cache, bounded with least recently used chunks evicted (as on Kubernetes). The password stays out
        of argv; workers get it in their environment."""
        path = self.run_dir / "redis.conf"
        lines = [
            f"port {port}", "bind 127.0.0.1", "protected-mode yes", f"requirepass {self.redis_password}", 'save ""',
            "appendonly no", f"maxmemory {REDIS_MAX_MEMORY}", "maxmemory-policy allkeys-lru",
        ]  # fmt: skip
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write("\n".join(lines) + "\n")
        return path

    @property
    def redis_password(self) -> str:
        """The local Redis's password, derived from the cluster secret (so it outlives a restarted supervisor)."""
        return hmac.new(self._secret.encode(), b"splitserve local redis", hashlib.sha256).hexdigest()

    # -- state --------------------------------------------------------------------------------------------

    def write_state(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        state = {
            "endpoint": self.plan.name if self.plan is not None else None,
            "router_url": self.router_url,
            "admin_url": self.admin_url,
            "admin_urls": self.admin_urls,
            "autoscaled": dict(self._scaled),  # role -> replicas, where spec.autoscaling scales it
            "supervisor_pid": os.getpid(),
            "revision": self.revision,
            "condition": {"type": "Ready", "status": self.is_ready,
                          "message": self.ready_message if self.is_ready else "pods are starting"},
            "pods": [p.state() for p in self.pods.pods],
        }  # fmt: skip
        tmp = self.run_dir / "state.json.tmp"
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.run_dir / "state.json")


def _requests_in_worker(pod: Pod) -> float:
    try:
        text = httpx.get(f"{pod.spec.url}/metrics", timeout=2, trust_env=False).text
    except httpx.HTTPError:
        return 0.0
    return sum_samples(text, "vllm:num_requests_running") + sum_samples(text, "vllm:num_requests_waiting")


def _role_spec(config: InferenceEndpointConfig, role: str) -> RoleSpec:
    assert config.spec.pd_spec is not None
    return config.spec.pd_spec.prefill_spec if role == "prefill" else config.spec.pd_spec.decoding_spec


def _cluster_secret(path: Path) -> str:
    """The endpoint's cluster secret: read from ``path``, or made and written there (0600) the first time.

    The router and the workers read it from that file (``--cluster-secret-file``), never from argv.
    """
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.exists():
        return path.read_text(encoding="utf-8").strip()
    secret = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(secret + "\n")
    return secret


def _num_gpus() -> int:
    """GPUs this process may use (from ``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi -L``); 0 without any."""
    visible = envs.raw(envs.CUDA_VISIBLE_DEVICES)  # set but empty: no GPU
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    if shutil.which("nvidia-smi") is None:
        return 0
    import subprocess

    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in listing.splitlines())

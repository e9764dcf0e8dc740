"""Candidate layouts for a resource, their ranking, the pick written back into a copy of the resource, and the
report (table and JSON). Torch-free: it takes a :class:`~splitserve.planner.costs.Calibration` already made.

**Candidates.** The cores a resource allows are what its workers ask for (each role's replicas times its CPU
limit, else its request), or this machine's CPUs when no role says. Every layout splits them evenly between
its workers (``cores // workers`` engine threads each), for 1 to ``MAX_WORKERS`` workers:

- ``colocated`` with N replicas;
- ``xPyD`` (``1P1D``, ``2P1D``, ...) for every split of the workers, with each ``routingThreshold`` asked for;
- each routing strategy asked for, where a pool has more than one worker (with one worker per pool they all
  route alike, and only the resource's own strategy is kept).

The resource as written is a candidate too (``is_current``), with its own threads, replicas and threshold.
Each worker keeps its role's engine flags from the resource (``max-num-seqs``, ``max-num-batched-tokens``,
``block-size``, ``kv-cache-memory``, L1/L2 sizes); a role the resource lacks takes ``spec.worker.args``.

**Ranking.** Goodput (requests/s meeting the SLO) first, then TTFT p99, then fewer workers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import yaml

from splitserve.config import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    CacheConfig,
    KVTierConfig,
    Role,
    RoutingStrategy,
    parse_bytes,
)
from splitserve.deploy.plan import plan
from splitserve.endpoint import (
    Flag,
    InferenceEndpointConfig,
    ResourceRequirements,
    last_flag,
    merge_flags,
    parse_args,
    parse_endpoint,
    parse_memory_bytes,
)
from splitserve.planner.costs import Calibration
from splitserve.planner.options import DEFAULT_THRESHOLDS
from splitserve.planner.simulate import (
    EngineLimits,
    KVMoves,
    Prediction,
    SimulatedWorker,
    Slo,
    Topology,
    simulate,
    summarize,
)
from splitserve.planner.workload import TraceRequest

T = TypeVar("T")
MAX_WORKERS = 8
L2_DEFAULT_BYTES = KVTierConfig().l2_max_bytes
PLANNED_ANNOTATION = "splitserve.io/planned"


@dataclass(frozen=True, slots=True)
class Layout:
    """One candidate: how many workers of each role, their threads, the threshold and the strategy."""

    num_colocated: int
    num_prefill: int
    num_decode: int
    num_threads: int  # per worker
    routing_threshold: int | None
    strategy: RoutingStrategy
    is_current: bool = False  # the resource as written

    @property
    def name(self) -> str:
        """``colocated`` or ``xPyD``."""
        return "colocated" if self.num_colocated else f"{self.num_prefill}P{self.num_decode}D"

    @property
    def num_workers(self) -> int:
        return self.num_colocated + self.num_prefill + self.num_decode

    def describe(self) -> str:
        """``colocated x2, 1 thread each, prefixaware`` / ``1P1D, threshold 2048, 1 thread each, roundrobin``."""
        shape = f"colocated x{self.num_colocated}"
        if not self.num_colocated:
            shape = f"{self.name}, threshold {self.routing_threshold}"
        threads = f"{self.num_threads} thread{'s' if self.num_threads > 1 else ''} each"
        return f"{shape}, {threads}, {self.strategy.value}"

    def to_json(self) -> dict[str, Any]:
        return {
            "layout": self.name,
            "replicas": {"colocated": self.num_colocated, "prefill": self.num_prefill, "decode": self.num_decode},
            "threads_per_worker": self.num_threads,
            "routing_threshold": self.routing_threshold,
            "strategy": self.strategy.value,
            "is_current": self.is_current,
        }


@dataclass(frozen=True, slots=True)
class Candidate:
    layout: Layout
    prediction: Prediction

    def sort_key(self) -> tuple[float, float, int]:
        return (-self.prediction.goodput_requests_per_s, self.prediction.ttft_p99_s, self.layout.num_workers)


@dataclass(frozen=True, slots=True)
class Recommendation:
    candidates: tuple[Candidate, ...]  # ranked, best first
    reason: str

    @property
    def pick(self) -> Candidate:
        return self.candidates[0]

    @property
    def current(self) -> Candidate | None:
        return next((c for c in self.candidates if c.layout.is_current), None)


# ---------------------------------------------------------------------------------------------- the resource


def allowed_cores(config: InferenceEndpointConfig) -> int:
    """Cores the resource's workers ask for (replicas x CPU limit, else request), else this machine's CPUs."""
    endpoint = plan(config)
    total = 0.0
    for role in endpoint.roles:
        resources = role.resources
        cpu = resources.cpu_limit if resources.cpu_limit is not None else resources.cpu_request
        if cpu is None:
            return _machine_cores()
        total += role.replicas * cpu
    return max(1, int(total + 1e-9))


def _machine_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def thread_counts(cores: int, max_workers: int = MAX_WORKERS) -> list[int]:
    """The per-worker thread counts the candidates for ``cores`` use (what the calibration must scale to)."""
    return sorted({max(1, cores // n) for n in range(1, min(cores, max_workers) + 1)})


def current_layout(config: InferenceEndpointConfig, cores: int) -> Layout:
    """The resource as written (threads: its roles' ``--num-threads`` or CPU share; the fewest of them)."""
    endpoint = plan(config)
    threads = min((r.num_threads or cores for r in endpoint.roles), default=1)
    if not config.is_disaggregated:
        return Layout(config.spec.replicas, 0, 0, threads, None, config.routing_strategy, is_current=True)
    prefill, decode = endpoint.role(Role.PREFILL), endpoint.role(Role.DECODE)
    threshold = endpoint.router.routing_threshold
    return Layout(0, prefill.replicas, decode.replicas, threads, threshold, config.routing_strategy, is_current=True)


def enumerate_layouts(
    cores: int,
    thresholds: Sequence[int],
    strategies: Sequence[RoutingStrategy],
    default_strategy: RoutingStrategy,
    max_workers: int = MAX_WORKERS,
) -> list[Layout]:
    """Every candidate layout for ``cores`` (see the module docstring), without the current one."""
    layouts: list[Layout] = []
    for n in range(1, min(cores, max_workers) + 1):
        threads = max(1, cores // n)
        for strategy in strategies if n > 1 else [default_strategy]:
            layouts.append(Layout(n, 0, 0, threads, None, strategy))
        for num_prefill in range(1, n):
            num_decode = n - num_prefill
            pooled = num_prefill > 1 or num_decode > 1
            for strategy in strategies if pooled else [default_strategy]:
                layouts += [Layout(0, num_prefill, num_decode, threads, t, strategy) for t in thresholds]
    return layouts


def _role_flags(config: InferenceEndpointConfig, role: Role) -> list[Flag]:
    """The engine flags a worker of ``role`` gets: worker.args, merged under the role's args when it has some."""
    base = parse_args(config.spec.worker.args, "spec.worker.args")
    pd = config.spec.pd_spec
    if pd is None or role == Role.COLOCATED:
        return base
    role_spec = pd.prefill_spec if role == Role.PREFILL else pd.decoding_spec
    return merge_flags(base, parse_args(role_spec.args, "role"))


def engine_limits(config: InferenceEndpointConfig, role: Role, kv_bytes_per_token: int) -> EngineLimits:
    """The scheduler and cache settings of a ``role`` worker, from the resource's flags and cache spec."""
    flags = _role_flags(config, role)

    caching = last_flag(flags, "enable-prefix-caching")
    kv_memory = last_flag(flags, "kv-cache-memory")
    kv_bytes = _kv_cache_bytes(kv_memory.value if kv_memory is not None else None)
    cache_tokens = 0 if caching is not None and caching.name.startswith("no-") else kv_bytes // kv_bytes_per_token
    kv = config.spec.kv_cache_spec
    l1_bytes = _flag_bytes(flags, "l1-cache-bytes", KVTierConfig().l1_cache_bytes)
    defaults = EngineLimits()
    return EngineLimits(
        max_num_seqs=_flag_value(flags, "max-num-seqs", int, defaults.max_num_seqs),
        max_num_batched_tokens=_flag_value(flags, "max-num-batched-tokens", int, defaults.max_num_batched_tokens),
        block_size=_flag_value(flags, "block-size", int, defaults.block_size),
        step_time_target_s=_flag_value(flags, "step-time-target", float, defaults.step_time_target_s),
        max_wait_s=_flag_value(flags, "scheduling-max-wait", float, defaults.max_wait_s),
        cache_tokens=cache_tokens,
        l1_tokens=l1_bytes // kv_bytes_per_token if kv is not None and kv.enable_l1_cache else 0,
    )


def _kv_cache_bytes(text: str | None) -> int:
    """``--kv-cache-memory`` in bytes; a fraction of free memory (or none) counts as the CPU default, 2 GiB."""
    _, num_bytes = CacheConfig(kv_cache_memory=text).kv_cache_fraction_or_bytes()
    return DEFAULT_CPU_KV_CACHE_BYTES if num_bytes is None else num_bytes


def _flag_value(flags: Sequence[Flag], name: str, convert: Callable[[str], T], default: T) -> T:
    """The last ``--name``'s value, converted, or ``default`` where the flags have none."""
    flag = last_flag(flags, name)
    return convert(flag.value) if flag is not None and flag.value is not None else default


def _flag_bytes(flags: Sequence[Flag], name: str, default: int) -> int:
    return _flag_value(flags, name, parse_bytes, default)


def l2_tokens(config: InferenceEndpointConfig, kv_bytes_per_token: int) -> int:
    """The shared L2's capacity in tokens (its ``--l2-max-bytes``, 10 GiB by default; Redis alike); 0 without."""
    if config.l2_backend.value == "none":
        return 0
    flags = parse_args(config.spec.worker.args, "spec.worker.args")
    return _flag_bytes(flags, "l2-max-bytes", L2_DEFAULT_BYTES) // kv_bytes_per_token


def topology(config: InferenceEndpointConfig, layout: Layout, calibration: Calibration) -> Topology:
    cost = calibration.step_cost(layout.num_threads)
    per_token = calibration.kv_bytes_per_token
    workers: list[SimulatedWorker] = []
    for role, count in ((Role.COLOCATED, layout.num_colocated), (Role.PREFILL, layout.num_prefill),
                        (Role.DECODE, layout.num_decode)):  # fmt: skip
        limits = engine_limits(config, role, per_token)
        workers += [SimulatedWorker(role, cost, limits)] * count
    return Topology(tuple(workers), layout.strategy, layout.routing_threshold, l2_tokens(config, per_token))


def kv_moves(calibration: Calibration) -> KVMoves:
    transfer = calibration.transfer
    return KVMoves(calibration.kv_bytes_per_token, transfer.base_s, transfer.bytes_per_s, calibration.loads)


# ---------------------------------------------------------------------------------------------- recommending


def recommend(
    config: InferenceEndpointConfig,
    calibration: Calibration,
    requests: Sequence[TraceRequest],
    slo: Slo,
    *,
    cores: int | None = None,
    thresholds: Sequence[int] = DEFAULT_THRESHOLDS,
    strategies: Sequence[RoutingStrategy] = tuple(RoutingStrategy),
) -> Recommendation:
    """Simulate every candidate on ``requests`` and rank them (see the module docstring)."""
    cores = cores or allowed_cores(config)
    current = current_layout(config, cores)
    layouts = [current] + [
        layout
        for layout in enumerate_layouts(cores, thresholds, strategies, config.routing_strategy)
        if replace(layout, is_current=True) != current
    ]
    moves = kv_moves(calibration)
    candidates = [
        Candidate(layout, summarize(simulate(requests, topology(config, layout, calibration), moves), slo))
        for layout in layouts
    ]
    ranked = tuple(sorted(candidates, key=Candidate.sort_key))
    return Recommendation(ranked, reason(ranked))


def reason(ranked: Sequence[Candidate]) -> str:
    """One line: why the pick, against the best layout of the other kind (and the current one)."""
    pick = ranked[0]
    other = next((c for c in ranked if (c.layout.num_colocated > 0) != (pick.layout.num_colocated > 0)), None)
    p = pick.prediction
    text = f"{pick.layout.describe()}: {_rate(p)} meet the SLO"
    if other is not None:
        o = other.prediction
        kind = "disaggregated" if other.layout.num_colocated == 0 else "colocated"
        text += f", against {_rate(o)} for the best {kind} layout ({other.layout.describe()})"
        text += f"; TTFT p99 {_seconds(p.ttft_p99_s)} against {_seconds(o.ttft_p99_s)}"
    current = next((c for c in ranked if c.layout.is_current), None)
    if current is pick:
        text += "; the resource as written is already the pick"
    elif current is not None:
        text += f"; the resource as written: {_rate(current.prediction)}"
    return text


def _rate(prediction: Prediction) -> str:
    return f"{prediction.goodput_requests_per_s:.2f} req/s ({prediction.slo_attainment:.0%})"


def _seconds(value_s: float) -> str:
    return f"{value_s * 1000:.0f} ms" if value_s < 1 else f"{value_s:.2f} s"


def format_table(recommendation: Recommendation, limit: int = 20) -> str:
    """The ranked candidates as a text table, best first; the pick and the current layout are marked."""
    header = ("#", "layout", "thr", "threads", "strategy", "goodput", "SLO", "TTFT p50", "TTFT p99", "ITL p50",
              "ITL p99", "tok/s", "")  # fmt: skip
    rows = [header]
    for i, c in enumerate(recommendation.candidates[:limit], start=1):
        p, layout = c.prediction, c.layout
        shape = f"colocated x{layout.num_colocated}" if layout.num_colocated else layout.name
        mark = ", ".join(m for m, on in (("pick", i == 1), ("current", layout.is_current)) if on)
        rows.append((
            str(i), shape, str(layout.routing_threshold or "-"), str(layout.num_threads), layout.strategy.value,
            f"{p.goodput_requests_per_s:.2f}", f"{p.slo_attainment:.0%}", _seconds(p.ttft_p50_s),
            _seconds(p.ttft_p99_s), _seconds(p.itl_p50_s), _seconds(p.itl_p99_s), f"{p.output_tokens_per_s:.0f}", mark,
        ))  # fmt: skip
    hidden = len(recommendation.candidates) - limit
    widths = [max(len(row[j]) for row in rows) for j in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    if hidden > 0:
        lines.append(f"... {hidden} more in --json")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- writing it down


def planned_manifest(config: InferenceEndpointConfig, layout: Layout, note: str = "") -> dict[str, Any]:
    """A copy of the resource with ``layout``: replicas and per-role resources (or no pdSpec), threshold and
    strategy. Memory stays as the resource asks; the CPU of every worker becomes its thread count. Raises
    EndpointError when the result would not load or plan."""
    manifest = config.to_manifest()
    spec = manifest["spec"]
    resources = _resources(config, layout.num_threads)
    if layout.num_colocated:
        spec.pop("pdSpec", None)
        spec["replicas"] = layout.num_colocated
        spec.setdefault("worker", {})["resources"] = resources
    else:
        spec.pop("replicas", None)
        spec.get("worker", {}).pop("resources", None)  # it does not apply to PD pods
        pd = spec.setdefault("pdSpec", {})
        for field_name, count in (("prefillSpec", layout.num_prefill), ("decodingSpec", layout.num_decode)):
            pd.setdefault(field_name, {}).update({"replicas": count, "resources": resources})
        pd["routingThreshold"] = layout.routing_threshold
    spec["intelligentRoutingSpec"] = {"enabled": True, "routingStrategy": layout.strategy.value}
    if "autoscaling" in spec:
        scaled = planned_autoscaling(spec["autoscaling"], layout)
        if scaled is None:
            del spec["autoscaling"]
        else:
            spec["autoscaling"] = scaled
    if note:
        manifest["metadata"].setdefault("annotations", {})[PLANNED_ANNOTATION] = note
    checked = parse_endpoint(manifest, "the planned resource")
    plan(checked)
    return manifest


def planned_autoscaling(autoscaling: dict[str, Any], layout: Layout) -> dict[str, Any] | None:
    """The resource's ``spec.autoscaling`` (as written) for ``layout``: the roles it scales, their targets carried
    over from the role that had them (a colocated pool's requests in flight become the decode pool's, and back),
    and a disaggregated pick's P:D ratio seeding the prefill pool's ``decodeRatio``, so that prefill follows decode
    in the proportion the planner found. The pick's counts start the pools (their ``replicas``); each pool's upper
    bound grows to hold them. None where no role is left with a target to scale by."""
    old = {role: dict(autoscaling.get(role) or {}) for role in ("colocated", "prefill", "decode")}

    def carried(key: str, *roles: str) -> Any:
        return next((old[r][key] for r in roles if old[r].get(key) is not None), None)

    kept = {k: v for k, v in autoscaling.items() if k not in old}  # intervalSeconds, the stabilization window
    if layout.num_colocated:
        targets = {"targetConcurrency": carried("targetConcurrency", "colocated", "decode"),
                   "targetTtftSeconds": carried("targetTtftSeconds", "colocated", "prefill")}  # fmt: skip
        if all(v is None for v in targets.values()):
            return None
        most = old["colocated"].get("maxReplicas") or old["decode"].get("maxReplicas", 0) + old["prefill"].get(
            "maxReplicas", 0
        )
        colocated = {"minReplicas": carried("minReplicas", "colocated", "decode") or 1,
                     "maxReplicas": max(layout.num_colocated, most)}  # fmt: skip
        return {**kept, "colocated": colocated | {k: v for k, v in targets.items() if v is not None}}
    concurrency = carried("targetConcurrency", "decode", "colocated")
    if concurrency is None:
        return None
    ratio = layout.num_prefill / layout.num_decode
    decode_max = max(layout.num_decode, carried("maxReplicas", "decode", "colocated") or 0)
    decode = {"minReplicas": carried("minReplicas", "decode", "colocated") or 1, "maxReplicas": decode_max,
              "targetConcurrency": concurrency}  # fmt: skip
    prefill_max = max(layout.num_prefill, math.ceil(decode_max * ratio - 1e-9))
    prefill = {"minReplicas": min(old["prefill"].get("minReplicas", 1), prefill_max), "maxReplicas": prefill_max,
               "decodeRatio": round(ratio, 4)}  # fmt: skip
    return {**kept, "decode": decode, "prefill": prefill}


def _resources(config: InferenceEndpointConfig, num_threads: int) -> dict[str, Any]:
    """Requests and limits with ``cpu`` set to the threads, and the most memory any role of the resource asks."""
    blocks = [config.spec.worker.resources]
    if config.spec.pd_spec is not None:
        pd = config.spec.pd_spec
        blocks += [r for r in (pd.prefill_spec.resources, pd.decoding_spec.resources) if r is not None]
    result: dict[str, dict[str, str]] = {"requests": {"cpu": str(num_threads)}, "limits": {"cpu": str(num_threads)}}
    for kind in ("requests", "limits"):
        memory = _most_memory(blocks, kind)
        if memory is not None:
            result[kind]["memory"] = memory
    return result


def _most_memory(blocks: Sequence[ResourceRequirements], kind: str) -> str | None:
    values = [getattr(b, kind)["memory"] for b in blocks if "memory" in getattr(b, kind)]
    if not values:
        return None
    return max(values, key=parse_memory_bytes)


def write_planned(path: str, config: InferenceEndpointConfig, layout: Layout, note: str = "") -> None:
    """Write :func:`planned_manifest` as YAML (the resource's comments are not kept)."""
    text = yaml.safe_dump(planned_manifest(config, layout, note), sort_keys=False, width=120)
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"# written by splitserve plan: {layout.describe()}\n{text}")


def prediction_json(prediction: Prediction) -> dict[str, Any]:
    return {
        "num_requests": prediction.num_requests,
        "duration_s": round(prediction.duration_s, 4),
        "ttft_p50_s": round(prediction.ttft_p50_s, 5),
        "ttft_p99_s": round(prediction.ttft_p99_s, 5),
        "itl_p50_s": round(prediction.itl_p50_s, 5),
        "itl_p99_s": round(prediction.itl_p99_s, 5),
        "output_tokens_per_s": round(prediction.output_tokens_per_s, 3),
        "requests_per_s": round(prediction.requests_per_s, 4),
        "goodput_requests_per_s": round(prediction.goodput_requests_per_s, 4),
        "slo_attainment": round(prediction.slo_attainment, 4),
        "utilization": {k: round(v, 4) for k, v in prediction.utilization.items()},
    }


def report_json(
    recommendation: Recommendation, calibration: Calibration, workload: dict[str, Any], slo: Slo
) -> dict[str, Any]:
    """The ``--json`` document: ``candidates`` (ranked), ``pick``, ``reason``, ``workload``, ``slo`` and
    ``calibration``."""
    candidates = [{**c.layout.to_json(), "predicted": prediction_json(c.prediction)} for c in recommendation.candidates]
    return {
        "candidates": candidates,
        "pick": candidates[0],
        "reason": recommendation.reason,
        "workload": workload,
        "slo": {"ttft_p99_s": slo.ttft_s, "itl_p99_s": slo.itl_s},
        "calibration": calibration.to_json(),
    }

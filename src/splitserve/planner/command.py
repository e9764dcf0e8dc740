"""``splitserve plan``: load the resource, calibrate (or take the cached calibration), build the workload,
recommend, and write the table, ``--out`` and ``--json``.

The one planner module that reaches the engine (through ``calibrate``, which imports it only when it measures).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import EnumMeta
from pathlib import Path
from typing import Any, TypeVar

from splitserve.config import RoutingStrategy
from splitserve.deploy.plan import plan
from splitserve.endpoint import load_endpoint
from splitserve.planner.calibrate import calibration_key, ensure_calibration
from splitserve.planner.recommend import (
    DEFAULT_THRESHOLDS,
    allowed_cores,
    current_layout,
    format_table,
    recommend,
    report_json,
    thread_counts,
    write_planned,
)
from splitserve.planner.simulate import Slo
from splitserve.planner.workload import DEFAULT_RATES, WorkloadShape, describe, generate, load_trace

T = TypeVar("T")
DEFAULT_MAX_MODEL_LEN = 8192
# Per workload, what a user of a small model on a CPU would still accept; say --slo for your own.
DEFAULT_SLOS: dict[WorkloadShape | None, Slo] = {
    WorkloadShape.CHAT: Slo(ttft_s=2.0, itl_s=0.2),
    WorkloadShape.RAG: Slo(ttft_s=5.0, itl_s=0.2),
    WorkloadShape.MIXED: Slo(ttft_s=5.0, itl_s=0.2),
    WorkloadShape.LONG_CONTEXT: Slo(ttft_s=15.0, itl_s=0.3),
    None: Slo(ttft_s=5.0, itl_s=0.2),  # a trace
}


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """The command's options, as given (validated by :func:`run_plan`)."""

    file: Path
    workload: WorkloadShape = WorkloadShape.CHAT
    trace: Path | None = None
    rate: float | None = None
    num_requests: int = 400
    seed: int = 0
    slo: str | None = None
    out: Path | None = None
    json_path: Path | None = None
    recalibrate: bool = False
    thresholds: tuple[int, ...] = DEFAULT_THRESHOLDS
    strategies: tuple[RoutingStrategy, ...] = tuple(RoutingStrategy)


_DURATION = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*")


def parse_duration_s(text: str) -> float:
    """``"2s"``, ``"150ms"``, ``"0.5"`` (seconds) -> seconds; ValueError otherwise."""
    m = _DURATION.fullmatch(text)
    if m is None:
        raise ValueError(f"{text!r} is not a duration (examples: 2s, 150ms, 0.5)")
    value = float(m.group(1))
    return value / 1000 if m.group(2) == "ms" else value


def parse_slo(text: str, default: Slo) -> Slo:
    """``ttft_p99=2s,itl_p99=150ms`` (either part may be left out: ``default``'s then) -> an Slo."""
    values = {"ttft_p99": default.ttft_s, "itl_p99": default.itl_s}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        if not eq or name.strip() not in values:
            raise ValueError(f"--slo: {part!r}: expected ttft_p99=DURATION or itl_p99=DURATION (e.g. 2s, 150ms)")
        values[name.strip()] = parse_duration_s(value)
    if min(values.values()) <= 0:
        raise ValueError(f"--slo: durations must be positive, got {text!r}")
    return Slo(values["ttft_p99"], values["itl_p99"])


def parse_choices(flag: str, text: str, parse: Callable[[str], T]) -> tuple[T, ...]:
    """A comma-separated option -> its values (at least one); ValueError naming the flag, and for a closed set
    (an enum) the values it takes."""
    values: list[T] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            values.append(parse(part))
        except ValueError:
            members: list[object] = list(parse) if isinstance(parse, EnumMeta) else []
            allowed = f"; one of {', '.join(str(m) for m in members)}" if members else ""
            raise ValueError(f"{flag}: {part!r} is not valid{allowed}") from None
    if not values:
        raise ValueError(f"{flag}: give at least one value")
    return tuple(values)


def _flag(flags: Sequence[str], name: str) -> str | None:
    positions = [i for i, token in enumerate(flags[:-1]) if token == name]
    return flags[positions[-1] + 1] if positions else None


def run_plan(options: PlanOptions, echo: Callable[[str], None], note: Callable[[str], None]) -> int:
    """Run the command: ``echo`` prints results, ``note`` progress (stderr). Raises ValueError (bad options or
    trace) and EndpointError (a resource that does not load or plan); returns the exit status."""
    if options.num_requests < 1:
        raise ValueError(f"--num-requests must be positive, got {options.num_requests}")
    config = load_endpoint(options.file)
    endpoint = plan(config)
    flags = endpoint.roles[0].flags
    max_model_len = int(_flag(flags, "--max-model-len") or DEFAULT_MAX_MODEL_LEN)
    shape = None if options.trace is not None else options.workload
    slo = parse_slo(options.slo or "", DEFAULT_SLOS[shape])
    requests = (
        load_trace(options.trace)
        if options.trace is not None
        else generate(options.workload, rate=options.rate, num_requests=options.num_requests, seed=options.seed,
                      max_model_len=max_model_len)
    )  # fmt: skip
    cores = allowed_cores(config)
    threads = {*thread_counts(cores), current_layout(config, cores).num_threads}
    key = calibration_key(endpoint.model, _flag(flags, "--dtype") or "auto", _flag(flags, "--quantization") or "auto")
    calibration = ensure_calibration(
        key, sorted(threads), recalibrate=options.recalibrate, max_model_len=max_model_len,
        progress=lambda what: note(f"calibrating: {what}"),
    )  # fmt: skip
    note(f"workload: {describe(requests)}; SLO: TTFT p99 {slo.ttft_s:g} s, ITL p99 {slo.itl_s * 1000:g} ms")
    result = recommend(
        config, calibration, requests, slo, cores=cores, thresholds=options.thresholds, strategies=options.strategies
    )
    echo(format_table(result))
    echo(f"\npick: {result.pick.layout.describe()}\nwhy: {result.reason}")
    if options.out is not None:
        write_planned(str(options.out), config, result.pick.layout, note=result.reason)
        echo(f"wrote {options.out}")
    if options.json_path is not None:
        document = report_json(result, calibration, _workload_json(options, requests, shape), slo)
        options.json_path.write_text(json.dumps(document, indent=1) + "\n")
        echo(f"wrote {options.json_path}")
    return 0


def _workload_json(options: PlanOptions, requests: Sequence[Any], shape: WorkloadShape | None) -> dict[str, Any]:
    if shape is None:
        return {"trace": str(options.trace), "description": describe(requests)}
    rate = options.rate if options.rate is not None else DEFAULT_RATES[shape]
    return {"shape": shape.value, "rate": rate, "num_requests": len(requests), "seed": options.seed,
            "description": describe(requests)}  # fmt: skip

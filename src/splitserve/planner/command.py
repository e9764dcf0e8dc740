"""``splitserve plan``: load the resource, calibrate (or take the cached calibration), build the workload,
recommend, and write the table, ``--out`` and ``--json``.

The one planner module that reaches the engine (through ``calibrate``, which imports it only when it measures).
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from splitserve.bench.sweep import parse_slo
from splitserve.deploy.plan import plan
from splitserve.endpoint import InferenceEndpointConfig, WorkerEngine, load_endpoint
from splitserve.planner.calibrate import calibration_key, ensure_calibration
from splitserve.planner.costs import Calibration
from splitserve.planner.options import PlanOptions
from splitserve.planner.plots import plot_crossover, plot_plan
from splitserve.planner.recommend import (
    Candidate,
    Layout,
    Recommendation,
    allowed_cores,
    current_layout,
    format_table,
    kv_moves,
    recommend,
    report_json,
    thread_counts,
    topology,
    write_planned,
)
from splitserve.planner.simulate import Prediction, SimResult, Slo, simulate, summarize
from splitserve.planner.verify import (
    FIGURES,
    STARTUP_ALLOWANCE_S,
    ReplayWorkload,
    VerifiedLayout,
    fitting_requests,
    format_verify_table,
    replay_workload,
    verify_json,
    verify_layout,
)
from splitserve.planner.workload import (
    DEFAULT_RATES,
    TraceRequest,
    WorkloadShape,
    describe,
    generate,
    load_trace,
    with_prompt_tokens,
)

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


def _flag(flags: Sequence[str], name: str) -> str | None:
    positions = [i for i, token in enumerate(flags[:-1]) if token == name]
    return flags[positions[-1] + 1] if positions else None


def run_plan(options: PlanOptions, echo: Callable[[str], None], note: Callable[[str], None]) -> int:
    """Run the command: ``echo`` prints results, ``note`` progress (stderr). Raises ValueError (bad options or
    trace) and EndpointError (a resource that does not load or plan); returns the exit status."""
    sweeping = _checked_sweep(options)
    return _run_plan(options, load_endpoint(options.file), sweeping, echo, note)


def _checked_sweep(options: PlanOptions) -> bool:
    """Whether the options sweep rates or prompt lengths; ValueError for options that do not go together."""
    if options.num_requests < 1:
        raise ValueError(f"--num-requests must be positive, got {options.num_requests}")
    sweeping = bool(options.sweep_rates or options.sweep_prompt_tokens)
    if options.sweep_rates and options.sweep_prompt_tokens:
        raise ValueError("give --sweep-rates or --sweep-prompt-tokens, not both")
    if sweeping and (options.trace is not None or options.verify or options.out is not None):
        raise ValueError("--sweep-rates and --sweep-prompt-tokens predict a generated workload at several points: "
                         "they take no --trace, --verify or --out")  # fmt: skip
    if any(not x > 0 for x in (*options.sweep_rates, *options.sweep_prompt_tokens)):
        raise ValueError("swept rates and prompt lengths must be positive")
    return sweeping


def _run_plan(options: PlanOptions, config: InferenceEndpointConfig, sweeping: bool, echo: Callable[[str], None],
              note: Callable[[str], None]) -> int:  # fmt: skip
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
    replayed: ReplayWorkload | None = None
    if options.verify:
        replayed = replay_workload(requests)
        note(
            f"verify: the replay's prompts share {replayed.num_shared_tokens:,} prefix tokens where the workload says "
            f"{sum(r.prefix_tokens for r in requests):,} (an engine holds its own answers, not the workload's); "
            "the prediction is for the replayed workload"
        )
        requests = list(replayed.requests)
    cores = allowed_cores(config)
    threads = {*thread_counts(cores), current_layout(config, cores).num_threads}
    is_vllm = endpoint.engine == WorkerEngine.VLLM
    key = calibration_key(endpoint.model, _flag(flags, "--dtype") or "auto",
                          "auto" if is_vllm else _flag(flags, "--quantization") or "auto",
                          endpoint.engine.value)  # fmt: skip
    calibration = ensure_calibration(
        key, sorted(threads), recalibrate=options.recalibrate, max_model_len=max_model_len,
        progress=lambda what: note(f"calibrating: {what}"), vllm_flags=flags if is_vllm else (),
    )  # fmt: skip
    if sweeping:
        return _sweep(options, config, calibration, slo, cores, max_model_len, echo, note)
    note(f"workload: {describe(requests)}; SLO: TTFT p99 {slo.ttft_s:g} s, ITL p99 {slo.itl_s * 1000:g} ms")
    result = recommend(
        config, calibration, requests, slo, cores=cores, thresholds=options.thresholds, strategies=options.strategies
    )
    echo(format_table(result))
    echo(f"\npick: {result.pick.layout.describe()}\nwhy: {result.reason}")
    _write_outputs(options, config, endpoint.model, result, calibration, requests, replayed, slo, shape, echo, note)
    return 0


def _write_outputs(
    options: PlanOptions, config: InferenceEndpointConfig, model: str, result: Any, calibration: Calibration,
    requests: Sequence[Any], replayed: ReplayWorkload | None, slo: Slo, shape: WorkloadShape | None,
    echo: Callable[[str], None], note: Callable[[str], None],
) -> None:  # fmt: skip
    """What the options ask for beside the table: the resource with the pick, the verification, plot and JSON."""
    if options.out is not None:
        write_planned(str(options.out), config, result.pick.layout, note=result.reason)
        echo(f"wrote {options.out}")
    verified = [] if replayed is None else _verify(options, config, model, result, calibration, replayed, slo, note)
    if verified:
        echo("\n" + format_verify_table(verified))
        echo(_verdict(verified))
    if options.plot is not None:
        plot_plan(
            options.plot,
            result,
            verified,
            simulate_layout=lambda layout: _simulated(config, calibration, layout, requests),
        )
        echo(f"wrote {options.plot}")
    if options.json_path is not None:
        document = report_json(result, calibration, _workload_json(options, requests, shape), slo)
        if verified:
            document["verify"] = verify_json(verified)
        options.json_path.write_text(json.dumps(document, indent=1) + "\n")
        echo(f"wrote {options.json_path}")


def _sweep(
    options: PlanOptions,
    config: InferenceEndpointConfig,
    calibration: Calibration,
    slo: Slo,
    cores: int,
    max_model_len: int,
    echo: Callable[[str], None],
    note: Callable[[str], None],
) -> int:
    """Predict the workload at each rate (or prompt length); per layout family the best candidate; the crossover
    in one line."""
    by_rate = bool(options.sweep_rates)
    xs: list[float] = sorted(options.sweep_rates or options.sweep_prompt_tokens)
    rows: list[dict[str, Any]] = []
    for x in xs:
        rate = x if by_rate else options.rate
        requests = generate(options.workload, rate=rate, num_requests=options.num_requests, seed=options.seed,
                            max_model_len=max_model_len)  # fmt: skip
        if not by_rate:
            requests = with_prompt_tokens(requests, int(x), max_model_len)
        note(f"sweep: {describe(requests)}")
        result = recommend(config, calibration, requests, slo, cores=cores, thresholds=options.thresholds,
                           strategies=options.strategies)  # fmt: skip
        best: dict[str, Candidate] = {}
        for candidate in result.candidates:  # ranked: the first of a family is its best
            best.setdefault(_family(candidate.layout), candidate)
        rows.append({"x": x, "pick": result.pick, "best": best})
    families = sorted({name for row in rows for name in row["best"]}, key=_family_order)
    axis = "rate" if by_rate else "prompt_tokens"
    echo(_sweep_table(axis, rows, families))
    crossover = _crossover(options.workload, rows, by_rate)
    echo(f"\n{crossover}")
    series = {name: [_point(row["best"].get(name)) for row in rows] for name in families}
    if options.plot is not None:
        limits = f"TTFT p99 {slo.ttft_s:g} s, ITL p99 {slo.itl_s * 1000:g} ms"
        rate = options.rate if options.rate is not None else DEFAULT_RATES[options.workload]
        fixed = "" if by_rate else f" at {rate:g} req/s"
        title = f"{options.workload.value}{fixed}: predicted per layout (SLO {limits})"
        xlabel = "request rate (req/s)" if by_rate else "prompt tokens (every prompt)"
        plot_crossover(options.plot, title, xs, series, xlabel=xlabel, diagonal=by_rate)
        echo(f"wrote {options.plot}")
    if options.json_path is not None:
        document = {
            "workload": {"shape": options.workload.value, "num_requests": options.num_requests, "seed": options.seed},
            "slo": {"ttft_p99_s": slo.ttft_s, "itl_p99_s": slo.itl_s},
            "axis": axis,
            axis: xs,
            "families": series,
            "picks": [{axis: row["x"], **row["pick"].layout.to_json()} for row in rows],
            "crossover": crossover,
            "calibration": calibration.to_json(),
        }
        options.json_path.write_text(json.dumps(document, indent=1) + "\n")
        echo(f"wrote {options.json_path}")
    return 0


def _family(layout: Layout) -> str:
    """``colocated x2`` or ``1P1D``: the layouts a sweep compares, whatever their threshold and strategy."""
    return f"colocated x{layout.num_colocated}" if layout.num_colocated else layout.name


def _family_order(name: str) -> tuple[int, str]:
    return (0 if name.startswith("colocated") else 1, name)


def _point(candidate: Candidate | None) -> dict[str, float]:
    if candidate is None:
        return {"goodput": math.nan, "ttft_p99_s": math.nan, "itl_p99_s": math.nan}
    p = candidate.prediction
    return {"goodput": round(p.goodput_requests_per_s, 4), "ttft_p99_s": round(p.ttft_p99_s, 4),
            "itl_p99_s": round(p.itl_p99_s, 5)}  # fmt: skip


def _sweep_table(axis: str, rows: Sequence[dict[str, Any]], families: Sequence[str]) -> str:
    header = [axis, *(f"{name} goodput / TTFT p99" for name in families), "pick"]
    lines = [" | ".join(header)]
    for row in rows:
        cells = [f"{row['x']:g}"]
        for name in families:
            c = row["best"].get(name)
            cells.append("-" if c is None else
                         f"{c.prediction.goodput_requests_per_s:.2f} / {c.prediction.ttft_p99_s:.2f} s")  # fmt: skip
        cells.append(row["pick"].layout.describe())
        lines.append(" | ".join(cells))
    return "\n".join(lines)


MIN_ATTAINMENT = 0.1  # a sweep point where no layout keeps this share of requests within the SLO says nothing


def _crossover(shape: WorkloadShape, rows: Sequence[dict[str, Any]], by_rate: bool) -> str:
    """The crossover over the points where some layout still serves, and the points where none does."""
    served = [(row["x"], row["pick"].layout) for row in rows if row["pick"].prediction.slo_attainment >= MIN_ATTAINMENT]
    lost = [f"{row['x']:g}" for row in rows if row["pick"].prediction.slo_attainment < MIN_ATTAINMENT]
    unit = " req/s" if by_rate else "-token prompts"
    line = crossover_line(shape, served, by_rate) if served else f"{shape.value}: no point swept is served"
    if lost:
        line += f"; at {', '.join(lost)}{unit} no layout keeps {MIN_ATTAINMENT:.0%} of the requests within the SLO"
    return line


def crossover_line(shape: WorkloadShape, picks: Sequence[tuple[float, Layout]], by_rate: bool = True) -> str:
    """Where the pick turns disaggregated (and stays so) over the swept rates or prompt lengths, in one sentence."""
    disaggregated = [layout.num_colocated == 0 for _, layout in picks]
    xs = [x for x, _ in picks]
    what, unit = ("rate", " req/s") if by_rate else ("prompt length", " tokens")
    swept = f"{xs[0]:g} to {xs[-1]:g}{unit}"
    if not any(disaggregated):
        return f"{shape.value}: colocated is the pick at every {what} swept ({swept})"
    if all(disaggregated):
        return f"{shape.value}: disaggregation is the pick at every {what} swept ({swept})"
    first = next(i for i in range(len(picks) + 1) if all(disaggregated[i:]))
    if not any(disaggregated[:first]):
        where = f"{xs[first]:g} req/s" if by_rate else f"{xs[first]:g}-token prompts"
        return (
            f"{shape.value}: DPD ({picks[first][1].name}) pays off from {where} "
            f"(between {xs[first - 1]:g} and {xs[first]:g}{unit}); below that, colocated"
        )
    runs: list[tuple[bool, list[float]]] = []  # consecutive points with the same kind of pick
    for x, is_dpd in zip(xs, disaggregated, strict=True):
        if runs and runs[-1][0] == is_dpd:
            runs[-1][1].append(x)
        else:
            runs.append((is_dpd, [x]))
    parts = [
        f"{'DPD' if is_dpd else 'colocated'} at {span[0]:g}{unit}" if len(span) == 1
        else f"{'DPD' if is_dpd else 'colocated'} from {span[0]:g} to {span[-1]:g}{unit}"
        for is_dpd, span in runs
    ]  # fmt: skip
    return f"{shape.value}: the pick changes over the {what}s swept: {'; '.join(parts)}"


def _verify(
    options: PlanOptions,
    config: InferenceEndpointConfig,
    model: str,
    result: Recommendation,
    calibration: Calibration,
    replayed: ReplayWorkload,
    slo: Slo,
    note: Callable[[str], None],
) -> list[VerifiedLayout]:
    """The pick, and the resource as written when it is another layout, each brought up and replayed."""
    directory = options.verify_dir or Path(tempfile.mkdtemp(prefix="splitserve-verify-"))
    directory.mkdir(parents=True, exist_ok=True)
    note(f"verify: resources, logs and results in {directory}")
    pick, current = result.pick, result.current
    runs: list[tuple[str, Candidate, Path]] = []
    if pick.layout.is_current or current is None:
        runs.append(("pick", pick, options.file))
    else:
        planned = directory / "pick.yaml"
        write_planned(str(planned), config, pick.layout, note=result.reason)
        runs += [("pick", pick, planned), ("current", current, options.file)]
    budget_s = options.max_duration_s / len(runs)
    replay_s = max(budget_s - STARTUP_ALLOWANCE_S, budget_s / 2)

    def predicted(layout: Layout, requests: Sequence[TraceRequest]) -> Prediction:
        return summarize(_simulated(config, calibration, layout, requests), slo)

    def duration_on(layout: Layout) -> Callable[[Sequence[TraceRequest]], float]:
        return lambda requests: predicted(layout, requests).duration_s

    num = min(fitting_requests(replayed, replay_s, duration_on(c.layout)) for _, c, _ in runs)
    workload = replayed.first(num)
    predictions = [c.prediction if num == len(replayed.requests) else predicted(c.layout, workload.requests)
                   for _, c, _ in runs]  # fmt: skip
    if num < len(replayed.requests):
        note(f"verify: replaying the first {num} of {len(replayed.requests)} requests, what the prediction says "
             f"fits in {replay_s:.0f} s a layout (--max-duration {options.max_duration_s:g} s)")  # fmt: skip
    expected = sum(p.duration_s for p in predictions) + STARTUP_ALLOWANCE_S * len(runs)
    note(f"verify: {len(runs)} layout(s), predicted replays {', '.join(f'{p.duration_s:.0f} s' for p in predictions)}; "
         f"about {expected / 60:.0f} min in all with start-ups, at most {options.max_duration_s / 60:.0f} min "
         "(--max-duration)")  # fmt: skip
    verified = []
    for (label, candidate, resource), prediction in zip(runs, predictions, strict=True):
        verified.append(verify_layout(
            label, candidate.layout.describe(), resource, config.metadata.name, model, workload,
            prediction, slo, candidate.layout.num_workers, directory / label, note, budget_s,
        ))  # fmt: skip
    return verified


def _verdict(verified: Sequence[VerifiedLayout]) -> str:
    worst = max(e for layout in verified for e in layout.errors.values())
    lines = [f"largest relative error: {worst * 100:.1f}% (over {', '.join(FIGURES)})"]
    if len(verified) == 2:
        pick, current = (layout.replay.measured.goodput_requests_per_s for layout in verified)
        lines.append(f"measured goodput: pick {pick:.3f} req/s, resource as written {current:.3f} req/s")
    return "\n".join(lines)


def _simulated(
    config: InferenceEndpointConfig, calibration: Calibration, layout: Layout, requests: Sequence[TraceRequest]
) -> SimResult:
    return simulate(requests, topology(config, layout, calibration), kv_moves(calibration))


def _workload_json(options: PlanOptions, requests: Sequence[Any], shape: WorkloadShape | None) -> dict[str, Any]:
    if shape is None:
        return {"trace": str(options.trace), "description": describe(requests)}
    rate = options.rate if options.rate is not None else DEFAULT_RATES[shape]
    return {"shape": shape.value, "rate": rate, "num_requests": len(requests), "seed": options.seed,
            "description": describe(requests)}  # fmt: skip

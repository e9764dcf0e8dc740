"""``splitserve bench sweep``: the same workload against several endpoints at several request rates.

Points run one after the other: for each rate (ascending as given), each endpoint in the order given. Each
point is one ``bench serve`` run whose summary becomes a ``SweepPoint`` with its goodput under the SLO; the
summary JSON holds every point, and ``plots.plot_sweep`` draws them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import httpx

import splitserve
from splitserve.bench.metrics import Slo
from splitserve.bench.report import config_to_json
from splitserve.bench.runner import ServeConfig, serve
from splitserve.bench.series import SweepPoint, sweep_point

SUMMARY_FILE = "sweep.json"
SUMMARY_KIND = "splitserve-bench-sweep"
"""The ``kind`` field that marks a sweep summary (a single run's result has a ``summary`` instead)."""
DEFAULT_SLO = Slo(ttft_s=5.0, itl_s=0.2)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_DURATION = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*")


@dataclass(frozen=True)
class SweepConfig:
    """One sweep; ``validate()`` checks it."""

    workload: ServeConfig
    """Dataset, load and client options shared by every point; each point sets its own url, request_rate,
    label, json_path and seed."""
    endpoints: tuple[tuple[str, str], ...]
    """``(name, base URL)`` per endpoint, in run order; names label the lines and the result files."""
    rates: tuple[float, ...]
    """Offered request rates (Poisson arrivals per second), in run order."""
    slo: Slo = DEFAULT_SLO
    json_dir: Path | None = None
    """Where each point's result (``<name>_rate<rate>.json``) and the summary (``sweep.json``) go."""
    pause_s: float = 0.0
    """Idle seconds between points, so one point's backlog does not spill into the next."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending values."""
        names = [name for name, _ in self.endpoints]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"give one or more endpoints with distinct names, got {names}")
        if bad := [name for name in names if not _NAME.fullmatch(name)]:
            raise ValueError(f"endpoint names must be letters, digits, '_', '.' or '-', got {bad}")
        if not self.rates or not all(0 < rate < math.inf for rate in self.rates):
            raise ValueError(f"rates must be finite and > 0, got {list(self.rates)}")
        if not self.pause_s >= 0:
            raise ValueError(f"pause_s must be >= 0, got {self.pause_s}")
        self.slo.validate()

    def points(self) -> list[tuple[str, str, float]]:
        """``(name, url, rate)`` of every point, in run order."""
        return [(name, url, rate) for rate in self.rates for name, url in self.endpoints]


def result_file_name(endpoint: str, rate: float) -> str:
    return f"{endpoint}_rate{rate:g}.json"


async def run_sweep(
    config: SweepConfig,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    out: TextIO | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> list[SweepPoint]:
    """Run every point of ``config`` in order (see ``SweepConfig.points``), print each run's table and then
    the sweep table to ``out``, and write the result files and the summary when ``json_dir`` is set.

    Point i uses seed ``workload.seed + i``, so no point meets prompts (or prefix-cache entries) that an
    earlier one left behind; prompt and output lengths follow the same distribution at every point.
    ``transport`` replaces the network for every endpoint (tests); ``sleep`` waits the pause.
    """
    out = out or sys.stdout
    config.validate()
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    points: list[SweepPoint] = []
    for index, (name, url, rate) in enumerate(config.points()):
        if index and config.pause_s:
            await sleep(config.pause_s)
        print(f"\n--- {name} at {rate:g} req/s ({url}) ---", file=out)
        path = config.json_dir / result_file_name(name, rate) if config.json_dir is not None else None
        seed = config.workload.seed + index
        run = dataclasses.replace(
            config.workload, url=url, request_rate=rate, label=f"{name}@{rate:g}", json_path=path, seed=seed
        )
        report = await serve(run, transport=transport, out=out)
        points.append(sweep_point(name, rate, report.summary, report.results, config.slo, result_path=_str(path)))
    print(format_sweep_table(points, config.slo), file=out)
    if config.json_dir is not None:
        write_sweep_json(config, points, started_at, config.json_dir / SUMMARY_FILE)
        print(f"wrote {config.json_dir / SUMMARY_FILE}", file=out)
    return points


def _str(path: Path | None) -> str | None:
    return None if path is None else str(path)


def format_sweep_table(points: Sequence[SweepPoint], slo: Slo) -> str:
    """One line per point: rate, TTFT p50/p99 and ITL p99 (ms), output tok/s, goodput and SLO attainment."""
    header = f"{'endpoint':<16}{'req/s':>8}{'ok':>6}{'fail':>6}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p99':>10}"
    header += f"{'tok/s':>10}{'goodput':>9}{'in SLO':>8}"
    title = f" Sweep (SLO: TTFT <= {slo.ttft_s * 1000:g} ms, ITL p99 <= {slo.itl_s * 1000:g} ms) "
    lines = ["", title.center(len(header), "="), header]
    for p in points:
        line = f"{p.endpoint:<16}{p.request_rate:>8g}{p.num_completed:>6}{p.num_failed:>6}{p.ttft_p50_ms:>10.1f}"
        line += f"{p.ttft_p99_ms:>10.1f}{p.itl_p99_ms:>10.1f}{p.output_throughput:>10.1f}{p.goodput:>9.2f}"
        lines.append(line + f"{p.slo_attainment:>8.0%}")
    lines.append("=" * len(header))
    return "\n".join(lines)


def sweep_to_json(config: SweepConfig, points: Sequence[SweepPoint], started_at: str) -> dict[str, Any]:
    """The summary document: kind, version, start time, SLO, endpoints, rates, shared arguments and points.

    NaN figures (no completed request) become ``null``.
    """
    args = config_to_json(config.workload)
    for per_point in ("url", "request_rate", "label", "json_path"):
        args.pop(per_point)
    document = {
        "kind": SUMMARY_KIND,
        "splitserve_version": splitserve.__version__,
        "started_at": started_at,
        "slo": {"ttft_s": config.slo.ttft_s, "itl_s": config.slo.itl_s},
        "endpoints": dict(config.endpoints),
        "rates": list(config.rates),
        "args": args,
        "points": [dataclasses.asdict(p) for p in points],
    }
    return {k: _nan_to_none(v) for k, v in document.items()}


def _nan_to_none(value: Any) -> Any:
    if isinstance(value, list):
        return [_nan_to_none(v) for v in value]
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    return None if isinstance(value, float) and math.isnan(value) else value


def write_sweep_json(config: SweepConfig, points: Sequence[SweepPoint], started_at: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    document = sweep_to_json(config, points, started_at)
    path.write_text(json.dumps(document, indent=1, allow_nan=False) + "\n", encoding="utf-8")


def load_sweep(path: Path) -> tuple[list[SweepPoint], Slo]:
    """The points and SLO of a summary written by ``write_sweep_json`` (``null`` figures back to NaN)."""
    document = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(document, dict) or document.get("kind") != SUMMARY_KIND:
        raise ValueError(f"{path} is not a splitserve bench sweep summary (no kind {SUMMARY_KIND!r})")
    floats = {f.name for f in dataclasses.fields(SweepPoint) if f.type == "float"}
    points = [SweepPoint(**_none_to_nan(record, floats)) for record in document["points"]]
    return points, Slo(**document["slo"])


def _none_to_nan(record: dict[str, Any], floats: set[str]) -> dict[str, Any]:
    return {k: math.nan if v is None and k in floats else v for k, v in record.items()}


# ---------------------------------------------------------------------------------------------------------
# Parsing the command line's text (the edge)


def parse_duration_s(text: str) -> float:
    """``"2s"``, ``"150ms"``, ``"0.5"`` (seconds) -> seconds; ValueError otherwise (the planner's syntax)."""
    match = _DURATION.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a duration (examples: 2s, 150ms, 0.5)")
    value = float(match.group(1))
    return value / 1000 if match.group(2) == "ms" else value


def parse_slo(text: str, default: Slo = DEFAULT_SLO) -> Slo:
    """``ttft_p99=2s,itl_p99=150ms`` (either part may be left out: ``default``'s then) -> an Slo."""
    values = {"ttft_p99": default.ttft_s, "itl_p99": default.itl_s}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        if not eq or name.strip() not in values:
            raise ValueError(f"--slo: {part!r}: expected ttft_p99=DURATION or itl_p99=DURATION (e.g. 2s, 150ms)")
        values[name.strip()] = parse_duration_s(value)
    slo = Slo(values["ttft_p99"], values["itl_p99"])
    slo.validate()
    return slo


def parse_rates(text: str) -> tuple[float, ...]:
    """``0.5,1,2,4`` -> (0.5, 1.0, 2.0, 4.0); ValueError for anything that is not a number."""
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"--rates: expected comma-separated numbers such as 0.5,1,2,4, got {text!r}") from None


def parse_endpoint(text: str) -> tuple[str, str]:
    """``NAME=URL`` -> (name, url); a bare URL is named by its host and port."""
    name, eq, url = text.partition("=")
    if not eq:
        url = text
        name = url.split("://", 1)[-1].split("/", 1)[0].replace(":", "_")
    return name.strip(), url.strip()

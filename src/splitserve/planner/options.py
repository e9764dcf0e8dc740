"""The options of ``splitserve plan``, declared once as settings (``splitserve.settings``): the command's flags are
made from them, and :func:`~splitserve.planner.command.run_plan` receives them as :class:`PlanOptions`.

Light on purpose (no simulator, no calibration): the command line imports it to build ``splitserve plan``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import EnumMeta
from pathlib import Path
from typing import TypeVar

from splitserve.config import RoutingStrategy
from splitserve.planner.workload import WorkloadShape
from splitserve.settings import REQUIRED, setting

T = TypeVar("T")
DEFAULT_THRESHOLDS = (512, 1024, 2048, 4096)  # routingThreshold values tried


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


def _comma_list(
    flag: str, parse: Callable[[str], T], *, empty_ok: bool = False
) -> Callable[[str | None], tuple[T, ...]]:
    def convert(text: str | None) -> tuple[T, ...]:
        return () if empty_ok and not text else parse_choices(flag, text or "", parse)

    return convert


def _joined(values: tuple[object, ...]) -> str:
    return ",".join(str(v) for v in values)


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """The command's options, as given (validated by :func:`~splitserve.planner.command.run_plan`)."""

    file: Path = setting(REQUIRED, "The InferenceEndpointConfig resource file.", short="f")
    workload: WorkloadShape = setting(
        WorkloadShape.CHAT, "chat, rag, mixed or long-context (shapes and rates: docs/planner.md).",
        option_type=str, option_default=WorkloadShape.CHAT.value,
        convert=lambda text: parse_choices("--workload", text, WorkloadShape)[0],
    )  # fmt: skip
    trace: Path | None = setting(None, "A JSON-lines trace instead: arrival_s, prompt_tokens, output_tokens, ...")
    rate: float | None = setting(None, "Requests/s (default: the workload's).")
    num_requests: int = setting(400, "Requests of the generated workload.")
    seed: int = setting(0, "Seed of the generated workload.")
    slo: str | None = setting(None, "ttft_p99=2s,itl_p99=200ms (default: the workload's, see docs/planner.md).")
    out: Path | None = setting(None, "Write the resource with the pick here.")
    json_path: Path | None = setting(None, "Write candidates, pick and calibration here.", flag="json")
    recalibrate: bool = setting(False, "Measure again, ignoring the cached calibration.")
    thresholds: tuple[int, ...] = setting(
        DEFAULT_THRESHOLDS, "routingThreshold values to try, comma-separated.", option_type=str,
        option_default=_joined(DEFAULT_THRESHOLDS), convert=_comma_list("--thresholds", int),
    )  # fmt: skip
    strategies: tuple[RoutingStrategy, ...] = setting(
        tuple(RoutingStrategy), "Routing strategies to try, comma-separated.", option_type=str,
        option_default=_joined(tuple(RoutingStrategy)), convert=_comma_list("--strategies", RoutingStrategy),
    )  # fmt: skip
    verify: bool = setting(
        False, "Bring up the pick (and the resource as written) locally, replay the workload, compare."
    )
    max_duration_s: float = setting(
        900.0, "Seconds --verify may take in all (start-ups and replays): the replay is cut to what the prediction "
        "says fits, and a replay still running at its share of the time is stopped.", flag="max-duration",
    )  # fmt: skip
    verify_dir: Path | None = setting(
        None, "Where --verify keeps resources, logs and results (default: a new temporary directory)."
    )
    plot: Path | None = setting(
        None, "PNG: candidates; with --verify predicted against measured; with --sweep-rates the curves."
    )
    sweep_rates: tuple[float, ...] = setting(
        (), "Predict at each of these rates (comma-separated) and state the crossover.", option_type=str | None,
        option_default=None, convert=_comma_list("--sweep-rates", float, empty_ok=True),
    )  # fmt: skip
    sweep_prompt_tokens: tuple[int, ...] = setting(
        (), "Predict with every prompt this long, for each length (comma-separated): the crossover.",
        option_type=str | None, option_default=None, convert=_comma_list("--sweep-prompt-tokens", int, empty_ok=True),
    )  # fmt: skip

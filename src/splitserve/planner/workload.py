"""Workloads for the planner: the documented shapes, and traces in JSON lines.

A workload is a list of :class:`TraceRequest`, in arrival order: when a request arrives, how many prompt and
output tokens it has, and which earlier prompts it shares a prefix with (``prefix_group``, ``prefix_tokens``).
The simulator needs nothing else: no text, no token ids.

**The shapes** (``--workload``). Lengths are tokens; every draw comes from one ``random.Random(seed)``, so a
seed gives the same workload everywhere. Arrivals are Poisson at the rate (requests/s) unless a shape says
otherwise. Every prompt plus its output is clipped to the model's context (``max_model_len``).

- ``chat`` (default rate 1.0 req/s): conversations of 1 to 6 turns (uniform). Conversations start as a Poisson
  process at ``rate / 3.5`` (the mean turns), so requests arrive at about ``rate``; a turn follows the previous
  one after an exponential think time of mean 8 s (open loop: it does not wait for the answer). The first
  prompt is a 150-token system prompt plus a user message (lognormal, median 120, sigma 0.6, 8..1,500); each
  later prompt is the whole history (previous prompt and answer) plus a new message of the same law. Outputs
  are lognormal, median 150, sigma 0.5, 16..512. ``prefix_group`` is the conversation (``chat-<n>``), and
  ``prefix_tokens`` the history: what an engine that served the previous turn holds.
- ``rag`` (default rate 0.3 req/s): questions about 24 documents of 1,500 to 3,000 tokens (uniform, drawn
  once); each request picks a document with probability proportional to ``1 / rank`` (Zipf, s = 1) and asks a
  question (lognormal, median 60, sigma 0.5, 8..400) after it. Outputs lognormal, median 120, sigma 0.5,
  16..400. ``prefix_group`` is the document (``doc-<k>``), ``prefix_tokens`` its length.
- ``long-context`` (default rate 0.1 req/s): unrelated prompts of 3,000 to 7,000 tokens (uniform), outputs
  lognormal, median 200, sigma 0.4, 32..512; no prefix group.
- ``mixed`` (default rate 0.5 req/s): 70 % short requests (a 150-token system prompt shared by all of them,
  ``prefix_group`` ``system``, plus a lognormal message of median 200, sigma 0.6, 8..1,500; outputs median
  150) and 30 % long ones drawn as ``long-context``.

**Traces** (``--trace file.jsonl``): one JSON object per line, ``{"arrival_s": 0.42, "prompt_tokens": 900,
"output_tokens": 120}`` plus optional ``"prefix_group": "doc-3"`` and ``"prefix_tokens": 800`` (default: no
group, 0 tokens; ``prefix_tokens`` needs a group and is less than ``prompt_tokens``). Blank lines and lines
starting with ``#`` are skipped; arrival times never decrease. :func:`load_trace` raises :class:`TraceError`
naming the file and line of the first bad one.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from splitserve.errors import SplitserveError

CHAT_SYSTEM_TOKENS = 150
MIXED_LONG_SHARE = 0.3
RAG_NUM_DOCUMENTS = 24
MEAN_CHAT_TURNS = 3.5  # uniform over 1..6
CHAT_THINK_S = 8.0


class TraceError(SplitserveError, ValueError):
    """A trace that cannot be read; the message names the file and line."""


class WorkloadShape(StrEnum):
    CHAT = "chat"
    RAG = "rag"
    MIXED = "mixed"
    LONG_CONTEXT = "long-context"


DEFAULT_RATES: dict[WorkloadShape, float] = {
    WorkloadShape.CHAT: 1.0,
    WorkloadShape.RAG: 0.3,
    WorkloadShape.MIXED: 0.5,
    WorkloadShape.LONG_CONTEXT: 0.1,
}


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a workload."""

    arrival_s: float  # seconds from the start of the workload
    prompt_tokens: int
    output_tokens: int  # tokens generated (the first one included)
    prefix_group: str | None = None  # requests of one group share their first prefix_tokens tokens
    prefix_tokens: int = 0  # tokens of the prompt an engine that served the group before may hold

    def check(self) -> None:
        """Raise ValueError naming the field for a request that cannot exist."""
        if not (math.isfinite(self.arrival_s) and self.arrival_s >= 0):
            raise ValueError(f"arrival_s must be a finite number >= 0, got {self.arrival_s!r}")
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError(
                f"prompt_tokens and output_tokens must be >= 1, got {self.prompt_tokens} and {self.output_tokens}"
            )
        if self.prefix_tokens and self.prefix_group is None:
            raise ValueError("prefix_tokens needs a prefix_group")
        if not 0 <= self.prefix_tokens < self.prompt_tokens:
            raise ValueError(
                f"prefix_tokens must be in [0, prompt_tokens), got {self.prefix_tokens} of {self.prompt_tokens}"
            )

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "arrival_s": round(self.arrival_s, 6),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
        }
        if self.prefix_group is not None:
            data["prefix_group"] = self.prefix_group
            data["prefix_tokens"] = self.prefix_tokens
        return data


# ---------------------------------------------------------------------------------------------- traces

_FIELDS = {"arrival_s", "prompt_tokens", "output_tokens", "prefix_group", "prefix_tokens"}


def parse_trace_line(text: str) -> TraceRequest:
    """One trace line -> its request; ValueError saying what is wrong (without the line number)."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r}; fields: {', '.join(sorted(_FIELDS))}")
    for name in ("arrival_s", "prompt_tokens", "output_tokens"):
        if name not in data:
            raise ValueError(f"{name} is missing")
    group = data.get("prefix_group")
    if group is not None and (not isinstance(group, str) or not group):
        raise ValueError(f"prefix_group must be a non-empty string, got {group!r}")
    request = TraceRequest(
        arrival_s=_number(data, "arrival_s"),
        prompt_tokens=_integer(data, "prompt_tokens"),
        output_tokens=_integer(data, "output_tokens"),
        prefix_group=group,
        prefix_tokens=_integer(data, "prefix_tokens") if "prefix_tokens" in data else 0,
    )
    request.check()
    return request


def _number(data: dict[str, Any], name: str) -> float:
    value = data[name]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _integer(data: dict[str, Any], name: str) -> int:
    value = data[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def parse_trace(lines: Iterable[str], source: str = "<trace>") -> list[TraceRequest]:
    """Trace lines -> requests; TraceError ``{source}:{line}: ...`` for the first bad line."""
    requests: list[TraceRequest] = []
    for line_no, line in enumerate(lines, start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        try:
            request = parse_trace_line(text)
        except ValueError as exc:
            raise TraceError(f"{source}:{line_no}: {exc}") from None
        if requests and request.arrival_s < requests[-1].arrival_s:
            raise TraceError(
                f"{source}:{line_no}: arrival_s {request.arrival_s} is before the previous line's "
                f"{requests[-1].arrival_s}; sort the trace by arrival time"
            )
        requests.append(request)
    if not requests:
        raise TraceError(f"{source}: no requests")
    return requests


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read a trace file (see the module docstring); TraceError names the file and line of a problem."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read: {exc}") from None
    return parse_trace(text.splitlines(), str(path))


def save_trace(path: str | Path, requests: Sequence[TraceRequest]) -> None:
    """Write ``requests`` as a trace file (one JSON object per line), which load_trace reads back equal."""
    lines = [json.dumps(r.to_json(), separators=(",", ":")) for r in requests]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------- the shapes


@dataclass(frozen=True, slots=True)
class _Draw:
    """The random draws of one shape, over one ``random.Random``."""

    rng: random.Random

    def lognormal(self, median: float, sigma: float, low: int, high: int) -> int:
        value = median * math.exp(self.rng.gauss(0.0, sigma))
        return max(low, min(high, round(value)))

    def uniform(self, low: int, high: int) -> int:
        return self.rng.randint(low, high)

    def gap_s(self, rate: float) -> float:
        return self.rng.expovariate(rate)


def generate(
    shape: WorkloadShape | str,
    *,
    rate: float | None = None,
    num_requests: int = 400,
    seed: int = 0,
    max_model_len: int = 8192,
) -> list[TraceRequest]:
    """``num_requests`` requests of ``shape`` at ``rate`` requests/s (the shape's default when None), sorted by
    arrival. Deterministic for a seed. ValueError for an unknown shape or a rate or count that is not positive."""
    try:
        shape = WorkloadShape(shape)
    except ValueError:
        raise ValueError(
            f"unknown workload {shape!r}; workloads: {', '.join(s.value for s in WorkloadShape)}"
        ) from None
    rate = DEFAULT_RATES[shape] if rate is None else rate
    if not rate > 0 or num_requests < 1:
        raise ValueError(f"rate and num_requests must be positive, got {rate} and {num_requests}")
    if max_model_len < 64:
        raise ValueError(f"max_model_len must be at least 64, got {max_model_len}")
    draw = _Draw(random.Random(f"splitserve-planner:{shape.value}:{seed}"))
    requests = _GENERATORS[shape](draw, rate, num_requests)
    clipped = [_clip(r, max_model_len) for r in requests]
    return sorted(clipped, key=lambda r: r.arrival_s)[:num_requests]


def _clip(request: TraceRequest, max_model_len: int) -> TraceRequest:
    """The request fitted into the context: the output keeps at most half of it, the prompt the rest."""
    output = min(request.output_tokens, max_model_len // 2)
    prompt = min(request.prompt_tokens, max_model_len - output)
    prefix = min(request.prefix_tokens, prompt - 1)
    group = request.prefix_group
    return TraceRequest(request.arrival_s, prompt, output, group, prefix)


def _chat(draw: _Draw, rate: float, num_requests: int) -> list[TraceRequest]:
    """Conversations until ``num_requests`` have arrived before any conversation not yet drawn could start."""
    requests: list[TraceRequest] = []
    start_s, conversation = 0.0, 0
    while len(requests) < num_requests or start_s < _nth_arrival_s(requests, num_requests):
        start_s += draw.gap_s(rate / MEAN_CHAT_TURNS)
        requests += _conversation(draw, f"chat-{conversation}", start_s)
        conversation += 1
    return requests


def _nth_arrival_s(requests: Sequence[TraceRequest], n: int) -> float:
    return sorted(r.arrival_s for r in requests)[n - 1]


def _conversation(draw: _Draw, group: str, start_s: float) -> list[TraceRequest]:
    turns, at_s, history = draw.uniform(1, 6), start_s, 0
    requests = []
    for turn in range(turns):
        message = draw.lognormal(120, 0.6, 8, 1500)
        prompt = (CHAT_SYSTEM_TOKENS if turn == 0 else history) + message
        output = draw.lognormal(150, 0.5, 16, 512)
        requests.append(TraceRequest(at_s, prompt, output, group, history))
        history = prompt + output
        at_s += draw.gap_s(1.0 / CHAT_THINK_S)
    return requests


def _rag(draw: _Draw, rate: float, num_requests: int) -> list[TraceRequest]:
    documents = [draw.uniform(1500, 3000) for _ in range(RAG_NUM_DOCUMENTS)]
    weights = [1.0 / (rank + 1) for rank in range(RAG_NUM_DOCUMENTS)]
    requests, at_s = [], 0.0
    for _ in range(num_requests):
        at_s += draw.gap_s(rate)
        k = draw.rng.choices(range(RAG_NUM_DOCUMENTS), weights)[0]
        question, output = draw.lognormal(60, 0.5, 8, 400), draw.lognormal(120, 0.5, 16, 400)
        requests.append(TraceRequest(at_s, documents[k] + question, output, f"doc-{k}", documents[k]))
    return requests


def _long_request(draw: _Draw, at_s: float) -> TraceRequest:
    return TraceRequest(at_s, draw.uniform(3000, 7000), draw.lognormal(200, 0.4, 32, 512))


def _long_context(draw: _Draw, rate: float, num_requests: int) -> list[TraceRequest]:
    requests, at_s = [], 0.0
    for _ in range(num_requests):
        at_s += draw.gap_s(rate)
        requests.append(_long_request(draw, at_s))
    return requests


def _mixed(draw: _Draw, rate: float, num_requests: int) -> list[TraceRequest]:
    requests, at_s = [], 0.0
    for _ in range(num_requests):
        at_s += draw.gap_s(rate)
        if draw.rng.random() < MIXED_LONG_SHARE:
            requests.append(_long_request(draw, at_s))
            continue
        prompt = CHAT_SYSTEM_TOKENS + draw.lognormal(200, 0.6, 8, 1500)
        output = draw.lognormal(150, 0.5, 16, 512)
        requests.append(TraceRequest(at_s, prompt, output, "system", CHAT_SYSTEM_TOKENS))
    return requests


_GENERATORS: dict[WorkloadShape, Callable[[_Draw, float, int], list[TraceRequest]]] = {
    WorkloadShape.CHAT: _chat,
    WorkloadShape.RAG: _rag,
    WorkloadShape.LONG_CONTEXT: _long_context,
    WorkloadShape.MIXED: _mixed,
}


def with_prompt_tokens(requests: Sequence[TraceRequest], num_tokens: int, max_model_len: int) -> list[TraceRequest]:
    """The workload with every prompt ``num_tokens`` long (fitted into the context as generated ones are); a
    shared prefix keeps its length, less than the prompt."""
    return [_clip(replace(r, prompt_tokens=num_tokens, prefix_tokens=min(r.prefix_tokens, num_tokens - 1)),
                  max_model_len) for r in requests]  # fmt: skip


def describe(requests: Sequence[TraceRequest]) -> str:
    """One line about a workload: count, rate, median prompt and output lengths."""
    duration_s = requests[-1].arrival_s - requests[0].arrival_s
    rate = (len(requests) - 1) / duration_s if duration_s > 0 else math.inf
    prompts = sorted(r.prompt_tokens for r in requests)
    outputs = sorted(r.output_tokens for r in requests)
    return (
        f"{len(requests)} requests at {rate:.2f} req/s, prompts median {prompts[len(prompts) // 2]} tokens, "
        f"outputs median {outputs[len(outputs) // 2]} tokens"
    )

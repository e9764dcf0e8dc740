"""``splitserve plan --verify``: bring layouts up with the local supervisor, replay the workload against each, and
set what the planner predicted beside what the replay measured.

**The replayed workload.** A workload says how many tokens each prompt shares with earlier ones, not which
tokens. The replay builds token ids for it (:func:`replay_workload`): a request of a group takes the group's
history up to its ``prefix_tokens`` and then fresh tokens; the history after it is its prompt followed by fresh
tokens standing for its answer. What a real engine holds after a turn, though, is the model's own answer, not
those stand-ins, so a chat turn shares only the previous *prompt* with what came before, not the answer. The
replay therefore re-states every request's ``prefix_tokens`` as the longest prefix its prompt really shares
with an earlier prompt of its group, and the planner predicts that workload: prediction and replay see the same
requests. Token ids are symbols until an endpoint is up; then they become ids drawn from the tokens of plain
English words as the endpoint's own tokenizer splits them (``/tokenize``), so no special token is ever sent.

**The replay** sends each request as a streamed completion of its token ids (greedy, ``ignore_eos``, exactly
``output_tokens`` tokens) at its arrival time, open loop, after a short warm-up of fresh prompts; it measures
what ``splitserve bench`` measures. The measured figures are summarized with the simulator's own code
(:func:`splitserve.planner.simulate.summarize`), so both sides count percentiles, throughput and goodput alike.

Torch-free: the endpoint runs in ``splitserve up`` child processes.
"""

from __future__ import annotations

import asyncio
import json
import math
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from splitserve import envs
from splitserve.bench.client import EndpointKind, OpenAIStreamClient, RequestResult
from splitserve.bench.datasets import WORDS, BenchRequest
from splitserve.bench.runner import run_requests
from splitserve.bench.series import chunk_times_s
from splitserve.config import client_keys
from splitserve.deploy.pods import child_setup
from splitserve.deploy.supervisor import free_port, splitserve_command
from splitserve.planner.simulate import Prediction, RequestTiming, SimResult, Slo, summarize
from splitserve.planner.workload import TraceRequest

CUT = "cut at --max-duration"  # the error of a request the replay's time ran out on
STARTUP_ALLOWANCE_S = 90.0  # of a layout's share of --max-duration: its start and warm-up, before the replay
FIGURES = ("ttft_p50_s", "ttft_p99_s", "itl_p99_s", "output_tokens_per_s")
"""The figures whose relative error ``--verify`` reports (the target: within 25 % each)."""
READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 90.0
# tokens; each sent once per worker, one at a time, before the replay; none longer than the workload's longest
# prompt (warm_up_lengths)
WARMUP_PROMPTS = (64, 512, 2048)
_SYMBOL_MIX = 0x9E3779B97F4A7C15  # a fixed odd 64-bit multiplier: symbols -> pool slots, the same in every run


# ---------------------------------------------------------------------------------------------- the workload


@dataclass(frozen=True, slots=True)
class ReplayWorkload:
    """The requests with the prefixes their prompts really share, and each prompt as symbols."""

    requests: tuple[TraceRequest, ...]
    prompts: tuple[tuple[int, ...], ...]  # symbols: equal symbols are equal tokens, nothing else is

    @property
    def num_shared_tokens(self) -> int:
        return sum(r.prefix_tokens for r in self.requests)

    def first(self, n: int) -> ReplayWorkload:
        """The first ``n`` requests (their prefixes refer only to earlier prompts, so they stay true)."""
        return ReplayWorkload(self.requests[:n], self.prompts[:n])

    def token_ids(self, pool: Sequence[int], seed: int = 0) -> list[list[int]]:
        """Each prompt as token ids from ``pool``: one id per symbol, spread over the pool by a fixed hash."""
        if not pool:
            raise ValueError("the token pool is empty")
        size, mask = len(pool), (1 << 64) - 1
        return [[pool[((((s + seed) * _SYMBOL_MIX) & mask) >> 32) % size] for s in p] for p in self.prompts]


def replay_workload(requests: Sequence[TraceRequest]) -> ReplayWorkload:
    """Build prompts (as symbols) for ``requests`` and re-state each ``prefix_tokens`` as what its prompt shares
    with an earlier prompt of its group (module docstring)."""
    next_symbol = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_symbol
        next_symbol += n
        return list(range(next_symbol - n, next_symbol))

    history: dict[str, list[int]] = {}
    earlier: dict[str, list[list[int]]] = {}
    restated: list[TraceRequest] = []
    prompts: list[tuple[int, ...]] = []
    for request in requests:
        group = request.prefix_group
        if group is None:
            prompt = fresh(request.prompt_tokens)
            restated.append(request)
        else:
            held = history.get(group, [])
            shared = held[: request.prefix_tokens]
            shared += fresh(request.prefix_tokens - len(shared))
            prompt = shared + fresh(request.prompt_tokens - len(shared))
            common = max((_common_prefix(prompt, p) for p in earlier.get(group, [])), default=0)
            restated.append(replace(request, prefix_tokens=min(common, request.prompt_tokens - 1)))
            earlier.setdefault(group, []).append(prompt)
            history[group] = prompt + fresh(request.output_tokens)  # the answer's stand-in
        prompts.append(tuple(prompt))
    return ReplayWorkload(tuple(restated), tuple(prompts))


def warm_up_lengths(workload: ReplayWorkload) -> tuple[int, ...]:
    """The warm-up prompts' lengths for one worker: ``WARMUP_PROMPTS``, none past the workload's longest prompt
    (a path the replay never takes needs no warming, and a long prompt costs seconds a worker)."""
    longest = max((len(p) for p in workload.prompts), default=WARMUP_PROMPTS[0])
    return tuple(sorted({max(1, min(n, longest)) for n in WARMUP_PROMPTS}))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


# ---------------------------------------------------------------------------------------------- an endpoint


class LocalEndpoint(AbstractContextManager["LocalEndpoint"]):
    """``splitserve up -f RESOURCE`` as a child process in its own ``SPLITSERVE_HOME``, stopped on exit."""

    def __init__(self, resource: Path, home: Path, name: str) -> None:
        self.resource, self.home, self.name = resource, home, name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = home / "up.log"
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LocalEndpoint:
        self.home.mkdir(parents=True, exist_ok=True)
        env = {**envs.copy(), envs.HOME.name: str(self.home)}
        command = splitserve_command("up", "-f", str(self.resource), "--port", str(self.port))
        with self.log_path.open("wb") as log:
            # the endpoint dies with this process, even a SIGKILLed one: its supervisor gets SIGTERM and drains
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=child_setup()
            )
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)  # the supervisor drains and stops its pods
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until the supervisor reports the endpoint Ready and its router answers ``/health``; RuntimeError
        (naming the log) when the supervisor exits or the time is up."""
        state_path = self.home / "endpoints" / self.name / "state.json"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"splitserve up exited with {self.process.returncode}; see {self.log_path}")
            if _is_ready(state_path) and answers_ok(f"{self.url}/health"):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the endpoint was not ready after {timeout_s:.0f} s; see {self.log_path}")


def _is_ready(state_path: Path) -> bool:
    try:
        state = json.loads(state_path.read_text())
    except (OSError, ValueError):
        return False
    return bool(state.get("condition", {}).get("status"))


def answers_ok(url: str) -> bool:
    """Whether ``GET url`` answers 200 now."""
    try:
        return httpx.get(url, timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def client_headers() -> dict[str, str]:
    """A client key for the endpoint, when ``splitserve up`` gives its router one (``SPLITSERVE_API_KEY`` or
    ``VLLM_API_KEY`` in this environment, which the endpoint inherits); none otherwise."""
    keys = client_keys(())
    return {"Authorization": f"Bearer {keys[0]}"} if keys else {}


def served_model(url: str, default: str) -> str:
    """The model name the endpoint serves (its ``/v1/models``), else ``default``."""
    try:
        response = httpx.get(f"{url}/v1/models", headers=client_headers(), timeout=30.0)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return default


def token_pool(url: str, model: str) -> list[int]:
    """The distinct token ids of plain English words, as the endpoint's tokenizer splits them."""
    text = " ".join(WORDS)
    response = httpx.post(
        f"{url}/tokenize", json={"model": model, "prompt": text}, headers=client_headers(), timeout=60.0
    )
    response.raise_for_status()
    ids = sorted(set(int(t) for t in response.json()["tokens"]))
    if len(ids) < 64:
        raise RuntimeError(f"/tokenize gave only {len(ids)} distinct tokens for {len(WORDS)} words")
    return ids


# ---------------------------------------------------------------------------------------------- the replay


@dataclass(frozen=True, slots=True)
class Replay:
    """What one replay measured."""

    results: tuple[RequestResult, ...]
    duration_s: float
    measured: Prediction


class _CutAt(OpenAIStreamClient):
    """A client whose requests end at ``deadline`` (``time.monotonic()``): one still running, or not yet sent,
    then fails with :data:`CUT`."""

    def __init__(self, http: httpx.AsyncClient, url: str, model: str, deadline: float) -> None:
        super().__init__(http, base_url=url, model=model, kind=EndpointKind.COMPLETIONS)
        self.deadline = deadline

    async def send(self, request: BenchRequest, *, run_start_s: float = 0.0) -> RequestResult:
        left = self.deadline - time.monotonic()
        cut = RequestResult(success=False, max_tokens=request.max_tokens, error=CUT)
        if left <= 0:
            return cut
        try:
            return await asyncio.wait_for(super().send(request, run_start_s=run_start_s), left)
        except TimeoutError:
            return cut


async def _replay(
    url: str,
    model: str,
    prompts: Sequence[Sequence[int]],
    requests: Sequence[TraceRequest],
    warmup: Sequence[Sequence[int]],
    deadline: float,
) -> tuple[list[RequestResult], float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    headers = client_headers()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits, headers=headers, trust_env=False) as http:
        warming = OpenAIStreamClient(http, base_url=url, model=model, kind=EndpointKind.COMPLETIONS)
        for ids in warmup:
            result = await warming.send(BenchRequest(max_tokens=8, prompt=list(ids)))
            if not result.success:
                raise RuntimeError(f"a warm-up request failed: {result.error}")
        bench = [
            BenchRequest(max_tokens=r.output_tokens, prompt=list(p)) for r, p in zip(requests, prompts, strict=True)
        ]
        first = requests[0].arrival_s if requests else 0.0
        # a request due after the deadline is sent at the deadline, and cut at once: the replay ends there
        left_s = max(0.0, deadline - time.monotonic())
        offsets = [min(r.arrival_s - first, left_s) for r in requests]
        return await run_requests(_CutAt(http, url, model, deadline), bench, offsets)


def replay(
    url: str,
    model: str,
    workload: ReplayWorkload,
    pool: Sequence[int],
    slo: Slo,
    num_workers: int,
    deadline: float = math.inf,
) -> Replay:
    """Warm the endpoint up, send the workload at its arrival times, and summarize what came back; requests
    still unanswered at ``deadline`` (``time.monotonic()``) fail with :data:`CUT`."""
    prompts = workload.token_ids(pool)
    lengths = warm_up_lengths(workload) * num_workers
    warmup = ReplayWorkload(
        (), tuple(tuple(range(-(i + 1) * 10_000, -(i + 1) * 10_000 + n)) for i, n in enumerate(lengths))
    ).token_ids(pool, seed=7)
    results, duration_s = asyncio.run(_replay(url, model, prompts, workload.requests, warmup, deadline))
    return Replay(tuple(results), duration_s, measured_figures(results, slo))


def measured_figures(results: Sequence[RequestResult], slo: Slo) -> Prediction:
    """The replay's figures, counted as the simulator counts its own (failed requests are left out)."""
    ok = [r for r in results if r.success and r.ttft_s is not None]
    timings = [RequestTiming(r.start_s, chunk_times_s(r)) for r in ok]
    first = min((t.arrival_s for t in timings), default=0.0)
    last = max((t.token_times_s[-1] for t in timings), default=first)
    summary = summarize(SimResult(tuple(timings), {}, max(last - first, 1e-9)), slo)
    # a chunk may carry several tokens: throughput counts the tokens the server reported
    return replace(summary, output_tokens_per_s=sum(r.output_tokens for r in ok) / summary.duration_s)


def relative_errors(predicted: Prediction, measured: Prediction) -> dict[str, float]:
    """``|predicted - measured| / measured`` for each of :data:`FIGURES`."""
    errors = {}
    for name in FIGURES:
        want, got = getattr(predicted, name), getattr(measured, name)
        errors[name] = abs(want - got) / got if got > 0 else (0.0 if want == 0 else float("inf"))
    return errors


@dataclass(frozen=True, slots=True)
class VerifiedLayout:
    label: str  # "pick", "current" or "pick (= current)"
    description: str
    predicted: Prediction
    replay: Replay

    @property
    def errors(self) -> dict[str, float]:
        return relative_errors(self.predicted, self.replay.measured)

    @property
    def num_failed(self) -> int:
        return sum(1 for r in self.replay.results if not r.success)

    @property
    def num_cut(self) -> int:
        return sum(1 for r in self.replay.results if r.error == CUT)


def verify_layout(
    label: str,
    description: str,
    resource: Path,
    name: str,
    model: str,
    workload: ReplayWorkload,
    predicted: Prediction,
    slo: Slo,
    num_workers: int,
    home: Path,
    note: Callable[[str], None],
    budget_s: float = math.inf,
) -> VerifiedLayout:
    """Bring ``resource`` up in ``home``, replay the workload against it, and bring it down, all within
    ``budget_s`` (the replay is cut there)."""
    began = time.monotonic()
    deadline = began + budget_s
    note(f"verify: starting {label} ({description}) from {resource}")
    with LocalEndpoint(resource, home, name) as endpoint:
        endpoint.wait_ready(min(READY_TIMEOUT_S, budget_s))
        model = served_model(endpoint.url, model)
        pool = token_pool(endpoint.url, model)
        note(
            f"verify: replaying {len(workload.requests)} requests against {label} at {endpoint.url}: predicted "
            f"{predicted.duration_s:.0f} s (up in {time.monotonic() - began:.0f} s; cut "
            f"{max(0.0, deadline - time.monotonic()):.0f} s from now at the latest)"
        )
        result = replay(endpoint.url, model, workload, pool, slo, num_workers, deadline)
    return VerifiedLayout(label, description, predicted, result)


def fitting_requests(
    workload: ReplayWorkload, replay_s: float, predict_duration: Callable[[Sequence[TraceRequest]], float]
) -> int:
    """The most leading requests of ``workload`` whose replay ``predict_duration`` says takes at most ``replay_s``
    seconds (at least one)."""
    requests = workload.requests
    if not requests or predict_duration(requests) <= replay_s:
        return len(requests)
    low, high = 1, len(requests)  # low fits (or is the least we replay), high does not
    while high - low > 1:
        middle = (low + high) // 2
        if predict_duration(requests[:middle]) <= replay_s:
            low = middle
        else:
            high = middle
    return low


def format_verify_table(layouts: Sequence[VerifiedLayout]) -> str:
    """Predicted against measured, per layout and figure, with the relative error."""
    lines = [f"{'layout':<10} {'figure':<22} {'predicted':>10} {'measured':>10} {'error':>7}"]
    for layout in layouts:
        measured, predicted = layout.replay.measured, layout.predicted
        rows: list[tuple[str, float, float, float | None]] = [
            (f, getattr(predicted, f), getattr(measured, f), layout.errors[f]) for f in FIGURES
        ]
        rows.append(("goodput_requests_per_s", predicted.goodput_requests_per_s, measured.goodput_requests_per_s, None))
        for figure, want, got, error in rows:
            shown = "" if error is None else f"{error * 100:6.1f}%"
            lines.append(f"{layout.label:<10} {figure:<22} {want:>10.3f} {got:>10.3f} {shown:>7}")
        cached = sum(r.cached_tokens for r in layout.replay.results)
        lines.append(f"{layout.label:<10} prompt tokens the engines reported cached: {cached:,}")
        if layout.num_failed:
            cut = f", {layout.num_cut} of them {CUT}" if layout.num_cut else ""
            lines.append(f"{layout.label:<10} {layout.num_failed} request(s) failed{cut} (left out of the figures)")
    return "\n".join(lines)


def verify_json(layouts: Sequence[VerifiedLayout]) -> dict[str, Any]:
    """``verify``: per layout its predicted and measured figures and errors; ``max_relative_error`` over all."""
    from splitserve.planner.recommend import prediction_json

    entries = []
    for layout in layouts:
        entries.append({
            "label": layout.label,
            "layout": layout.description,
            "predicted": prediction_json(layout.predicted),
            "measured": prediction_json(layout.replay.measured),
            "relative_error": {k: round(v, 4) for k, v in layout.errors.items()},
            "num_failed": layout.num_failed,
            "num_cut": layout.num_cut,
            "requests": [_result_json(r) for r in layout.replay.results],
        })  # fmt: skip
    worst = max((e for layout in layouts for e in layout.errors.values()), default=0.0)
    return {"figures": list(FIGURES), "max_relative_error": round(worst, 4), "layouts": entries}


def _result_json(result: RequestResult) -> dict[str, Any]:
    return {
        "success": result.success,
        "start_s": round(result.start_s, 4),
        "ttft_s": None if result.ttft_s is None else round(result.ttft_s, 5),
        "itl_s": [round(x, 5) for x in result.itl_s],
        "output_tokens": result.output_tokens,
        "cached_tokens": result.cached_tokens,
        "error": result.error,
    }

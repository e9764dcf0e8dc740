"""The planner's replay workload, the measured figures and their errors, the rate sweep and its crossover, and
the plots (no endpoint: ``--verify`` against real processes is tests/e2e/test_planner_verify_e2e.py)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from splitserve.bench.client import RequestResult
from splitserve.bench.datasets import BenchRequest
from splitserve.cli import app
from splitserve.config import RoutingStrategy
from splitserve.planner.calibrate import calibration_key
from splitserve.planner.command import _crossover, crossover_line
from splitserve.planner.costs import save_cached
from splitserve.planner.recommend import Candidate, Layout
from splitserve.planner.simulate import Prediction, Slo
from splitserve.planner.verify import (
    CUT,
    _common_prefix,
    _CutAt,
    client_headers,
    fitting_requests,
    measured_figures,
    relative_errors,
    replay_workload,
    warm_up_lengths,
)
from splitserve.planner.workload import TraceRequest, WorkloadShape, with_prompt_tokens
from tests.support.paths import EXAMPLES
from tests.support.planner import calibration

PNG = b"\x89PNG\r\n\x1a\n"


def test_a_chat_turn_shares_the_previous_prompt_not_the_answer_the_engine_never_saw() -> None:
    turns = [
        TraceRequest(0.0, 200, 50, "chat-0", 0),
        TraceRequest(1.0, 300, 40, "chat-0", 250),  # the history: 200 of prompt + 50 of answer
        TraceRequest(2.0, 400, 30, "chat-0", 340),
    ]
    replayed = replay_workload(turns)
    assert [r.prefix_tokens for r in replayed.requests] == [0, 200, 300]
    assert [len(p) for p in replayed.prompts] == [200, 300, 400]
    first, second, third = replayed.prompts
    assert _common_prefix(first, second) == 200 and _common_prefix(second, third) == 300
    assert replayed.num_shared_tokens == 500


def test_a_document_is_shared_by_its_questions_and_by_nothing_else() -> None:
    requests = [
        TraceRequest(0.0, 1060, 10, "doc-1", 1000),
        TraceRequest(0.5, 80, 10),
        TraceRequest(1.0, 1030, 10, "doc-1", 1000),
        TraceRequest(1.5, 530, 10, "doc-2", 500),
    ]
    replayed = replay_workload(requests)
    assert [r.prefix_tokens for r in replayed.requests] == [0, 0, 1000, 0]
    a, b, c, d = replayed.prompts
    assert _common_prefix(a, c) == 1000
    assert not set(b) & (set(a) | set(c) | set(d)) and not set(d) & set(a)
    assert [r.arrival_s for r in replayed.requests] == [0.0, 0.5, 1.0, 1.5]  # everything else is kept


def test_the_warm_up_is_no_longer_than_the_workloads_longest_prompt() -> None:
    short = replay_workload([TraceRequest(0.0, 120, 8), TraceRequest(0.5, 180, 8)])
    assert warm_up_lengths(short) == (64, 180)
    long = replay_workload([TraceRequest(0.0, 6000, 8), TraceRequest(0.5, 40, 8)])
    assert warm_up_lengths(long) == (64, 512, 2048)
    assert warm_up_lengths(replay_workload([TraceRequest(0.0, 30, 8)])) == (30,)


def test_symbols_become_ids_of_the_pool_the_same_way_every_time() -> None:
    replayed = replay_workload([TraceRequest(0.0, 64, 4, "g", 0), TraceRequest(0.1, 96, 4, "g", 68)])
    pool = list(range(1000, 1300))
    ids = replayed.token_ids(pool)
    assert ids == replayed.token_ids(pool)
    assert all(t in pool for prompt in ids for t in prompt)
    assert ids[1][:64] == ids[0] and len(ids[1]) == 96
    assert len(set(ids[0])) > 40  # spread over the pool, not one id
    with pytest.raises(ValueError, match="pool is empty"):
        replayed.token_ids([])


def test_the_replay_sends_the_client_key_the_endpoint_gets_from_this_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert client_headers() == {}
    monkeypatch.setenv("VLLM_API_KEY", "k2")
    assert client_headers() == {"Authorization": "Bearer k2"}
    monkeypatch.setenv("SPLITSERVE_API_KEY", "k1")
    assert client_headers() == {"Authorization": "Bearer k1"}


def result(start_s: float, ttft_s: float, itl_s: list[float], output_tokens: int, ok: bool = True) -> RequestResult:
    return RequestResult(success=ok, max_tokens=output_tokens, start_s=start_s, ttft_s=ttft_s, itl_s=itl_s,
                         output_tokens=output_tokens, usage_reported=True)  # fmt: skip


def test_the_replay_is_counted_as_the_simulator_counts() -> None:
    results = [
        result(0.0, 0.5, [0.1, 0.1], 3),  # tokens at 0.5, 0.6, 0.7
        result(1.0, 1.5, [0.3], 4),  # a chunk carried 3 tokens: tokens at 2.5 and 2.8
        result(1.0, 9.0, [], 1, ok=False),  # failed: left out
    ]
    measured = measured_figures(results, Slo(ttft_s=1.0, itl_s=0.2))
    assert measured.num_requests == 2
    assert measured.duration_s == pytest.approx(2.8)
    assert measured.ttft_p50_s == pytest.approx(1.0)  # of 0.5 and 1.5
    assert measured.output_tokens_per_s == pytest.approx(7 / 2.8)  # the tokens the server reported
    assert measured.goodput_requests_per_s == pytest.approx(1 / 2.8)  # the second: TTFT and its ITL too long


def prediction(**figures: float) -> Prediction:
    base = dict.fromkeys(("duration_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "output_tokens_per_s",
                          "requests_per_s", "goodput_requests_per_s", "slo_attainment"), 1.0)  # fmt: skip
    return Prediction(num_requests=1, utilization={}, **(base | figures))  # type: ignore[arg-type]


def test_relative_errors_are_taken_against_the_measurement() -> None:
    errors = relative_errors(prediction(ttft_p50_s=1.2, itl_p99_s=0.05), prediction(ttft_p50_s=1.0, itl_p99_s=0.1))
    assert errors == pytest.approx({"ttft_p50_s": 0.2, "ttft_p99_s": 0.0, "itl_p99_s": 0.5, "output_tokens_per_s": 0})


def layout(colocated: bool) -> Layout:
    if colocated:
        return Layout(2, 0, 0, 1, None, RoutingStrategy.ROUNDROBIN)
    return Layout(0, 1, 1, 1, 2048, RoutingStrategy.ROUNDROBIN)


def test_the_crossover_is_where_the_pick_turns_disaggregated_and_stays() -> None:
    picks = [(0.1, layout(True)), (0.2, layout(True)), (0.4, layout(False)), (0.8, layout(False))]
    line = crossover_line(WorkloadShape.LONG_CONTEXT, picks)
    assert line == "long-context: DPD (1P1D) pays off from 0.4 req/s (between 0.2 and 0.4 req/s); below that, colocated"
    assert "colocated is the pick at every rate" in crossover_line(WorkloadShape.CHAT, picks[:2])
    assert "disaggregation is the pick at every rate" in crossover_line(WorkloadShape.RAG, picks[2:])
    flapping = [(0.1, layout(False)), (0.2, layout(True)), (0.4, layout(False))]
    assert crossover_line(WorkloadShape.MIXED, flapping) == (
        "mixed: the pick changes over the rates swept: DPD at 0.1 req/s; colocated at 0.2 req/s; DPD at 0.4 req/s"
    )
    band = [(500.0, layout(True)), (2000.0, layout(False)), (4000.0, layout(False)), (6000.0, layout(True))]
    assert crossover_line(WorkloadShape.LONG_CONTEXT, band, by_rate=False) == (
        "long-context: the pick changes over the prompt lengths swept: colocated at 500 tokens; "
        "DPD from 2000 to 4000 tokens; colocated at 6000 tokens"
    )


def test_points_where_no_layout_serves_are_named_not_counted_in_the_crossover() -> None:
    def row(x: float, colocated: bool, attainment: float) -> dict[str, object]:
        return {"x": x, "pick": Candidate(layout(colocated), prediction(slo_attainment=attainment))}

    rows = [row(0.1, True, 0.9), row(0.2, False, 0.7), row(0.4, False, 0.3), row(0.8, True, 0.02)]
    assert _crossover(WorkloadShape.MIXED, rows, by_rate=True) == (
        "mixed: DPD (1P1D) pays off from 0.2 req/s (between 0.1 and 0.2 req/s); below that, colocated; "
        "at 0.8 req/s no layout keeps 10% of the requests within the SLO"
    )


def test_a_rate_sweep_writes_each_familys_curve_the_crossover_and_the_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    save_cached(calibration(calibration_key("smollm2")))
    report, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    args = ["plan", "-f", str(EXAMPLES / "dpd.yaml"), "--workload", "long-context", "--num-requests", "30",
            "--sweep-rates", "0.2,0.02,0.05", "--json", str(report), "--plot", str(png)]  # fmt: skip
    outcome = CliRunner().invoke(app, args)
    assert outcome.exit_code == 0, outcome.output
    document = json.loads(report.read_text())
    assert document["axis"] == "rate" and document["rate"] == [0.02, 0.05, 0.2]
    assert set(document["families"]) == {"colocated x1", "colocated x2", "1P1D"}
    assert all(len(points) == 3 for points in document["families"].values())
    assert document["crossover"].startswith("long-context: ") and document["crossover"] in outcome.output
    assert len(document["picks"]) == 3
    assert png.read_bytes().startswith(PNG)


def test_a_prompt_length_sweep_sets_every_prompt_and_states_its_crossover_in_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    save_cached(calibration(calibration_key("smollm2")))
    report = tmp_path / "sweep.json"
    args = ["plan", "-f", str(EXAMPLES / "dpd.yaml"), "--workload", "long-context", "--rate", "0.05",
            "--num-requests", "30", "--sweep-prompt-tokens", "6000,500", "--json", str(report)]  # fmt: skip
    outcome = CliRunner().invoke(app, args)
    assert outcome.exit_code == 0, outcome.output
    document = json.loads(report.read_text())
    assert document["axis"] == "prompt_tokens" and document["prompt_tokens"] == [500, 6000]
    assert "prompt length" in document["crossover"] or "-token prompts" in document["crossover"]
    ttft = document["families"]["colocated x1"]
    assert ttft[0]["ttft_p99_s"] < ttft[1]["ttft_p99_s"]  # longer prompts take longer
    picks = [(500.0, layout(True)), (6000.0, layout(False))]
    assert crossover_line(WorkloadShape.CHAT, picks, by_rate=False) == (
        "chat: DPD (1P1D) pays off from 6000-token prompts (between 500 and 6000 tokens); below that, colocated"
    )


def test_every_prompt_gets_the_length_and_keeps_its_prefix_below_it() -> None:
    requests = [TraceRequest(0.0, 3000, 100, "doc", 2500), TraceRequest(1.0, 800, 7000)]
    fixed = with_prompt_tokens(requests, 2000, max_model_len=8192)
    assert [(r.prompt_tokens, r.prefix_tokens) for r in fixed] == [(2000, 1999), (2000, 0)]
    assert fixed[1].output_tokens == 4096  # fitted into the context as generated requests are


def test_a_sweep_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    dpd = str(EXAMPLES / "dpd.yaml")
    outcome = CliRunner().invoke(app, ["plan", "-f", dpd, "--sweep-rates", "0.1,0.2", "--verify"])
    assert outcome.exit_code == 2 and "they take no --trace, --verify or --out" in outcome.output
    outcome = CliRunner().invoke(app, ["plan", "-f", dpd, "--sweep-rates", "0.1", "--sweep-prompt-tokens", "100"])
    assert outcome.exit_code == 2 and "not both" in outcome.output
    outcome = CliRunner().invoke(app, ["plan", "-f", dpd, "--sweep-rates", "0.1,fast"])
    assert outcome.exit_code == 2 and "--sweep-rates: 'fast' is not valid" in outcome.output


def test_the_candidates_plot_is_drawn_without_verify(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    save_cached(calibration(calibration_key("smollm2")))
    png = tmp_path / "plan.png"
    args = ["plan", "-f", str(EXAMPLES / "dpd.yaml"), "--num-requests", "30", "--plot", str(png)]
    outcome = CliRunner().invoke(app, args)
    assert outcome.exit_code == 0, outcome.output
    assert png.read_bytes().startswith(PNG)


def test_the_replay_is_cut_to_the_leading_requests_the_prediction_says_fit() -> None:
    requests = [TraceRequest(arrival_s=float(i), prompt_tokens=100, output_tokens=10) for i in range(100)]
    workload = replay_workload(requests)
    predict = lambda rs: 2.0 * len(rs)  # noqa: E731 -- an overloaded layout: each request adds 2 s
    assert fitting_requests(workload, 200.0, predict) == 100  # all fit
    assert fitting_requests(workload, 61.0, predict) == 30
    assert fitting_requests(workload, 0.5, predict) == 1  # one request at least
    first = workload.first(30)
    assert first.requests == workload.requests[:30] and first.prompts == workload.prompts[:30]


def test_a_request_the_time_runs_out_on_fails_as_cut_and_is_counted() -> None:
    """Each request of the replay ends at the deadline: one still streaming, and one not yet sent, fail as cut."""

    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(5)
        return httpx.Response(200, text="data: [DONE]\n\n")

    async def main() -> list[RequestResult]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(slow)) as http:
            client = _CutAt(http, "http://endpoint", "m", time.monotonic() + 0.2)
            running = await client.send(BenchRequest(max_tokens=4, prompt=[1, 2]))
            late = await client.send(BenchRequest(max_tokens=4, prompt=[1, 2]))
            return [running, late]

    began = time.monotonic()
    results = asyncio.run(main())
    assert time.monotonic() - began < 2
    assert [(r.success, r.error) for r in results] == [(False, CUT), (False, CUT)]

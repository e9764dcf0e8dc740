"""splitserve bench plots: the series they draw, rate sweeps with goodput, and the PNG-writing commands."""

from __future__ import annotations

import asyncio
import io
import json
import math
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from typer.testing import CliRunner

from splitserve.bench.client import RequestResult
from splitserve.bench.datasets import DatasetConfig
from splitserve.bench.metrics import Slo, meets_slo, summarize
from splitserve.bench.plots import PlotKind, plot_cdf, plot_results, plot_sweep, plot_timeline, pyplot
from splitserve.bench.report import load_json, results_from_json
from splitserve.bench.runner import ServeConfig
from splitserve.bench.series import (
    SweepPoint,
    by_endpoint,
    cdf_points,
    chunk_times_s,
    default_bin_s,
    in_flight_over_time,
    sweep_point,
    throughput_over_time,
)
from splitserve.bench.sweep import (
    SweepConfig,
    load_sweep,
    parse_endpoint,
    parse_rates,
    parse_slo,
    run_sweep,
)
from splitserve.cli import app
from tests.support.fake_openai import FakeOpenAI, stub_app


def _ok(start_s: float, ttft_s: float, itl_s: list[float], output_tokens: int = 0, e2e_s: float = 0.0) -> RequestResult:
    """A successful result with one token per chunk unless ``output_tokens`` says otherwise."""
    tokens = output_tokens or len(itl_s) + 1
    e2e_s = e2e_s or ttft_s + sum(itl_s)
    return RequestResult(True, tokens, start_s=start_s, e2e_s=e2e_s, ttft_s=ttft_s, itl_s=itl_s, output_tokens=tokens)


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000  # a drawn figure, not an empty one
    width, height = struct.unpack(">II", data[16:24])
    return width, height


# ---------------------------------------------------------------------------------------------------------
# The series


def test_cdf_points_are_sorted_values_with_cumulative_fractions() -> None:
    assert cdf_points([3.0, 1.0, 2.0, 2.0]) == ([1.0, 2.0, 2.0, 3.0], [0.25, 0.5, 0.75, 1.0])
    assert cdf_points([]) == ([], [])


def test_chunk_times_add_each_gap_to_the_first_chunk() -> None:
    assert chunk_times_s(_ok(1.0, 0.5, [0.25, 0.25, 1.0])) == [1.5, 1.75, 2.0, 3.0]
    assert chunk_times_s(RequestResult(False, 4, start_s=2.0, e2e_s=1.0)) == []


def test_in_flight_counts_overlaps_and_ends_before_starts() -> None:
    first = _ok(0.0, 0.5, [], e2e_s=2.0)  # [0, 2)
    second = RequestResult(False, 4, start_s=1.0, e2e_s=2.0, error="HTTP 500")  # [1, 3): failed ones count too
    third = _ok(3.0, 0.5, [], e2e_s=1.0)  # [3, 4): starts exactly when the second ends
    times_s, counts = in_flight_over_time([third, first, second])
    assert times_s == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert counts == [1, 2, 1, 1, 0]
    assert in_flight_over_time([_ok(0.5, 0.1, [])]) == ([0.0, 0.5, 0.6], [0, 1, 0])


def test_throughput_spreads_reported_tokens_over_chunks_and_skips_failures() -> None:
    one_token_chunks = _ok(0.0, 0.25, [0.5, 0.5])  # chunks at 0.25, 0.75, 1.25
    two_token_chunks = _ok(1.0, 0.25, [0.5], output_tokens=4)  # chunks at 1.25, 1.75
    failed = RequestResult(False, 3, start_s=0.0, ttft_s=0.1, itl_s=[0.1], output_tokens=9, error="x")
    results = [one_token_chunks, two_token_chunks, failed]
    assert throughput_over_time(results, bin_s=1.0) == ([0.0, 1.0], [2.0, 5.0])
    starts_s, tokens_per_s = throughput_over_time(results, bin_s=0.5)
    assert starts_s == [0.0, 0.5, 1.0, 1.5] and tokens_per_s == [2.0, 2.0, 6.0, 4.0]
    assert sum(tokens_per_s) * 0.5 == summarize(results, 2.0).total_output_tokens
    assert throughput_over_time([failed], bin_s=1.0) == ([], [])
    with pytest.raises(ValueError, match="bin_s must be > 0, got 0"):
        throughput_over_time(results, bin_s=0.0)


def test_default_bin_is_a_round_width_for_about_fifty_bins() -> None:
    assert default_bin_s(100.0) == 2.0 and default_bin_s(3.0) == pytest.approx(0.1)
    assert default_bin_s(0.0) == 0.001


# ---------------------------------------------------------------------------------------------------------
# Goodput and sweep points


def _goodput_results() -> list[RequestResult]:
    return [
        _ok(0.0, 0.5, [0.05] * 10),  # within both limits
        _ok(0.0, 1.5, [0.05] * 10),  # TTFT over
        _ok(0.0, 0.5, [0.05] * 98 + [0.5] * 2),  # its own ITL p99 is 0.5 s: over
        _ok(0.0, 0.5, [0.05] * 199 + [0.5]),  # one slow gap in 200 leaves its p99 at 0.05 s: within
        _ok(0.0, 1.0, []),  # TTFT exactly at the limit, no gaps: within
        RequestResult(False, 4, e2e_s=0.1, error="HTTP 500: boom"),
    ]


def test_goodput_counts_exactly_the_requests_within_both_limits() -> None:
    slo = Slo(ttft_s=1.0, itl_s=0.1)
    results = _goodput_results()
    assert [meets_slo(r, slo) for r in results] == [True, False, False, True, True, False]
    point = sweep_point("dpd", 2.0, summarize(results, duration_s=2.0), results, slo, result_path="x.json")
    assert (point.endpoint, point.request_rate, point.result_path) == ("dpd", 2.0, "x.json")
    assert (point.num_completed, point.num_failed, point.num_good) == (5, 1, 3)
    assert point.goodput == 1.5 and point.request_throughput == 2.5 and point.slo_attainment == 0.5
    assert point.ttft_p50_ms == pytest.approx(500.0)


def test_sweep_point_of_a_run_where_nothing_completed_is_nan_not_an_error() -> None:
    results = [RequestResult(False, 4, e2e_s=0.1, error="x")]
    point = sweep_point("down", 1.0, summarize(results, 1.0), results, Slo(1.0, 0.1))
    assert point.num_good == 0 and point.goodput == 0.0 and math.isnan(point.ttft_p99_ms)


def test_by_endpoint_keeps_first_appearance_order_and_sorts_by_rate() -> None:
    points = [_point("b", 2.0), _point("a", 1.0), _point("b", 1.0)]
    lines = by_endpoint(points)
    assert list(lines) == ["b", "a"] and [p.request_rate for p in lines["b"]] == [1.0, 2.0]


def _point(endpoint: str, rate: float, ttft_p99_ms: float = 100.0) -> SweepPoint:
    return SweepPoint(endpoint, rate, 10, 0, 8, 5.0, 50.0, ttft_p99_ms, 20.0, 100.0 * rate, rate, 0.8 * rate)


# ---------------------------------------------------------------------------------------------------------
# Parsing the sweep's options


def test_parse_slo_rates_and_endpoints() -> None:
    assert parse_slo("ttft_p99=2s,itl_p99=150ms") == Slo(2.0, 0.15)
    assert parse_slo("itl_p99=0.3", Slo(9.0, 1.0)) == Slo(9.0, 0.3)
    with pytest.raises(ValueError, match="expected ttft_p99=DURATION"):
        parse_slo("e2e=3s")
    with pytest.raises(ValueError, match="not a duration"):
        parse_slo("ttft_p99=fast")
    assert parse_rates("0.5, 1,2,4") == (0.5, 1.0, 2.0, 4.0)
    with pytest.raises(ValueError, match="--rates"):
        parse_rates("1,two")
    assert parse_endpoint("dpd=http://127.0.0.1:8081") == ("dpd", "http://127.0.0.1:8081")
    assert parse_endpoint("http://127.0.0.1:8080/v1") == ("127.0.0.1_8080", "http://127.0.0.1:8080/v1")


@pytest.mark.parametrize(
    ("endpoints", "rates", "message"),
    [
        ((), (1.0,), "one or more endpoints"),
        ((("a", "http://x"), ("a", "http://y")), (1.0,), "distinct names"),
        ((("a/b", "http://x"),), (1.0,), "letters, digits"),
        ((("a", "http://x"),), (1.0, math.inf), "finite and > 0"),
        ((("a", "http://x"),), (), "finite and > 0"),
    ],
)
def test_sweep_config_rejects_bad_values(
    endpoints: tuple[tuple[str, str], ...], rates: tuple[float, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        SweepConfig(ServeConfig(url="", model="m"), endpoints, rates).validate()


# ---------------------------------------------------------------------------------------------------------
# A whole sweep against fake endpoints


def test_run_sweep_runs_rate_by_rate_and_writes_results_and_summary(tmp_path: Path) -> None:
    up, down = FakeOpenAI(), FakeOpenAI(fail_every=1)
    hosts: list[str] = []

    async def handle(request: httpx.Request) -> httpx.Response:
        hosts.append(request.url.host)
        return await (up if request.url.host == "up" else down).handle(request)

    pauses: list[float] = []

    async def sleep(seconds: float) -> None:
        pauses.append(seconds)

    workload = ServeConfig(
        url="",
        model="m",
        dataset_config=DatasetConfig(random_input_len=8, random_output_len=3),
        num_prompts=4,
        show_progress=False,
    )
    endpoints = (("up", "http://up"), ("down", "http://down:8000"))
    config = SweepConfig(workload, endpoints, (400.0, 800.0), Slo(60.0, 60.0), json_dir=tmp_path, pause_s=0.5)
    printed = io.StringIO()
    points = asyncio.run(run_sweep(config, transport=httpx.MockTransport(handle), out=printed, sleep=sleep))

    assert [(p.endpoint, p.request_rate) for p in points] == [("up", 400), ("down", 400), ("up", 800), ("down", 800)]
    assert hosts == ["up"] * 4 + ["down"] * 4 + ["up"] * 4 + ["down"] * 4 and pauses == [0.5] * 3
    assert [(p.num_completed, p.num_good) for p in points] == [(4, 4), (0, 0), (4, 4), (0, 0)]
    assert {p["prompt"] for p in up.payloads[:4]}.isdisjoint(p["prompt"] for p in up.payloads[4:])  # own seed
    first = load_json(tmp_path / "up_rate400.json")
    assert first["label"] == "up@400" and first["args"]["request_rate"] == 400.0 and first["args"]["seed"] == 0
    assert load_json(tmp_path / "down_rate800.json")["args"]["seed"] == 3
    summary = json.loads((tmp_path / "sweep.json").read_text())
    assert summary["endpoints"] == dict(endpoints) and summary["rates"] == [400.0, 800.0]
    assert summary["points"][1]["ttft_p99_ms"] is None and "url" not in summary["args"]
    loaded, slo = load_sweep(tmp_path / "sweep.json")
    assert slo == Slo(60.0, 60.0) and [p.endpoint for p in loaded] == [p.endpoint for p in points]
    assert loaded[0] == points[0] and math.isnan(loaded[1].ttft_p99_ms)
    assert "Sweep (SLO: TTFT <= 60000 ms" in printed.getvalue() and "--- down at 800 req/s" in printed.getvalue()


def test_load_sweep_rejects_a_single_run_result(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    path.write_text('{"summary": {}}')
    with pytest.raises(ValueError, match="not a splitserve bench sweep summary"):
        load_sweep(path)


def test_results_from_json_accept_older_records_and_drop_derived_fields() -> None:
    record = {"success": True, "max_tokens": 3, "start_s": 1.0, "e2e_s": 0.5, "ttft_s": 0.1, "itl_s": [0.2]}
    [result] = results_from_json({"requests": [record | {"tpot_s": 0.2}]})
    assert result.session_id is None and result.round_index == 0 and chunk_times_s(result) == [1.1, 1.3]


# ---------------------------------------------------------------------------------------------------------
# PNGs


def test_plot_functions_write_pngs_with_four_panels(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    results = _goodput_results()
    plot_timeline({"a": results, "b": results[:2]}, tmp_path / "timeline.png", title="t")
    assert _png_size(tmp_path / "timeline.png") == (1320, 900)
    points = [_point("colocated", r, 100.0 * r) for r in (0.5, 1.0, 2.0)] + [_point("dpd", 1.0, math.nan)]
    plot_sweep(points, tmp_path / "sweep.png", slo=Slo(2.0, 0.2))
    assert _png_size(tmp_path / "sweep.png") == (1320, 900)
    plot_cdf({"predicted": [1.0, 2.0], "measured": [1.5, 2.5, 3.0]}, tmp_path / "cdf.png", xlabel="TTFT (ms)")
    assert _png_size(tmp_path / "cdf.png") == (840, 540)


def test_plotting_without_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(RuntimeError, match=r"pip install 'splitserve\[plot\]'"):
        pyplot()
    args = ["bench", "serve", "--url", "http://127.0.0.1:9", "--model", "m", "--plot", "x.png"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "splitserve[plot]" in result.output  # before sending anything


def test_plot_kind_sweep_wants_exactly_one_summary(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="one sweep summary, got 2 files"):
        plot_results([tmp_path / "a.json", tmp_path / "b.json"], tmp_path / "x.png", kind=PlotKind.SWEEP)


# ---------------------------------------------------------------------------------------------------------
# The commands, against real HTTP servers in threads


@contextmanager
def _servers(count: int) -> Iterator[list[tuple[str, FakeOpenAI]]]:
    running = []
    for _ in range(count):
        fake = FakeOpenAI(chunk_delay_s=0.001)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(stub_app(fake), log_level="error", lifespan="off"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        running.append((server, thread, sock, fake))
    deadline = time.monotonic() + 10
    while not all(server.started for server, *_ in running) and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield [(f"http://127.0.0.1:{sock.getsockname()[1]}", fake) for _, _, sock, fake in running]
    finally:
        for server, thread, sock, _ in running:
            server.should_exit = True
            thread.join(timeout=5)
            sock.close()


_SMALL = ["--model", "m", "--random-input-len", "8", "--random-output-len", "4", "--num-prompts", "6"]


def test_cli_serve_plot_and_replot_a_timeline(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    with _servers(1) as [(url, _)]:
        args = ["bench", "serve", "--url", url, *_SMALL, "--request-rate", "200", "--no-progress"]
        args += ["--json", str(tmp_path / "run.json"), "--plot", str(tmp_path / "run.png"), "--label", "stub"]
        result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert f"wrote {tmp_path / 'run.png'}" in result.output
    assert _png_size(tmp_path / "run.png") == (1320, 900)
    replot = ["bench", "plot", "--kind", "timeline", str(tmp_path / "run.json"), "--out", str(tmp_path / "again.png")]
    result = CliRunner().invoke(app, replot)
    assert result.exit_code == 0, result.output
    assert _png_size(tmp_path / "again.png") == (1320, 900)


def test_cli_sweep_two_endpoints_writes_results_summary_and_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    with _servers(2) as [(url_a, fake_a), (url_b, fake_b)]:
        args = ["bench", "sweep", "--url", f"colocated={url_a}", "--url", f"dpd={url_b}", "--rates", "100,200"]
        args += [*_SMALL, "--slo", "ttft_p99=30s,itl_p99=10s", "--no-progress", "--json-dir", str(tmp_path)]
        args += ["--plot", str(tmp_path / "sweep.png")]
        result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert len(fake_a.payloads) == len(fake_b.payloads) == 12
    names = sorted(p.name for p in tmp_path.glob("*.json"))
    assert names == [f"{name}_rate{rate}.json" for name in ("colocated", "dpd") for rate in (100, 200)] + ["sweep.json"]
    points, slo = load_sweep(tmp_path / "sweep.json")
    assert slo == Slo(30.0, 10.0) and all(p.num_good == p.num_completed == 6 for p in points)
    assert _png_size(tmp_path / "sweep.png") == (1320, 900)
    replot = ["bench", "plot", "--kind", "sweep", str(tmp_path / "sweep.json"), "--out", str(tmp_path / "re.png")]
    result = CliRunner().invoke(app, replot)
    assert result.exit_code == 0, result.output
    assert _png_size(tmp_path / "re.png") == (1320, 900)


def test_cli_sweep_rejects_bad_options_and_exits_1_when_nothing_succeeds() -> None:
    base = ["bench", "sweep", "--model", "m", "--num-prompts", "1", "--no-progress"]
    bad_slo = CliRunner().invoke(app, [*base, "--url", "a=http://x", "--rates", "1", "--slo", "p50=1s"])
    assert bad_slo.exit_code == 2 and "ttft_p99=DURATION" in bad_slo.output
    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    refused = CliRunner().invoke(app, [*base, "--url", f"gone={url}", "--rates", "50"])
    assert refused.exit_code == 1 and "ConnectError" in refused.output

"""splitserve bench: datasets, metrics, the streaming client and whole runs against fake OpenAI servers."""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import math
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from typer.testing import CliRunner

from splitserve.bench.client import EndpointKind, OpenAIStreamClient, RequestResult, endpoint_url
from splitserve.bench.datasets import WORDS, BenchRequest, DatasetConfig, default_num_prompts, get_dataset
from splitserve.bench.metrics import percentile, summarize
from splitserve.bench.plots import PlotKind, plot_results
from splitserve.bench.report import load_json
from splitserve.bench.runner import ServeConfig, arrival_times, run_requests, serve, session_chains
from splitserve.cli import app
from tests.support.fake_openai import FakeClock, FakeOpenAI, stub_app


def _client(fake: FakeOpenAI, **kwargs: Any) -> tuple[OpenAIStreamClient, httpx.AsyncClient]:
    http = httpx.AsyncClient(transport=httpx.MockTransport(fake.handle))
    return OpenAIStreamClient(http, base_url="http://fake", model="m", **kwargs), http


async def _send(fake: FakeOpenAI, request: BenchRequest, **kwargs: Any) -> RequestResult:
    client, http = _client(fake, **kwargs)
    async with http:
        return await client.send(request)


# ---------------------------------------------------------------------------------------------------------
# Datasets


def test_random_dataset_is_deterministic_and_has_requested_lengths() -> None:
    cfg = DatasetConfig(random_input_len=100, random_output_len=20, random_range_ratio=0.5)
    first = get_dataset("random", cfg).sample(50, seed=3)
    assert first == get_dataset("random", cfg).sample(50, seed=3)
    assert first != get_dataset("random", cfg).sample(50, seed=4)
    for request in first:
        assert request.prompt is not None
        words = request.prompt.split()
        assert len(words) == request.approx_prompt_tokens
        assert 50 <= len(words) <= 150 and 10 <= request.max_tokens <= 30
        assert set(words) <= set(WORDS) and request.prompt.startswith(" ")
    assert len({r.approx_prompt_tokens for r in first}) > 10  # lengths actually vary


def test_random_dataset_with_zero_range_gives_exact_lengths() -> None:
    requests = get_dataset("random", DatasetConfig(random_input_len=64, random_output_len=8)).sample(5, 0)
    assert [(r.approx_prompt_tokens, r.max_tokens) for r in requests] == [(64, 8)] * 5
    assert len({r.prompt for r in requests}) == 5


def test_shared_prefix_dataset_interleaves_groups_with_unique_suffixes() -> None:
    cfg = DatasetConfig(shared_prefix_groups=3, shared_prefix_len=40, shared_suffix_len=5, random_output_len=9)
    requests = get_dataset("shared-prefix", cfg).sample(9, seed=1)
    prompts = [r.prompt or "" for r in requests]
    prefixes = [" ".join(p.split()[:40]) for p in prompts]
    assert prefixes[0] == prefixes[3] == prefixes[6] != prefixes[1]
    assert len(set(prefixes)) == 3
    assert len(set(prompts)) == 9
    assert all(len(p.split()) == 45 and r.max_tokens == 9 for p, r in zip(prompts, requests, strict=True))
    assert requests == get_dataset("shared-prefix", cfg).sample(9, seed=1)


def test_jsonl_dataset_reads_prompts_and_messages_and_cycles(tmp_path: Path) -> None:
    path = tmp_path / "reqs.jsonl"
    rows = [{"prompt": "hello there", "max_tokens": 5}, {"messages": [{"role": "user", "content": "hi"}]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    requests = get_dataset("jsonl", DatasetConfig(dataset_path=path, random_output_len=11)).sample(3, 0)
    assert requests[0] == BenchRequest(5, prompt="hello there", approx_prompt_tokens=2)
    assert requests[1].messages == [{"role": "user", "content": "hi"}] and requests[1].max_tokens == 11
    assert requests[2] == requests[0]
    assert requests[1].as_prompt() == "hi" and requests[0].as_messages()[0]["content"] == "hello there"


def test_jsonl_dataset_rejects_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        get_dataset("jsonl", DatasetConfig(dataset_path=path)).sample(1, 0)
    with pytest.raises(ValueError, match="--dataset-path"):
        get_dataset("jsonl", DatasetConfig())


def test_unknown_dataset_error_lists_the_names() -> None:
    with pytest.raises(ValueError, match="jsonl, multiround, random, shared-prefix"):
        get_dataset("sharegpt", DatasetConfig())


def test_dataset_config_validation_shows_values() -> None:
    with pytest.raises(ValueError, match=r"1\.5"):
        get_dataset("random", DatasetConfig(random_range_ratio=1.5))
    with pytest.raises(ValueError, match="users=0 rounds=3"):
        get_dataset("multiround", DatasetConfig(num_users=0, num_rounds=3))


def _multiround(num_users: int = 3, num_rounds: int = 4, **kwargs: Any) -> list[BenchRequest]:
    cfg = DatasetConfig(num_users=num_users, num_rounds=num_rounds, **kwargs)
    return get_dataset("multiround", cfg).sample(num_users * num_rounds, seed=5)


def test_multiround_rounds_extend_the_previous_round_of_the_same_user() -> None:
    requests = _multiround(shared_prefix_len=30, random_input_len=6, random_output_len=7)
    assert requests == _multiround(shared_prefix_len=30, random_input_len=6, random_output_len=7)
    # Round by round (every user's round 0, then every user's round 1, ...), users shuffled within a round
    rounds = [(r.round_index, r.session_id) for r in requests]
    assert [i for i, _ in rounds] == sorted(i for i, _ in rounds)
    assert sorted(s for i, s in rounds if i == 0) == ["user-0", "user-1", "user-2"]
    assert len({tuple(s for i, s in rounds if i == k) for k in range(2)}) == 2  # another order in each round
    system_prompts = {r.as_messages()[0]["content"] for r in requests}
    assert len(system_prompts) == 1 and len(next(iter(system_prompts)).split()) == 30
    for user in ("user-0", "user-1", "user-2"):
        rounds = [r for r in requests if r.session_id == user]
        assert [r.round_index for r in rounds] == [0, 1, 2, 3]
        for before, after in itertools.pairwise(rounds):
            messages = after.as_messages()
            assert messages[: len(before.as_messages())] == before.as_messages()
            assert [m["role"] for m in messages[len(before.as_messages()) :]] == ["assistant", "user"]
            assert len(messages[-2]["content"].split()) == 7 and len(messages[-1]["content"].split()) == 6
            assert after.as_prompt().startswith(before.as_prompt())  # also on the completions endpoint
        last = rounds[-1].as_messages()
        assert [m["role"] for m in last] == ["system"] + ["user", "assistant"] * 3 + ["user"]
        assert rounds[-1].approx_prompt_tokens == 30 + 4 * 6 + 3 * 7
    assert len({r.as_messages()[1]["content"] for r in requests}) == 3  # users ask different questions
    assert all(r.max_tokens == 7 and r.prompt is None for r in requests)


def test_multiround_without_a_system_prompt_starts_with_the_question() -> None:
    requests = _multiround(num_users=2, num_rounds=1, shared_prefix_len=0)
    assert [[m["role"] for m in r.as_messages()] for r in requests] == [["user"], ["user"]]


def test_multiround_user_history_opens_each_users_chat_with_a_document_of_their_own() -> None:
    plain = _multiround(num_users=2, num_rounds=3, shared_prefix_len=5, random_input_len=4, random_output_len=3)
    requests = _multiround(
        num_users=2, num_rounds=3, shared_prefix_len=5, random_input_len=4, random_output_len=3, user_history_len=50
    )
    first = {r.session_id: r.as_messages()[1]["content"] for r in requests if r.round_index == 0}
    documents = {user: text.split("\n\n")[0] for user, text in first.items()}
    assert all(len(d.split()) == 50 for d in documents.values()) and len(set(documents.values())) == 2
    for r in requests:  # every round of a user carries the document; otherwise the lengths are the plain chat's
        assert r.as_messages()[1]["content"].startswith(documents[r.session_id])
        assert r.approx_prompt_tokens == 50 + next(
            p.approx_prompt_tokens for p in plain if (p.session_id, p.round_index) == (r.session_id, r.round_index)
        )
    with pytest.raises(ValueError, match="user_history_len"):
        DatasetConfig(user_history_len=-1).validate()


def test_multiround_needs_num_prompts_equal_to_users_times_rounds() -> None:
    cfg = DatasetConfig(num_users=8, num_rounds=4)
    assert default_num_prompts("multiround", cfg) == 32 and default_num_prompts("random", cfg) == 100
    with pytest.raises(ValueError, match=r"8 \* 4 = 32 requests, but num_prompts is 100"):
        get_dataset("multiround", cfg).sample(100, seed=0)


# ---------------------------------------------------------------------------------------------------------
# Metrics


def test_percentile_interpolates_like_numpy() -> None:
    values = [random.Random(0).uniform(0, 100) for _ in range(37)]
    ordered = sorted(values)
    assert percentile(values, 0) == ordered[0] and percentile(values, 100) == ordered[-1]
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([10.0, 20.0], 90) == pytest.approx(19.0)
    assert math.isnan(percentile([], 50))


def test_summary_counts_failures_and_computes_tpot_and_pooled_itl() -> None:
    ok_a = RequestResult(True, 3, e2e_s=0.5, ttft_s=0.1, itl_s=[0.2, 0.2], prompt_tokens=10, output_tokens=3)
    ok_b = RequestResult(True, 2, e2e_s=0.3, ttft_s=0.2, itl_s=[0.1], prompt_tokens=5, output_tokens=2)
    one_token = RequestResult(True, 1, e2e_s=0.1, ttft_s=0.1, prompt_tokens=5, output_tokens=1)
    failed = RequestResult(False, 3, e2e_s=0.05, error="HTTP 500: boom", output_tokens=99)
    s = summarize([ok_a, ok_b, one_token, failed], duration_s=2.0)
    assert (s.num_completed, s.num_failed) == (3, 1)
    assert (s.total_prompt_tokens, s.total_output_tokens) == (20, 6)
    assert s.request_throughput == 1.5 and s.output_throughput == 3.0 and s.total_token_throughput == 13.0
    assert s.tpot.count == 2 and s.tpot.mean_ms == pytest.approx(150.0)  # (0.4/2 + 0.1/1) / 2
    assert s.itl.count == 3 and s.itl.p50_ms == pytest.approx(200.0)
    assert s.ttft.mean_ms == pytest.approx(400.0 / 3)
    assert s.e2e.p99_ms == pytest.approx(496.0)  # 300 + 0.98 * (500 - 300)


def test_summary_of_nothing_is_nan_not_an_error() -> None:
    s = summarize([RequestResult(False, 4, error="x")], duration_s=1.0)
    assert s.num_completed == 0 and math.isnan(s.ttft.mean_ms) and s.output_throughput == 0.0


def test_arrival_times_are_poisson_or_all_at_once() -> None:
    assert arrival_times(3, math.inf, 0) == [0.0, 0.0, 0.0]
    times = arrival_times(2000, 10.0, seed=1)
    assert times == arrival_times(2000, 10.0, seed=1)
    assert times[0] == 0.0 and all(b >= a for a, b in itertools.pairwise(times))
    assert times[-1] / 1999 == pytest.approx(0.1, rel=0.1)


# ---------------------------------------------------------------------------------------------------------
# The streaming client


def test_client_measures_ttft_itl_tpot_from_chunk_arrivals() -> None:
    clock = FakeClock()
    fake = FakeOpenAI(clock=clock, first_delay_s=0.5, chunk_delay_s=0.1)
    result = asyncio.run(_send(fake, BenchRequest(5, prompt=" a b"), clock=clock))
    assert result.success and result.error == "" and result.status_code == 200
    assert result.ttft_s == pytest.approx(0.5)
    assert result.itl_s == pytest.approx([0.1] * 4)
    assert result.e2e_s == pytest.approx(0.9)
    assert result.tpot_s == pytest.approx(0.1)
    assert (result.output_tokens, result.prompt_tokens, result.usage_reported) == (5, 7, True)


def test_client_payload_is_greedy_streaming_with_usage_and_ignore_eos() -> None:
    fake = FakeOpenAI()
    asyncio.run(_send(fake, BenchRequest(4, prompt=" x"), kind=EndpointKind.CHAT, ignore_eos=False))
    assert fake.payloads == [
        {
            "model": "m",
            "max_tokens": 4,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": False,
            "messages": [{"role": "user", "content": " x"}],
        }
    ]


def test_client_sends_the_session_id_as_header_and_user_field() -> None:
    fake = FakeOpenAI()
    request = BenchRequest(2, messages=[{"role": "user", "content": " q"}], session_id="user-3", round_index=1)
    result = asyncio.run(_send(fake, request, kind=EndpointKind.CHAT))
    assert result.success and (result.session_id, result.round_index) == ("user-3", 1)
    assert fake.session_headers == ["user-3"] and fake.payloads[0]["user"] == "user-3"
    asyncio.run(_send(fake, BenchRequest(2, prompt=" p")))
    assert fake.session_headers[1] is None and "user" not in fake.payloads[1]


def test_client_counts_chunks_when_the_server_reports_no_usage() -> None:
    result = asyncio.run(_send(FakeOpenAI(with_usage=False), BenchRequest(6, prompt=" a b c", approx_prompt_tokens=3)))
    assert result.success and result.output_tokens == 6 and result.num_chunks == 6
    assert not result.usage_reported and result.prompt_tokens == 3  # the prompt's word count


def test_client_keeps_the_cached_prompt_tokens_the_server_reports() -> None:
    events = [
        {"choices": [{"text": "a"}]},
        {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 1,
                                  "prompt_tokens_details": {"cached_tokens": 32}}},
    ]  # fmt: skip
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n"

    async def send() -> RequestResult:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
        async with httpx.AsyncClient(transport=transport) as http:
            return await OpenAIStreamClient(http, base_url="http://x", model="m").send(BenchRequest(1))

    result = asyncio.run(send())
    assert result.success and result.prompt_tokens == 40 and result.cached_tokens == 32


def test_client_returns_http_errors_and_exceptions_as_failed_results() -> None:
    failed = asyncio.run(_send(FakeOpenAI(fail_every=1), BenchRequest(3, prompt=" a")))
    assert not failed.success and failed.status_code == 500 and failed.error == "HTTP 500: boom"

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async def send_refused() -> RequestResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as http:
            return await OpenAIStreamClient(http, base_url="http://x", model="m").send(BenchRequest(3))

    refused = asyncio.run(send_refused())
    assert not refused.success and refused.error == "ConnectError: connection refused"


def test_client_reports_error_events_and_garbage_in_the_stream() -> None:
    async def send_body(body: bytes) -> RequestResult:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
        async with httpx.AsyncClient(transport=transport) as http:
            return await OpenAIStreamClient(http, base_url="http://x", model="m").send(BenchRequest(3))

    error_event = asyncio.run(send_body(b'data: {"error": {"message": "out of blocks"}}\n\n'))
    assert not error_event.success and error_event.error == "stream error: out of blocks"
    garbage = asyncio.run(send_body(b"data: {not json\n\n"))
    assert not garbage.success and garbage.error.startswith("JSONDecodeError")
    empty = asyncio.run(send_body(b"data: [DONE]\n\n"))
    assert not empty.success and empty.error == "stream ended without any content"


def test_endpoint_url_accepts_a_v1_suffix() -> None:
    assert endpoint_url("http://h:1/", EndpointKind.CHAT) == "http://h:1/v1/chat/completions"
    assert endpoint_url("http://h:1/v1", EndpointKind.COMPLETIONS) == "http://h:1/v1/completions"


# ---------------------------------------------------------------------------------------------------------
# Whole runs


def test_run_requests_respects_max_concurrency() -> None:
    fake = FakeOpenAI(chunk_delay_s=0.001)

    async def run() -> list[RequestResult]:
        client, http = _client(fake)
        async with http:
            requests = [BenchRequest(5, prompt=" a")] * 12
            results, duration_s = await run_requests(client, requests, [0.0] * 12, max_concurrency=3)
        assert duration_s > 0
        return results

    results = asyncio.run(run())
    assert all(r.success for r in results) and fake.max_in_flight == 3


def test_session_chains_keep_a_sessions_requests_together_in_list_order() -> None:
    requests = [
        BenchRequest(1, session_id="a"),
        BenchRequest(1),
        BenchRequest(1, session_id="b"),
        BenchRequest(1, session_id="a", round_index=1),
        BenchRequest(1),
    ]
    assert session_chains(requests) == [[0, 3], [1], [2], [4]]


def _run_sessions(fake: FakeOpenAI, requests: list[BenchRequest], **kwargs: Any) -> list[RequestResult]:
    async def run() -> list[RequestResult]:
        client, http = _client(fake, kind=EndpointKind.CHAT)
        async with http:
            results, _ = await run_requests(client, requests, [0.0] * len(requests), **kwargs)
        return results

    return asyncio.run(run())


def test_run_requests_sends_a_round_only_after_the_previous_round_finished() -> None:
    fake = FakeOpenAI(first_delay_s=0.01, chunk_delay_s=0.002)
    requests = _multiround(num_users=3, num_rounds=3, random_output_len=4, shared_prefix_len=8)
    results = _run_sessions(fake, requests)  # every request is due at once
    assert all(r.success for r in results)
    assert fake.max_in_flight == 3  # the users run concurrently, one request each at a time
    for user in ("user-0", "user-1", "user-2"):
        # On the server: each round starts after the previous round's stream ended.
        events = [(kind, num_questions) for kind, session, num_questions in fake.events if session == user]
        assert events == [("start", 1), ("end", 1), ("start", 2), ("end", 2), ("start", 3), ("end", 3)]
        # On the client clock: each round is sent after the previous answer was read to its end.
        rounds = [r for r in results if r.session_id == user]
        assert [r.round_index for r in rounds] == [0, 1, 2]
        for before, after in itertools.pairwise(rounds):
            assert after.start_s >= before.start_s + before.e2e_s


def test_run_requests_sessions_share_max_concurrency_with_plain_requests() -> None:
    fake = FakeOpenAI(chunk_delay_s=0.001)
    requests = _multiround(num_users=4, num_rounds=2, random_output_len=3) + [BenchRequest(3, prompt=" a")] * 4
    results = _run_sessions(fake, requests, max_concurrency=2)
    assert all(r.success for r in results) and len(fake.payloads) == 12
    assert fake.max_in_flight == 2
    assert [r.session_id for r in results[8:]] == [None] * 4


def test_serve_multiround_records_sessions_rounds_and_ttft_by_round(tmp_path: Path) -> None:
    fake = FakeOpenAI()
    out_path = tmp_path / "multiround.json"
    config = ServeConfig(
        url="http://fake",
        model="m",
        endpoint=EndpointKind.CHAT,
        dataset="multiround",
        dataset_config=DatasetConfig(num_users=3, num_rounds=2, shared_prefix_len=10, random_output_len=4),
        num_prompts=6,
        request_rate=1000.0,
        max_concurrency=2,
        warmup=2,
        show_progress=False,
        json_path=out_path,
    )
    printed = io.StringIO()
    report = asyncio.run(serve(config, transport=httpx.MockTransport(fake.handle), out=printed))
    assert report.summary.num_completed == 6
    assert fake.session_headers[:2] == [None, None]  # the warmup leaves no session behind in a router
    assert sorted(fake.session_headers[2:]) == ["user-0", "user-0", "user-1", "user-1", "user-2", "user-2"]
    assert [r.round_index for r in report.results] == [0, 0, 0, 1, 1, 1]
    assert list(report.summary.ttft_by_round) == [0, 1] and report.summary.ttft_by_round[1].count == 3
    document = load_json(out_path)
    assert sorted((r["session_id"], r["round_index"]) for r in document["requests"]) == [
        (f"user-{u}", r) for u in range(3) for r in range(2)
    ]
    assert document["summary"]["ttft_by_round"]["1"]["count"] == 3
    assert document["args"]["dataset_config"]["num_users"] == 3
    assert "TTFT by round" in printed.getvalue() and "round 1" in printed.getvalue()


def test_serve_counts_server_errors_and_writes_json(tmp_path: Path) -> None:
    fake = FakeOpenAI(fail_every=4)
    out_path = tmp_path / "out" / "result.json"
    config = ServeConfig(
        url="http://fake:8000",
        model="smollm2",
        dataset_config=DatasetConfig(random_input_len=16, random_output_len=6),
        num_prompts=12,
        request_rate=500.0,
        warmup=1,
        show_progress=False,
        label="fake",
        json_path=out_path,
        api_key="sk-secret",
    )
    printed = io.StringIO()
    report = asyncio.run(serve(config, transport=httpx.MockTransport(fake.handle), out=printed))
    assert fake.authorizations == {"Bearer sk-secret"}
    assert len(fake.payloads) == 13  # one warmup + 12 measured; the warmup was the 1st, so 3 measured fail
    assert (report.summary.num_completed, report.summary.num_failed) == (9, 3)
    document = load_json(out_path)
    assert document["label"] == "fake" and document["args"]["num_prompts"] == 12
    assert document["args"]["request_rate"] == 500.0 and document["args"]["endpoint"] == "completions"
    assert document["summary"]["num_failed"] == 3 and document["summary"]["total_output_tokens"] == 54
    assert len(document["requests"]) == 12 and document["args"]["api_key"] == "<redacted>"
    assert sum(r["error"] == "HTTP 500: boom" for r in document["requests"]) == 3
    assert "Failed requests:" in printed.getvalue() and "HTTP 500: boom" in printed.getvalue()
    assert "warmup: 1/1 requests succeeded" in printed.getvalue()


# ---------------------------------------------------------------------------------------------------------
# The command line, against a real HTTP server in a thread


@pytest.fixture
def stub_server() -> Iterator[tuple[str, FakeOpenAI]]:
    fake = FakeOpenAI(fail_every=5, chunk_delay_s=0.001)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(stub_app(fake), log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", fake
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


def test_cli_serve_against_a_streaming_http_server(stub_server: tuple[str, FakeOpenAI], tmp_path: Path) -> None:
    url, fake = stub_server
    out_path = tmp_path / "chat.json"
    args = ["bench", "serve", "--url", url, "--model", "smollm2", "--endpoint", "chat", "--num-prompts", "10"]
    args += ["--dataset", "shared-prefix", "--shared-prefix-groups", "2", "--shared-prefix-len", "20"]
    args += ["--shared-suffix-len", "4", "--random-output-len", "5", "--max-concurrency", "4"]
    args += ["--json", str(out_path), "--label", "stub", "--no-progress", "--no-ignore-eos"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "Serving Benchmark Result" in result.output and "TTFT" in result.output
    document = load_json(out_path)
    assert (document["summary"]["num_completed"], document["summary"]["num_failed"]) == (8, 2)
    assert document["summary"]["total_output_tokens"] == 40 and document["label"] == "stub"
    assert all("messages" in p and p["ignore_eos"] is False for p in fake.payloads)


def test_cli_multiround_sends_users_times_rounds_requests(stub_server: tuple[str, FakeOpenAI], tmp_path: Path) -> None:
    url, fake = stub_server
    out_path = tmp_path / "multiround.json"
    args = ["bench", "serve", "--url", url, "--model", "smollm2", "--endpoint", "chat", "--dataset", "multiround"]
    args += ["--num-users", "3", "--num-rounds", "2", "--shared-prefix-len", "12", "--random-input-len", "5"]
    args += ["--random-output-len", "3", "--json", str(out_path), "--no-progress"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    document = load_json(out_path)
    assert document["args"]["num_prompts"] == 6 and len(fake.payloads) == 6
    assert {p["user"] for p in fake.payloads} == {"user-0", "user-1", "user-2"}


def test_cli_multiround_rejects_inconsistent_counts() -> None:
    base = ["bench", "serve", "--url", "http://x", "--model", "m", "--dataset", "multiround"]
    mismatch = CliRunner().invoke(app, [*base, "--num-users", "2", "--num-rounds", "3", "--num-prompts", "5"])
    assert mismatch.exit_code == 2
    assert "2 * 3 = 6 requests, but num_prompts is 5" in " ".join(mismatch.output.replace("│", " ").split())
    no_users = CliRunner().invoke(app, [*base, "--num-users", "0"])
    assert no_users.exit_code == 2
    assert "num_users >= 1" in " ".join(no_users.output.replace("│", " ").split())


def test_cli_exits_1_when_no_request_succeeds() -> None:
    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    result = CliRunner().invoke(app, ["bench", "serve", "--url", url, "--model", "m", "--num-prompts", "2"])
    assert result.exit_code == 1
    assert "Failed requests:" in result.output and "ConnectError" in result.output


def test_cli_rejects_an_unknown_dataset_listing_the_names() -> None:
    result = CliRunner().invoke(app, ["bench", "serve", "--url", "http://x", "--model", "m", "--dataset", "nope"])
    assert result.exit_code == 2
    assert "jsonl, multiround, random, shared-prefix" in " ".join(result.output.replace("│", " ").split())


def test_plot_writes_a_png_from_several_results(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    paths = []
    for label, rate in (("a", 100.0), ("b", math.inf)):
        path = tmp_path / f"{label}.json"
        config = ServeConfig(
            url="http://fake",
            model="m",
            dataset_config=DatasetConfig(random_input_len=8, random_output_len=4),
            num_prompts=6,
            request_rate=rate,
            show_progress=False,
            label=label,
            json_path=path,
        )
        asyncio.run(serve(config, transport=httpx.MockTransport(FakeOpenAI().handle), out=io.StringIO()))
        paths.append(path)
    plot_results(paths, tmp_path / "cdf.png", metric="itl", kind=PlotKind.CDF)
    result = CliRunner().invoke(app, ["bench", "plot", *map(str, paths), "--out", str(tmp_path / "bar.png")])
    assert result.exit_code == 0, result.output
    for name in ("cdf.png", "bar.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")
    assert load_json(paths[1])["args"]["request_rate"] == "inf"


def test_bench_cli_never_imports_torch() -> None:
    code = "import sys, splitserve.cli, splitserve.bench.cli; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

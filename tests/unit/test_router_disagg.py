"""The disaggregation decision: with ``cost`` (the default) a long prompt is prefilled on the prefill pool only when
prefill plus the KV push beats the decode worker prefilling it itself, counting the requests running there, which its
prefill would stall; ``threshold`` disaggregates every prompt over the floor. No socket: the router reaches its workers
through the fake transport of ``tests/support/transport.py``."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from starlette.testclient import TestClient
from typer.testing import CliRunner

from splitserve.cli import app
from splitserve.config import PDDecision, RouterConfig
from splitserve.router.app import Router, build_router_app
from splitserve.router.build import build_router
from splitserve.router.cost import PRIOR_S_PER_TOKEN
from splitserve.router.disagg import kept_colocated
from splitserve.router.discovery import Worker
from tests.support.transport import FakeTransport, FakeUpstream, completion_chunk, sse

P, D = "http://prefill:8000", "http://decode:8000"
THRESHOLD = 256
LONG, SHORT = 300, THRESHOLD - 1  # prompt tokens
FIRST_TOKEN = 72


class PDTransport(FakeTransport):
    """The fake transport, with a decode worker that has a KV receiver."""

    async def get_json(self, url: str, timeout_s: float) -> Any:
        if url.endswith("/kv/transfer"):
            return {"addr": "127.0.0.1:9"}
        return await super().get_json(url, timeout_s)


@dataclass
class SlowUpstream(FakeUpstream):
    delay_s: float = 0.0

    async def read(self) -> bytes:
        await asyncio.sleep(self.delay_s)
        return await super().read()


def prefill_answer(num_tokens: int, transfer_ms: float, delay_s: float = 0.0) -> FakeUpstream:
    """P's answer: the first token, and a successful push of ``num_tokens`` tokens in ``transfer_ms``."""
    report = {"transfer_id": "x", "ok": True, "num_tokens": num_tokens, "num_bytes": num_tokens * 23_040,
              "transfer_ms": transfer_ms, "reason": "", "first_token_id": FIRST_TOKEN}  # fmt: skip
    choice = {"index": 0, "text": "H", "finish_reason": "length"}
    body = {"id": "cmpl-p", "object": "text_completion", "created": 1, "model": "m", "choices": [choice],
            "kv_transfer_params": report}  # fmt: skip
    return SlowUpstream(200, [json.dumps(body).encode()], content_type="application/json", delay_s=delay_s)


def decode_answer() -> FakeUpstream:
    body = {"object": "text_completion", "choices": [{"index": 0, "text": "Hey", "finish_reason": "length"}]}
    return FakeUpstream(200, [json.dumps(body).encode()], content_type="application/json")


def tokenize(path: str, body: dict[str, Any]) -> list[int] | None:
    prompt = body.get("prompt")
    return list(prompt) if isinstance(prompt, list) else None


@pytest.fixture
def stack() -> Iterator[list[TestClient]]:
    clients: list[TestClient] = []
    yield clients
    for client in clients:
        client.__exit__(None, None, None)


def start(
    stack: list[TestClient], transport: FakeTransport, decision: PDDecision = PDDecision.COST, **options: Any
) -> tuple[Router, TestClient]:
    config = RouterConfig(model="m", prefill=(P,), decode=(D,), routing_threshold=THRESHOLD, retry_backoff_s=0.001,
                          pd_decision=decision, **options)  # fmt: skip
    router = build_router(config, tokenize, transport=transport)
    client = TestClient(build_router_app(router, probe=False))
    client.__enter__()
    stack.append(client)
    return router, client


def complete(client: TestClient, num_tokens: int, **extra: Any) -> Any:
    answer = client.post("/v1/completions", json={"prompt": list(range(num_tokens)), "max_tokens": 4, **extra})
    assert answer.status_code == 200, answer.text
    return answer


def worker(router: Router, url: str) -> Worker:
    return next(w for w in router.pool if w.url == url)


def paths(router: Router) -> dict[str, float]:
    counter = router.metrics.pd_decisions
    return {path: counter.labels(path)._value.get() for path in ("direct", "disaggregated", "fallback")}


def routing_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [m for m in caplog.messages if m.startswith("Conditional routing")]


class TestTheCostRule:
    def test_an_idle_decoder_prefills_a_long_prompt_itself(
        self, stack: list[TestClient], caplog: pytest.LogCaptureFixture
    ) -> None:
        transport = PDTransport({P: [prefill_answer(LONG, 7.5)], D: [decode_answer()]})
        router, client = start(stack, transport)
        with caplog.at_level(logging.INFO, "splitserve.router"):
            complete(client, LONG)
        assert [url for url, _ in transport.sent] == [f"{D}/v1/completions"]
        assert "kv_transfer_params" not in transport.sent[0][1]
        assert paths(router) == {"direct": 1, "disaggregated": 0, "fallback": 0}
        # remote: 300 tokens at the prior 1 ms each, plus the push at 25 us each; local: the prefill; harm: none
        assert routing_lines(caplog) == [
            "Conditional routing: estimated_tokens=300, threshold=256, disaggregate=False, remote_ms=307.5, "
            "local_ms=300.0, harm_ms=0.0 (0 in flight on the decode worker)"
        ]

    def test_a_decoder_running_streams_sends_a_long_prompt_to_the_prefill_pool(
        self, stack: list[TestClient], caplog: pytest.LogCaptureFixture
    ) -> None:
        transport = PDTransport({P: [prefill_answer(LONG, 7.5)], D: [decode_answer()]})
        router, client = start(stack, transport)
        worker(router, D).in_flight = 2  # two streams being decoded there
        with caplog.at_level(logging.INFO, "splitserve.router"):
            complete(client, LONG)
        assert [url for url, _ in transport.sent] == [f"{P}/v1/completions", f"{D}/v1/completions"]
        prefill_body, decode_body = transport.sent[0][1], transport.sent[1][1]
        assert prefill_body["max_tokens"] == 1 and "decode_kv_addr" in prefill_body["kv_transfer_params"]
        assert decode_body["kv_transfer_params"]["first_token_id"] is None  # a whole answer: D draws its own
        assert paths(router) == {"direct": 0, "disaggregated": 1, "fallback": 0}
        assert routing_lines(caplog) == [
            "Conditional routing: estimated_tokens=300, threshold=256, disaggregate=True, remote_ms=307.5, "
            "local_ms=302.0, harm_ms=600.0 (2 in flight on the decode worker)"  # a row of each stream beside it
        ]

    def test_a_prefill_worker_with_a_long_queue_loses_to_a_busy_decoder(self, stack: list[TestClient]) -> None:
        transport = PDTransport({P: [], D: [decode_answer()]})
        router, client = start(stack, transport)
        worker(router, D).in_flight = 1
        for _ in range(4):  # 1 s of shorter prefill ahead there, against 0.6 s of stall here
            worker(router, P).pending_prefill.add(250)
        complete(client, LONG)
        assert [url for url, _ in transport.sent] == [f"{D}/v1/completions"]

    @pytest.mark.parametrize("decision", list(PDDecision))
    def test_below_the_threshold_nothing_is_disaggregated_whatever_the_costs(
        self, stack: list[TestClient], decision: PDDecision
    ) -> None:
        transport = PDTransport({P: [prefill_answer(SHORT, 1.0)], D: [decode_answer()]})
        router, client = start(stack, transport, decision)
        worker(router, D).in_flight = 50  # a local prefill would stall 50 streams
        router.cost.s_per_token[D] = 1.0  # and the decoder is very slow
        complete(client, SHORT)
        assert [url for url, _ in transport.sent] == [f"{D}/v1/completions"]
        assert paths(router)["direct"] == 1


class TestLearnedCosts:
    def test_a_measured_slow_push_keeps_the_next_long_prompt_local(self, stack: list[TestClient]) -> None:
        transport = PDTransport({P: [prefill_answer(LONG, 3_000.0)], D: [decode_answer(), decode_answer()]})
        router, client = start(stack, transport)
        worker(router, D).in_flight = 1
        complete(client, LONG)  # disaggregated, at the prior push rate; the push took 10 ms per token
        assert router.cost.transfer_s_per_token == pytest.approx(0.01)
        complete(client, LONG)  # now the push alone (3 s) costs more than prefill and stall here (0.6 s)
        assert [url for url, _ in transport.sent] == [f"{P}/v1/completions", *[f"{D}/v1/completions"] * 2]
        assert "kv_transfer_params" not in transport.sent[2][1]
        assert paths(router) == {"direct": 1, "disaggregated": 1, "fallback": 0}

    def test_the_prefill_workers_rate_is_its_answers_time_less_the_push(self, stack: list[TestClient]) -> None:
        transport = PDTransport({P: [prefill_answer(LONG, 200.0, delay_s=0.3)], D: [decode_answer()]})
        router, client = start(stack, transport, PDDecision.THRESHOLD)
        complete(client, LONG)
        assert 0.1 / LONG <= router.cost.s_per_token[P] < 0.25 / LONG  # 0.3 s in all, 0.2 s of it the push
        assert worker(router, P).pending_prefill_tokens == 0 and worker(router, P).in_flight == 0

    def test_a_direct_stream_teaches_the_decoders_rate_and_a_pushed_one_does_not(self, stack: list[TestClient]) -> None:
        stream = sse(completion_chunk("e", [101]), completion_chunk("y", [121], "length"), "[DONE]")
        transport = PDTransport({P: [prefill_answer(LONG, 7.5)], D: [FakeUpstream(200, list(stream))]})
        router, client = start(stack, transport, PDDecision.THRESHOLD, stream_migration=False)
        answer = complete(client, LONG, stream=True)  # through the prefill worker: D loads the KV, computes none
        texts = [json.loads(line[6:])["choices"][0]["text"] for line in answer.text.splitlines()
                 if line.startswith("data: {")]  # fmt: skip
        assert "".join(texts) == "Hey"
        assert D not in router.cost.s_per_token
        transport.scripts[D] = [FakeUpstream(200, list(stream))]
        router.disagg.threshold = LONG + 1  # type: ignore[union-attr]  # now the same prompt goes direct
        complete(client, LONG, stream=True)
        assert D in router.cost.s_per_token and router.cost.rate(D) < PRIOR_S_PER_TOKEN
        assert worker(router, D).pending_prefill_tokens == 0


class TestTheThresholdRule:
    def test_every_prompt_over_the_floor_is_disaggregated_as_before(
        self, stack: list[TestClient], caplog: pytest.LogCaptureFixture
    ) -> None:
        transport = PDTransport({P: [prefill_answer(LONG, 7.5)], D: [decode_answer(), decode_answer()]})
        router, client = start(stack, transport, PDDecision.THRESHOLD)
        with caplog.at_level(logging.INFO, "splitserve.router"):
            complete(client, LONG)  # an idle decoder: the cost rule would keep it
            complete(client, SHORT)
        assert [url for url, _ in transport.sent] == [f"{P}/v1/completions", *[f"{D}/v1/completions"] * 2]
        assert "kv_transfer_params" not in transport.sent[2][1]
        assert paths(router) == {"direct": 1, "disaggregated": 1, "fallback": 0}
        assert routing_lines(caplog) == [
            "Conditional routing: estimated_tokens=300, threshold=256, disaggregate=True",
            "Conditional routing: estimated_tokens=255, threshold=256, disaggregate=False",
        ]

    @pytest.mark.parametrize(
        "extra", [{"prompt_logprobs": 0}, {"echo": True, "logprobs": 1}], ids=["prompt-logprobs", "echo-logprobs"]
    )
    def test_the_prompts_logprobs_stay_on_the_decoder(
        self, stack: list[TestClient], caplog: pytest.LogCaptureFixture, extra: dict[str, Any]
    ) -> None:
        transport = PDTransport({P: [], D: [decode_answer()]})
        router, client = start(stack, transport, PDDecision.THRESHOLD)
        with caplog.at_level(logging.INFO, "splitserve.router"):
            complete(client, LONG, **extra)
        assert [url for url, _ in transport.sent] == [f"{D}/v1/completions"]
        assert paths(router) == {"direct": 1, "disaggregated": 0, "fallback": 0}
        assert routing_lines(caplog)[0].startswith("Conditional routing: not disaggregated, ")

    @pytest.mark.parametrize("extra", [{"n": 2}, {"best_of": 3, "n": 1}], ids=["n", "best-of"])
    def test_several_sequences_are_prefilled_once_and_each_draws_its_first_token_on_the_decoder(
        self, stack: list[TestClient], extra: dict[str, Any]
    ) -> None:
        transport = PDTransport({P: [prefill_answer(LONG, 7.5)], D: [decode_answer()]})
        router, client = start(stack, transport, PDDecision.THRESHOLD)
        complete(client, LONG, **extra, logprobs=1, min_tokens=5)
        assert [url for url, _ in transport.sent] == [f"{P}/v1/completions", f"{D}/v1/completions"]
        prefill_body, decode_body = transport.sent[0][1], transport.sent[1][1]
        assert "n" not in prefill_body and "best_of" not in prefill_body and prefill_body["max_tokens"] == 1
        assert "logprobs" not in prefill_body and prefill_body["min_tokens"] == 1  # no EOS first, which D would take
        assert decode_body | extra == decode_body and decode_body["kv_transfer_params"]["first_token_id"] is None
        assert paths(router) == {"direct": 0, "disaggregated": 1, "fallback": 0}

    def test_several_sequences_stay_on_a_vllm_decoder(self, stack: list[TestClient]) -> None:
        """A vLLM decode worker's connector loads a push for one request: n sequences are computed there."""
        transport = PDTransport({P: [], D: [decode_answer()]})
        router, client = start(stack, transport, PDDecision.THRESHOLD)
        worker(router, D).kv_transfer_addr, worker(router, D).forces_first_token = "127.0.0.1:9", False  # vLLM
        complete(client, LONG, n=2)
        assert [url for url, _ in transport.sent] == [f"{D}/v1/completions"]
        assert "kv_transfer_params" not in transport.sent[0][1]
        assert paths(router) == {"direct": 1, "disaggregated": 0, "fallback": 0}

    @pytest.mark.parametrize(
        "extra", [{"tools": [{"type": "function", "function": {"name": "f"}}]}, {"n": 2}, {}],
        ids=["tools", "n", "reasoning"],
    )  # fmt: skip
    def test_a_stream_whose_first_token_is_not_plain_text_is_all_the_decoders(
        self, stack: list[TestClient], extra: dict[str, Any]
    ) -> None:
        """Tools, several sequences, or a first token P's parser read as reasoning: D draws the first token and
        streams everything (P's token would be streamed as content, or as every sequence's)."""
        first = {"content": "H"} if extra else {"content": None, "reasoning_content": "Hm"}
        stream = sse(chat_chunk({"content": "Hey"}, [101]), chat_chunk({}, [121], "length"), "[DONE]")
        transport = PDTransport({P: [chat_prefill_answer(first)], D: [FakeUpstream(200, list(stream))]})
        start(stack, transport, PDDecision.THRESHOLD)
        answer = chat(stack[-1], stream=True, **extra)
        decode_body = transport.sent[1][1]
        assert decode_body["kv_transfer_params"]["first_token_id"] is None and decode_body["stream"] is True
        assert "".join(chat_texts(answer.text)) == "Hey"

    def test_a_plain_stream_gets_its_first_token_and_its_logprobs_from_the_prefill_answer(
        self, stack: list[TestClient]
    ) -> None:
        logprobs = {"content": [{"token": "H", "logprob": -0.5, "bytes": [72], "top_logprobs": []}]}
        stream = sse(chat_chunk({"content": "ey"}, [101]), chat_chunk({}, [121], "length"), "[DONE]")
        transport = PDTransport({P: [chat_prefill_answer({"content": "H"}, logprobs)],
                                 D: [FakeUpstream(200, list(stream))]})  # fmt: skip
        start(stack, transport, PDDecision.THRESHOLD, stream_migration=False)
        answer = chat(stack[-1], stream=True, logprobs=True)
        prefill_body, decode_body = transport.sent[0][1], transport.sent[1][1]
        assert prefill_body["logprobs"] is True and prefill_body["stream"] is False
        assert decode_body["kv_transfer_params"] | {"transfer_id": "t"} == {
            "transfer_id": "t", "first_token_id": FIRST_TOKEN, "skip_first_token": True}  # fmt: skip
        first = json.loads(answer.text.splitlines()[0][6:])["choices"][0]
        assert first["delta"] == {"role": "assistant", "content": "H"} and first["logprobs"] == logprobs
        assert "".join(chat_texts(answer.text)) == "Hey"

    def test_which_requests_stay_whatever_their_length(self) -> None:
        tools = [{"type": "function", "function": {"name": "f"}}]
        assert kept_colocated({"stream": True, "tools": tools}) is None  # D reads the calls from the whole output
        assert kept_colocated({"n": 4, "stream": True}) is None
        assert kept_colocated({"stream": True, "response_format": {"type": "json_object"}}) is None
        assert kept_colocated({"prompt_logprobs": 1}) is not None


def chat_prefill_answer(message: dict[str, Any], logprobs: dict[str, Any] | None = None) -> FakeUpstream:
    """P's chat answer: ``message`` (its first token, as P's parsers read it), and a successful push."""
    report = {"transfer_id": "x", "ok": True, "num_tokens": LONG, "num_bytes": LONG * 23_040, "transfer_ms": 7.5,
              "reason": "", "first_token_id": FIRST_TOKEN}  # fmt: skip
    choice = {"index": 0, "message": {"role": "assistant", **message}, "logprobs": logprobs, "finish_reason": "length"}
    body = {"id": "chatcmpl-p", "object": "chat.completion", "created": 1, "model": "m", "choices": [choice],
            "kv_transfer_params": report}  # fmt: skip
    return FakeUpstream(200, [json.dumps(body).encode()], content_type="application/json")


def chat_chunk(delta: dict[str, Any], ids: list[int], finish: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": finish, "token_ids": ids}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}


def chat(client: TestClient, **extra: Any) -> Any:
    messages = [{"role": "user", "content": "word " * LONG}]
    answer = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, **extra})
    assert answer.status_code == 200, answer.text
    return answer


def chat_texts(stream: str) -> list[str]:
    events = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    return [e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices")]


class TestTheSetting:
    def test_threshold_is_the_default_and_cost_is_chosen_by_flag_or_environment(self) -> None:
        assert RouterConfig(model="m").pd_decision == PDDecision.THRESHOLD  # the reference system's rule
        bad = CliRunner().invoke(app, ["router", "--model", "m", "--decode", D, "--pd-decision", "fastest"])
        assert bad.exit_code == 2 and "'fastest' is not one of 'threshold', 'cost'" in bad.output
        from_env = CliRunner().invoke(app, ["router", "--model", "m", "--decode", D],
                                      env={"SPLITSERVE_PD_DECISION": "fastest"})  # fmt: skip
        assert from_env.exit_code == 2 and "SPLITSERVE_PD_DECISION" in from_env.output

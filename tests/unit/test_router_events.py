"""kvaware without wiring: the router pulls KV events from plain workers (no ``--kv-events-url``), follows them
as they change, survives a worker restart, and routes a worker without events by its own prefix index. No
socket: the workers are in-process apps behind the in-memory transport."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import pytest
from starlette.testclient import TestClient

from splitserve.config import RoutingStrategy
from splitserve.keys import hash_blocks
from splitserve.policy.balance import NOTHING_UNSEEN
from splitserve.protocol.kv_events import Tier
from splitserve.router import events as router_events
from splitserve.router.app import Router
from splitserve.worker.kv_events import KVEventLog
from tests.support.router import MemoryWorker, completion, start_router_in_memory
from tests.support.transport import no_sockets
from tests.support.waiting import wait_until

PROMPT = list(range(1, 70))  # 4 full blocks of 16
DECISIONS = "splitserve:router_routing_decisions_total"


@pytest.fixture(autouse=True)
def _no_sockets(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with no_sockets(monkeypatch):
        yield


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def served(workers: list[MemoryWorker], before: list[int]) -> list[int]:
    return [w.num_requests - b for w, b in zip(workers, before, strict=True)]


def start_kvaware(stack: ExitStack, workers: list[MemoryWorker]) -> tuple[Router, TestClient]:
    urls = [w.url for w in workers]
    return start_router_in_memory(
        stack, urls, {w.url: w.app for w in workers}, routing_strategy=RoutingStrategy.KVAWARE
    )


def test_kvaware_over_plain_workers_routes_by_the_events_it_pulls(stack: ExitStack) -> None:
    workers = [MemoryWorker("http://worker-a:8000", "a"), MemoryWorker("http://worker-b:8000", "b")]
    router, client = start_kvaware(stack, workers)
    wait_until(lambda: all(router.kv_index.is_registered(w.url) for w in workers), timeout_s=10)
    assert router.pool.get(workers[1].url).worker_id == "b"  # type: ignore[union-attr]
    workers[1].log.stored(Tier.ENGINE, hash_blocks(PROMPT, 16))  # b's cache now holds the prompt
    wait_until(lambda: router.kv_index.match(hash_blocks(PROMPT, 16), workers[1].url).engine == 64, timeout_s=5)
    before = [w.num_requests for w in workers]
    for _ in range(3):
        assert completion(client, prompt=[*PROMPT, 99]).status_code == 200
    assert served(workers, before) == [0, 3]
    workers[1].log.removed(Tier.ENGINE, hash_blocks(PROMPT, 16))  # evicted: the router hears it too
    wait_until(lambda: router.kv_index.match(hash_blocks(PROMPT, 16), workers[1].url).engine == 0, timeout_s=5)


def test_a_restarted_worker_is_resynchronised_with_a_snapshot(stack: ExitStack) -> None:
    worker = MemoryWorker("http://worker-a:8000", "a")
    router, _ = start_kvaware(stack, [worker])
    wait_until(lambda: router.kv_index.is_registered(worker.url), timeout_s=10)
    worker.log.stored(Tier.ENGINE, hash_blocks(PROMPT, 16))
    wait_until(lambda: router.kv_index.match(hash_blocks(PROMPT, 16), worker.url).engine == 64, timeout_s=5)
    fresh = KVEventLog("a", "unused")  # the worker restarted: a new epoch, an empty cache, numbering from 0
    fresh.stored(Tier.ENGINE, hash_blocks(PROMPT[:33], 16))
    worker.log.__dict__.update(fresh.__dict__)
    wait_until(lambda: router.kv_index.match(hash_blocks(PROMPT, 16), worker.url).engine == 32, timeout_s=15)


def test_a_worker_without_events_gets_one_warning_and_the_prefix_index(
    stack: ExitStack, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(router_events, "SILENT_AFTER_S", 0.3)
    monkeypatch.setattr(router_events, "FIRST_BACKOFF_S", 0.05)
    workers = [MemoryWorker(f"http://plain-{i}:8000") for i in range(2)]  # their /kv/events is a 404
    plain = [(w.url, w.engine) for w in workers]
    with caplog.at_level(logging.WARNING, logger="splitserve.router"):
        router, client = start_kvaware(stack, workers)
        wait_until(lambda: caplog.text.count("no KV events from worker") == 2, timeout_s=10)
    for _ in range(4):
        assert completion(client, prompt=[*PROMPT, 99]).status_code == 200
    counts = sorted(len(engine.added_ids) for _, engine in plain)
    assert counts == [0, 4]  # the first went to the least loaded, the rest followed it by the prefix index
    assert f'{DECISIONS}{{outcome="prefix_index",strategy="kvaware"}} 3.0' in client.get("/metrics").text
    assert caplog.text.count("no KV events from worker") == 2  # once each, not once per retry
    assert router.events is not None and not router.events.has_events(plain[0][0])


@pytest.mark.parametrize("strategy", [RoutingStrategy.KVAWARE, RoutingStrategy.PREFIXAWARE, RoutingStrategy.SESSION])
def test_two_router_replicas_each_see_the_load_the_other_puts_on_a_worker(
    stack: ExitStack, strategy: RoutingStrategy
) -> None:
    """The workers' load rides on the events both replicas pull (the load alone where the strategy keeps no KV
    index): a long request replica b sends to the worker shows on replica a's entry for it while it runs, and is
    gone from it once it has finished."""
    worker = MemoryWorker("http://worker-a:8000", "a")
    urls, apps = [worker.url], {worker.url: worker.app}
    router_a, _ = start_router_in_memory(stack, urls, apps, routing_strategy=strategy)
    _, client_b = start_router_in_memory(stack, urls, apps, routing_strategy=strategy)
    worker.engine.step_delay_s = 0.05
    entry = router_a.pool.get(worker.url)
    assert entry is not None
    wait_until(lambda: entry.reported is not None, timeout_s=10)  # with the snapshot
    assert entry.unseen == NOTHING_UNSEEN
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(completion, client_b, prompt=PROMPT, max_tokens=50)  # about 2.5 s of steps
        wait_until(lambda: entry.unseen.requests + entry.unseen.decoding == 1, timeout_s=5, interval_s=0.01)
        assert entry.in_flight == 0  # none of it is replica a's own
        assert answer.result(30).status_code == 200
    wait_until(lambda: entry.unseen == NOTHING_UNSEEN, timeout_s=5)
    if strategy != RoutingStrategy.KVAWARE:  # no index: none fed, nobody registered, pushes not taken as pulled
        assert router_a.events is not None and router_a.events.index is None
        assert not router_a.kv_index.is_registered(worker.url) and not router_a.events.has_events(worker.url)


def test_a_load_only_poll_answers_no_events_and_waits_for_the_load_alone() -> None:
    worker = MemoryWorker("http://worker-a:8000", "a")
    worker.log.stored(Tier.ENGINE, hash_blocks(PROMPT, 16))
    with TestClient(worker.app) as client:
        first = client.get("/kv/events", params={"load_only": "true"}).json()
        assert first["events"] == [] and not first["reset"] and first["load"]["running"] == 0
        worker.log.stored(Tier.ENGINE, hash_blocks([*PROMPT, 1], 16))  # a new event: no reason to answer
        after = {"load_only": "true", "after": first["seq"], "epoch": first["epoch"], "wait": "0.3"}
        start = time.monotonic()
        assert client.get("/kv/events", params=after).json()["events"] == []
        assert time.monotonic() - start >= 0.25  # the new event did not end the wait

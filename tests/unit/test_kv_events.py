"""The KV event publisher (batching, registration, resync) and the wire format's validation."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from splitserve.kvcache.cpu import CPUTier
from splitserve.kvcache.store import TieredStore
from splitserve.protocol.kv_events import EventKind, Tier, parse_batch
from splitserve.worker import kv_events
from splitserve.worker.kv_events import KVEventLog, KVEventPublisher

URL = "http://router/kv/events"


class FakeRouter:
    """Records every body; ``status`` decides the answer (a callable of the body, or a fixed code)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.status: Callable[[dict[str, Any]], int] = lambda body: 200
        self.arrived = threading.Condition()

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        with self.arrived:
            self.bodies.append(body)
            self.arrived.notify_all()
        return httpx.Response(self.status(body), json={})

    def wait_for(self, predicate: Callable[[list[dict[str, Any]]], bool], timeout_s: float = 5.0) -> None:
        with self.arrived:
            assert self.arrived.wait_for(lambda: predicate(self.bodies), timeout_s), self.bodies


@pytest.fixture
def router() -> FakeRouter:
    return FakeRouter()


@pytest.fixture
def log() -> KVEventLog:
    return KVEventLog("w1", "http://w1:8000", {"block_size": 16})


@pytest.fixture
def publisher(router: FakeRouter, log: KVEventLog) -> Any:
    pub = KVEventPublisher(URL, log, interval_s=0.01, transport=httpx.MockTransport(router.handle))
    yield pub
    pub.close()


def held(body: dict[str, Any], tier: str) -> set[int]:
    return {h for e in body["events"] if e["tier"] == tier for h in e["hashes"]}


def test_first_batch_registers_with_a_snapshot_then_events_follow(
    publisher: KVEventPublisher, log: KVEventLog, router: FakeRouter
) -> None:
    log.stored(Tier.ENGINE, [1, 2, 3])
    publisher.start()
    router.wait_for(lambda b: len(b) >= 1)
    first = router.bodies[0]
    assert first["reset"] and first["meta"] == {"block_size": 16} and first["worker_url"] == "http://w1:8000"
    assert held(first, "engine") == {1, 2, 3}
    time.sleep(0.2)  # the sender is idle now: new events must wake it
    log.removed(Tier.ENGINE, [2])
    log.stored(Tier.L2, [9])
    router.wait_for(lambda b: any(not x["reset"] for x in b))
    later = [e for b in router.bodies[1:] for e in b["events"]]
    assert {"tier": "engine", "kind": "removed", "hashes": [2]} in later
    assert {"tier": "l2", "kind": "stored", "hashes": [9]} in later
    assert publisher.is_registered


def test_an_unknown_worker_answer_triggers_a_full_snapshot(
    publisher: KVEventPublisher, log: KVEventLog, router: FakeRouter
) -> None:
    publisher.start()
    router.wait_for(lambda b: len(b) >= 1)
    router.status = lambda body: 200 if body["reset"] else 409  # the router restarted and forgot us
    log.stored(Tier.L1, [5, 6])
    log.removed(Tier.L1, [5])
    router.wait_for(lambda b: len(b) >= 3 and b[-1]["reset"])
    assert held(router.bodies[-1], "l1") == {6}


def test_a_dead_router_is_retried_with_backoff_and_resynchronised(router: FakeRouter) -> None:
    calls: list[float] = []

    def refuse(request: httpx.Request) -> httpx.Response:
        calls.append(time.monotonic())
        raise httpx.ConnectError("refused", request=request)

    log = KVEventLog("w1", "http://w1")
    pub = KVEventPublisher(URL, log, interval_s=0.01, transport=httpx.MockTransport(refuse))
    pub.start()
    try:
        time.sleep(1.0)
        log.stored(Tier.ENGINE, [7])
        assert not pub.is_registered
        gaps = [b - a for a, b in itertools.pairwise(calls)]
        assert 2 <= len(calls) < 10 and gaps[-1] > gaps[0]  # backs off instead of spinning
    finally:
        pub.close()


def test_store_reports_l1_and_confirmed_l2_writes(
    publisher: KVEventPublisher, log: KVEventLog, router: FakeRouter
) -> None:
    key = "splitserve:v1:m:layout:00000000000000ff"
    l1 = CPUTier(100, on_evict=lambda k: log.removed(Tier.L1, [int(k.rsplit(":", 1)[1], 16)]))
    store = TieredStore(l1, CPUTier(1000, name="l2"), events=log)
    store.put(key, b"x" * 60)
    assert store.flush(5.0)
    store.put(key.replace("ff", "fe"), b"y" * 60)  # evicts the first from L1, not from L2
    assert store.flush(5.0)
    store.close()
    publisher.start()
    router.wait_for(lambda b: len(b) >= 1)
    snapshot = router.bodies[0]
    assert held(snapshot, "l1") == {0xFE} and held(snapshot, "l2") == {0xFF, 0xFE}


def test_the_log_answers_a_reader_with_what_it_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    log = KVEventLog("w1", "http://w1", {"block_size": 16})
    log.stored(Tier.ENGINE, [1, 2])
    first = log.batch_after(None)
    assert first["reset"] and held(first, "engine") == {1, 2} and first["meta"] == {"block_size": 16}
    log.stored(Tier.ENGINE, [3])
    log.stored(Tier.ENGINE, [4])
    log.removed(Tier.ENGINE, [1])
    since = log.batch_after(first["seq"], first["epoch"])
    assert not since["reset"] and since["seq"] == first["seq"] + 3
    assert since["events"] == [{"tier": "engine", "kind": "stored", "hashes": [3, 4]},
                               {"tier": "engine", "kind": "removed", "hashes": [1]}]  # fmt: skip
    assert log.batch_after(since["seq"], since["epoch"])["events"] == []  # up to date
    assert log.batch_after(since["seq"], "another-epoch")["reset"]  # the worker restarted since
    assert log.batch_after(since["seq"] + 5, since["epoch"])["reset"]  # a number it never gave
    monkeypatch.setattr(kv_events, "MAX_PENDING_HASHES", 3)
    log.stored(Tier.L1, [7, 8])
    log.stored(Tier.L1, [9, 10])  # the log keeps 3 hashes of history: the events after `since` are gone
    behind = log.batch_after(since["seq"], since["epoch"])
    assert behind["reset"] and held(behind, "engine") == {2, 3, 4} and held(behind, "l1") == {7, 8, 9, 10}
    assert not log.wait_after(behind["seq"], 0.05)


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ([], "JSON object"),
        ({"worker_id": "", "worker_url": "http://w"}, "non-empty"),
        ({"worker_id": "w", "worker_url": "http://w", "reset": "yes"}, "boolean"),
        ({"worker_id": "w", "worker_url": "http://w", "events": [{"tier": "l3", "kind": "stored"}]}, "tier"),
        (
            {"worker_id": "w", "worker_url": "http://w", "events": [{"tier": "l1", "kind": "stored", "hashes": [-1]}]},
            "64-bit",
        ),
        (
            {"worker_id": "w", "worker_url": "http://w", "events": [{"tier": "l1", "kind": "stored", "hashes": [1.5]}]},
            "64-bit",
        ),
    ],
)
def test_bad_batches_are_refused_with_a_reason(body: Any, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_batch(body)


def test_a_good_batch_parses() -> None:
    body = {
        "worker_id": "w",
        "worker_url": "http://w",
        "reset": True,
        "events": [{"tier": "engine", "kind": "removed", "hashes": [2**64 - 1]}],
    }
    assert parse_batch(body) == ("w", "http://w", True, [(Tier.ENGINE, EventKind.REMOVED, [2**64 - 1])])

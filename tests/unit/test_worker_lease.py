"""A ``WorkerLease`` is the only code that moves a worker's counters, and it puts back exactly what it took."""

from __future__ import annotations

import time

import pytest

from splitserve.policy import balance
from splitserve.policy.balance import NOTHING_UNSEEN, Unseen
from splitserve.protocol.kv_events import WorkerLoad
from splitserve.router import discovery
from splitserve.router.discovery import REPORT_FRESH_S, Worker


def test_a_lease_counts_in_flight_queued_prefill_and_streaming_and_releases_them_once() -> None:
    worker = Worker("http://w:8000")
    lease = worker.lease(queued_tokens=300)
    assert (worker.in_flight, worker.pending_prefill_tokens, worker.num_streaming) == (1, 300, 0)
    assert worker.breaker.allows()
    lease.answered()
    lease.answered()  # the first answer counts; a second changes nothing
    assert worker.pending_prefill_tokens == 0
    lease.stream()
    lease.stream()
    assert worker.num_streaming == 1
    lease.release()
    lease.release()
    assert (worker.in_flight, worker.pending_prefill_tokens, worker.num_streaming) == (0, 0, 0)
    lease.stream()  # a released lease never counts again
    assert worker.num_streaming == 0


def test_a_lease_released_before_its_answer_returns_its_queued_tokens() -> None:
    worker = Worker("http://w:8000")
    first, second = worker.lease(100), worker.lease(50)
    assert (worker.in_flight, worker.pending_prefill_tokens) == (2, 150)
    first.release()  # failed before answering
    assert (worker.in_flight, worker.pending_prefill_tokens) == (1, 50)
    second.release()
    assert (worker.in_flight, worker.pending_prefill_tokens) == (0, 0)


def test_what_a_worker_reports_beyond_this_routers_own_requests_is_what_other_replicas_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker = Worker("http://w:8000")
    assert worker.unseen == NOTHING_UNSEEN  # no report: one router's view
    worker.lease(queued_tokens=300)  # one of ours, not answered
    decoding = worker.lease(queued_tokens=100)
    decoding.answered()  # and one of ours decoding
    worker.report(WorkerLoad(waiting=2, prefilling=1, running=5, prefill_tokens=900))
    # 3 unanswered there, 1 of them ours; 900 tokens, 300 ours; 4 decoding there, 1 ours
    assert worker.unseen == Unseen(requests=2, tokens=600, decoding=3)
    assert balance.decoding(worker) == 4 and balance.load_count(worker) == 2 + 2 + 3
    worker.report(WorkerLoad())  # a report from before ours arrived: ours are counted by us, never below
    assert worker.unseen == NOTHING_UNSEEN
    worker.report(WorkerLoad(running=4))  # ours decoding and 3 others'
    assert worker.unseen.decoding == 3
    decoding.release()  # ours ended after the report, which may still count it: wait for the next one
    assert worker.unseen == NOTHING_UNSEEN
    worker.report(WorkerLoad(running=3))
    assert worker.unseen.decoding == 3
    worker.report(WorkerLoad(running=9))
    later = time.monotonic() + REPORT_FRESH_S + 1
    monkeypatch.setattr(discovery.time, "monotonic", lambda: later)
    assert worker.unseen == NOTHING_UNSEEN  # the subscription broke: an old report counts for nothing

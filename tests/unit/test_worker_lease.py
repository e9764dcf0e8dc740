"""A ``WorkerLease`` is the only code that moves a worker's counters, and it puts back exactly what it took."""

from __future__ import annotations

from splitserve.router.discovery import Worker


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

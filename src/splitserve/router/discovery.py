"""The workers the router knows, their per-worker state, and where that list comes from.

The list starts from the ``--backend``/``--prefill``/``--decode`` flags. After that, :class:`WorkerPool.update`
takes the lists that the supervisor or the Kubernetes discovery sidecar sends through ``PUT /admin/workers``.
``checked_worker_url`` checks and normalizes every URL, from a flag or an update, the same way (lower-case
host, no trailing slash), so one worker is one entry. Workers that stay keep their state (health, breaker,
load), new ones start unprobed, and removed ones are forgotten.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum

from splitserve.breaker import CircuitBreaker
from splitserve.config import checked_worker_url
from splitserve.policy.balance import NOTHING_UNSEEN, PendingPrefill, Unseen, answered
from splitserve.protocol.kv_events import WorkerLoad
from splitserve.router.health import worker_breaker

REPORT_FRESH_S = 15.0  # a worker's load report counts this long (its long poll answers at least every 10 s)


class WorkerRole(StrEnum):
    BACKEND = "backend"  # a colocated worker: any request
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(eq=False)
class Worker:
    """One worker as the router sees it. Mutated only on the event loop."""

    url: str  # base URL, no trailing slash
    role: WorkerRole = WorkerRole.BACKEND
    breaker: CircuitBreaker = field(default_factory=worker_breaker)
    healthy: bool | None = None  # None: not probed yet (routable); False after failed probes
    in_flight: int = 0
    num_streaming: int = 0  # of in_flight, streams being relayed (their first bytes arrived)
    # uncached tokens of the requests sent here that have not started to answer
    pending_prefill: PendingPrefill = field(default_factory=PendingPrefill)
    worker_id: str | None = None  # the name it registered with (KV events), if it did
    kv_transfer_addr: str | None = None  # a decode worker's KV receiver (host:port), once asked
    forces_first_token: bool = True  # a decode worker takes prefill's first token (splitserve's); vLLM samples its own
    reported: WorkerLoad | None = None  # its engine's load, with its last KV event batch (kvaware)
    reported_at: float = 0.0  # time.monotonic() of that report
    left_at: float = 0.0  # time.monotonic() one of this router's requests there last answered or ended

    def report(self, load: WorkerLoad) -> None:
        self.reported, self.reported_at = load, time.monotonic()

    @property
    def unseen(self) -> Unseen:
        """What the worker last reported running beyond this router's own requests there: other replicas'. A
        report older than ``REPORT_FRESH_S`` (its event subscription broken) counts for nothing, as does a
        report of less than this router sent (its own requests in transit count in its own counters), and one from
        before one of this router's requests there answered or ended: it may still count that request, which this
        router no longer does, until the next report (the worker's long poll answers when its load changes)."""
        load = self.reported
        now = time.monotonic()
        if load is None or now - self.reported_at > REPORT_FRESH_S or self.reported_at < self.left_at:
            return NOTHING_UNSEEN
        own = self.pending_prefill
        return Unseen(
            requests=max(0, load.waiting + load.prefilling - own.num_requests),
            tokens=max(0, load.prefill_tokens - own.total),
            decoding=max(0, load.running - load.prefilling - answered(self)),
        )

    @property
    def pending_prefill_tokens(self) -> int:
        return self.pending_prefill.total

    @property
    def is_routable(self) -> bool:
        return self.healthy is not False and self.breaker.allows()

    @property
    def name(self) -> str:
        return self.worker_id or self.url

    def lease(self, queued_tokens: int = 0) -> WorkerLease:
        """One request's hold on this worker, counted from now (see :class:`WorkerLease`)."""
        return WorkerLease(self, queued_tokens)


class WorkerLease:
    """One request's hold on a worker, and the only code that moves the worker's counters: from taking it, the
    request is in flight there (and its breaker hears of an attempt); its uncached tokens count as queued
    prefill until the worker answers; once its answer is relayed it is streaming; :meth:`release` (idempotent)
    undoes all of it."""

    def __init__(self, worker: Worker, queued_tokens: int = 0) -> None:
        self.worker = worker
        self.queued_tokens = queued_tokens
        self.is_streaming = False
        self.is_released = False
        worker.in_flight += 1
        worker.pending_prefill.add(queued_tokens)
        worker.breaker.on_attempt()

    def answered(self) -> None:
        """The worker started to answer (or failed): its tokens are no longer queued prefill there."""
        if self.queued_tokens:
            self.worker.left_at = time.monotonic()
        self.worker.pending_prefill.remove(self.queued_tokens)
        self.queued_tokens = 0

    def stream(self) -> None:
        """Its answer is being relayed."""
        if not self.is_streaming and not self.is_released:
            self.worker.num_streaming += 1
            self.is_streaming = True

    def release(self) -> None:
        if self.is_released:
            return
        self.answered()
        self.worker.in_flight -= 1
        self.worker.left_at = time.monotonic()
        if self.is_streaming:
            self.worker.num_streaming -= 1
        self.is_released = True


MAX_WORKERS = 1024  # workers a router takes from an admin update, and workers its KV index tracks


def normalize_url(url: str) -> str:
    """``url`` as the pool keys it: checked and normalized where it is a bare worker URL, else as given."""
    try:
        return checked_worker_url(url)
    except ValueError:
        return url.rstrip("/")


class WorkerPool:
    """The current workers, in configured order."""

    def __init__(self, workers: Iterable[Worker] = ()) -> None:
        self._workers: dict[str, Worker] = {}
        self.update(workers)

    @classmethod
    def from_urls(
        cls, backends: Iterable[str], prefill: Iterable[str] = (), decode: Iterable[str] = (), **breaker: float
    ) -> WorkerPool:
        by_role = ((WorkerRole.BACKEND, backends), (WorkerRole.PREFILL, prefill), (WorkerRole.DECODE, decode))
        workers = [
            Worker(checked_worker_url(url), role, worker_breaker(**breaker))  # type: ignore[arg-type]
            for role, urls in by_role
            for url in urls
        ]
        return cls(workers)

    def update(self, workers: Iterable[Worker]) -> None:
        """Replace the list; a worker whose URL was already known keeps its state."""
        fresh: dict[str, Worker] = {}
        for worker in workers:
            worker.url = normalize_url(worker.url)
            kept = self._workers.get(worker.url)
            if kept is not None:
                kept.role = worker.role  # a worker may change role; its health and load stay
            fresh[worker.url] = kept or worker
        self._workers = fresh

    def get(self, url: str) -> Worker | None:
        return self._workers.get(normalize_url(url))

    def by_role(self, *roles: WorkerRole) -> list[Worker]:
        return [w for w in self._workers.values() if w.role in roles]

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

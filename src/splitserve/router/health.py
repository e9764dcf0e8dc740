"""Worker health: a circuit breaker per worker fed by request outcomes, and active ``/health`` probes.

The breaker (``splitserve.breaker``) stops sending to a worker after ``failure_threshold`` consecutive failed
requests (connect errors, 5xx), lets one trial request through after a cool-down (half-open), and closes on
its success; a failed trial doubles the cool-down (up to ``MAX_COOLDOWN_S``). Probes mark a worker unhealthy
after ``failure_threshold`` consecutive failures (or its first, if it never answered) and healthy again after
``success_threshold`` good answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from splitserve.breaker import CircuitBreaker
from splitserve.router.transport import Transport, TransportError

if TYPE_CHECKING:
    from splitserve.router.discovery import Worker

logger = logging.getLogger(__name__)

MAX_COOLDOWN_S = 60.0
HEALTH_BODY_BYTES = 64 * 1024


def worker_breaker(
    failure_threshold: int = 3, cooldown_s: float = 5.0, clock: Callable[[], float] = time.monotonic
) -> CircuitBreaker:
    """The breaker of one worker: ``cooldown_s`` after it opens, doubling per failed trial up to a minute."""
    return CircuitBreaker(failure_threshold, cooldown_s, max(cooldown_s, MAX_COOLDOWN_S), clock)


class HealthChecker:
    """Probes every worker's ``/health`` each ``interval_s`` (through ``transport``, each probe within
    ``timeout_s``) and updates ``Worker.healthy``."""

    def __init__(
        self,
        workers: Callable[[], Iterable[Worker]],
        transport: Transport,
        *,
        interval_s: float = 2.0,
        timeout_s: float = 2.0,
        failure_threshold: int = 2,
        success_threshold: int = 1,
    ) -> None:
        self._workers = workers
        self._transport = transport
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self._streaks: dict[str, int] = {}  # url -> consecutive results: > 0 successes, < 0 failures

    async def run(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self.interval_s)

    async def probe_all(self) -> None:
        workers = list(self._workers())
        results = await asyncio.gather(*(self._probe(w) for w in workers))
        for worker, (ok, reason) in zip(workers, results, strict=True):
            self._record(worker, ok, reason)
        current = {w.url for w in workers}
        for url in [url for url in self._streaks if url not in current]:  # workers since removed
            del self._streaks[url]

    async def _probe(self, worker: Worker) -> tuple[bool, str]:
        try:
            # only the status matters: a body is read no further than a health page's size
            answer = await self._transport.get(f"{worker.url}/health", self.timeout_s, max_bytes=HEALTH_BODY_BYTES)
        except TransportError as exc:
            return False, str(exc)
        return answer.status == 200, f"HTTP {answer.status}"

    def _record(self, worker: Worker, ok: bool, reason: str) -> None:
        streak = self._streaks.get(worker.url, 0)
        streak = max(streak, 0) + 1 if ok else min(streak, 0) - 1
        self._streaks[worker.url] = streak
        if ok and worker.healthy is not True and streak >= self.success_threshold:
            logger.info("worker %s is healthy", worker.name)
            worker.healthy = True
            worker.kv_transfer_addr = None  # a restarted decode worker may listen elsewhere
            worker.breaker.record_success()
        elif not ok and worker.healthy is not False and (worker.healthy is None or -streak >= self.failure_threshold):
            logger.warning("worker %s is unhealthy: %s", worker.name, reason)
            worker.healthy = False

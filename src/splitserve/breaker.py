"""One circuit breaker for every dependency that can fail: a worker behind the router, a Redis L2 tier.

Opens after ``failure_threshold`` consecutive failures. While open, calls are refused for a back-off; then the
breaker is half-open and lets one trial call through. The trial's success closes the breaker (and resets the
back-off); its failure re-opens it with the back-off doubled, up to ``max_backoff_s``. A trial that never
reports an outcome (a cancelled request) stops blocking others after one back-off.

Callers either ask ``allow()``, which also claims the trial, or peek with ``allows()`` and claim the trial
with ``on_attempt()`` once they commit to the call (the router peeks at every worker, then calls one). Every
allowed call must end in ``record_success`` or ``record_failure``. Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import IntEnum


class BreakerState(IntEnum):  # the values are the router's breaker-state gauge
    CLOSED = 0  # calls go through
    OPEN = 1  # calls are refused until the back-off has passed
    HALF_OPEN = 2  # one trial call may go through; its outcome closes or re-opens the breaker


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int = 3,
        base_backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1 or base_backoff_s <= 0 or max_backoff_s < base_backoff_s:
            raise ValueError(
                f"need failure_threshold >= 1 and 0 < base_backoff_s <= max_backoff_s, got "
                f"{failure_threshold=}, {base_backoff_s=}, {max_backoff_s=}"
            )
        self.failure_threshold = failure_threshold
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._num_consecutive_failures = 0
        self._num_consecutive_opens = 0  # openings since the last success: the back-off doubles with each
        self._retry_at: float | None = None  # open until then, half-open after; None while closed
        self._open_for_s = base_backoff_s  # the back-off of the current opening
        self._trial_started_at: float | None = None  # a half-open trial in flight since then
        self.num_opens = 0  # times the breaker went from closed to open

    @property
    def state(self) -> BreakerState:
        retry_at = self._retry_at
        if retry_at is None:
            return BreakerState.CLOSED
        return BreakerState.OPEN if self._clock() < retry_at else BreakerState.HALF_OPEN

    @property
    def backoff_s(self) -> float:
        """The back-off the next opening will use."""
        return min(self.max_backoff_s, self.base_backoff_s * 2.0**self._num_consecutive_opens)

    def allows(self) -> bool:
        """Whether a call may be made now, without claiming the half-open trial (see ``on_attempt``)."""
        with self._lock:
            return self._allows()

    def on_attempt(self) -> None:
        """A call allowed by ``allows()`` is being made: while half-open, it is the trial."""
        with self._lock:
            if self.state is BreakerState.HALF_OPEN:
                self._trial_started_at = self._clock()

    def allow(self) -> bool:
        """``allows()`` and ``on_attempt()`` in one step."""
        with self._lock:
            if not self._allows():
                return False
            if self.state is BreakerState.HALF_OPEN:
                self._trial_started_at = self._clock()
            return True

    def record_success(self) -> bool:
        """Report a successful call; returns True when this closed an open or half-open breaker."""
        with self._lock:
            was_open = self._retry_at is not None
            self._retry_at = self._trial_started_at = None
            self._num_consecutive_failures = self._num_consecutive_opens = 0
            return was_open

    def record_failure(self) -> bool:
        """Report a failed call; returns True when this opened a closed breaker (not on a failed trial)."""
        with self._lock:
            self._num_consecutive_failures += 1
            state = self.state
            if state is BreakerState.OPEN:
                return False  # a call that started before the breaker opened
            if state is BreakerState.CLOSED and self._num_consecutive_failures < self.failure_threshold:
                return False
            self._open_for_s = self.backoff_s
            self._retry_at = self._clock() + self._open_for_s
            self._trial_started_at = None
            self._num_consecutive_opens += 1
            opened = state is BreakerState.CLOSED
            self.num_opens += opened
            return opened

    def _allows(self) -> bool:
        state = self.state
        if state is not BreakerState.HALF_OPEN:
            return state is BreakerState.CLOSED
        started = self._trial_started_at
        return started is None or self._clock() - started >= self._open_for_s

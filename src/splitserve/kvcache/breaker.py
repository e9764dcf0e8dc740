"""A circuit breaker: stop calling a dependency that keeps failing, and probe it again after a back-off."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"  # calls go through
    OPEN = "open"  # calls are refused until the back-off has passed
    HALF_OPEN = "half_open"  # one trial call is in flight; its outcome closes or re-opens the breaker


class CircuitBreaker:
    """Opens after ``failure_threshold`` consecutive failures; while open, ``allow()`` is False.

    After the back-off one caller is let through (half-open). A success closes the breaker and resets the
    back-off; a failure re-opens it with the back-off doubled, up to ``max_backoff_s``. Thread-safe; callers must
    report the outcome of every allowed call with ``record_success`` or ``record_failure``.
    """

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
        self._state = BreakerState.CLOSED
        self._num_consecutive_failures = 0
        self._num_consecutive_opens = 0
        self._retry_at = 0.0
        self.num_opens = 0  # times the breaker went from closed to open

    @property
    def state(self) -> BreakerState:
        return self._state

    @property
    def backoff_s(self) -> float:
        """The back-off the next opening will use."""
        return min(self.max_backoff_s, self.base_backoff_s * 2.0**self._num_consecutive_opens)

    def allow(self) -> bool:
        """Whether a call may be made now; in the open state, lets one trial through once the back-off passed."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.OPEN and self._clock() >= self._retry_at:
                self._state = BreakerState.HALF_OPEN
                return True
            return False

    def record_success(self) -> bool:
        """Report a successful call; returns True when this closed an open breaker."""
        with self._lock:
            was_open = self._state is not BreakerState.CLOSED
            self._state = BreakerState.CLOSED
            self._num_consecutive_failures = 0
            self._num_consecutive_opens = 0
            return was_open

    def record_failure(self) -> bool:
        """Report a failed call; returns True when this opened a closed breaker (not on a failed trial)."""
        with self._lock:
            self._num_consecutive_failures += 1
            if self._state is BreakerState.CLOSED and self._num_consecutive_failures < self.failure_threshold:
                return False
            was_closed = self._state is BreakerState.CLOSED
            self._retry_at = self._clock() + self.backoff_s
            self._num_consecutive_opens += 1
            self._state = BreakerState.OPEN
            self.num_opens += was_closed
            return was_closed

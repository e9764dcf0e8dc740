"""The load guard of the cache-aware strategies, on anything that reports its load.

When the worker a strategy would pick has badly more requests in flight than the least-loaded one (SGLang's
cache-aware router uses the same two thresholds), the request goes to the least-loaded worker instead, so one
hot prefix cannot pin all traffic to one worker. A match covering less than ``cache_threshold`` of the prompt
(a shared system prompt before a new conversation) is not worth queueing for either. The least-loaded worker is
the one with the least prefill queued on it (the uncached tokens of requests sent there that have not started
to answer), then the fewest requests in flight: counting requests alone, a worker busy with one long cold
prompt looked as free as one streaming a short answer.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class Loaded(Protocol):
    """What the guard looks at on a worker."""

    in_flight: int  # requests sent there and not finished
    pending_prefill_tokens: int  # uncached tokens of those that have not started to answer


W = TypeVar("W", bound=Loaded)


@dataclass(frozen=True)
class Decision(Generic[W]):
    """A pick: the worker, why (for metrics and logs: roundrobin, session, matched, prefix_index, fallback,
    load_guard, below_threshold...), the prompt tokens it is believed to hold, and those it must compute
    (counted as its queued prefill until it answers)."""

    worker: W
    outcome: str
    matched_tokens: int = 0
    uncached_tokens: int = 0


class LoadGuard:
    def __init__(self, abs_threshold: int, rel_threshold: float, cache_threshold: float = 0.0) -> None:
        self.abs_threshold = abs_threshold
        self.rel_threshold = rel_threshold
        self.cache_threshold = cache_threshold
        self._tie = itertools.count()

    def check(self, chosen: W, num_tokens: int, candidates: Sequence[W], matched: int, worth: float) -> Decision[W]:
        """``chosen`` (outcome ``matched``, ``matched`` tokens) unless the match is worth less than
        ``cache_threshold`` of the prompt's ``num_tokens``, or ``chosen`` is too busy."""
        if num_tokens and worth < self.cache_threshold * num_tokens:
            return Decision(self.least_loaded(candidates), "below_threshold", 0, num_tokens)
        if self.is_skewed(chosen, candidates):
            return Decision(self.least_loaded(candidates), "load_guard", 0, num_tokens)
        return Decision(chosen, "matched", matched, max(0, num_tokens - matched))

    def least_loaded(self, candidates: Sequence[W]) -> W:
        """The least queued prefill, then the fewest requests in flight; ties rotate (never at random)."""

        def load(worker: W) -> tuple[int, int]:
            return worker.pending_prefill_tokens, worker.in_flight

        least = min(load(w) for w in candidates)
        tied = [w for w in candidates if load(w) == least]
        return tied[next(self._tie) % len(tied)]

    def is_skewed(self, chosen: W, candidates: Sequence[W]) -> bool:
        least = min(w.in_flight for w in candidates)
        gap = chosen.in_flight - least
        return gap > self.abs_threshold and chosen.in_flight > self.rel_threshold * (least + 1)

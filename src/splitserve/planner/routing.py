"""The router's strategies as the simulator sees them: a request's prompt is only its prefix group.

Each strategy follows ``splitserve.router.policies`` with prompts reduced to ``(prefix_group, prefix_tokens)``:

- ``roundrobin``: the next worker in turn.
- ``session``: the prefix group is the session id, hashed onto the same consistent-hash ring as the router's
  (xxh3, 64 virtual nodes per worker); no group: the least-loaded worker.
- ``prefixaware``: the worker the router last sent the group to (its own index; it never hears of evictions),
  matching as many tokens as it sent then; no match: the least-loaded worker.
- ``kvaware``: the worker whose caches hold most of the group, by what the workers really hold (engine and L1
  in full, the shared L2 at ``L2_WEIGHT``); nothing held anywhere: ``prefixaware``.

The cache-aware ones share the router's guards: a match under ``CACHE_THRESHOLD`` of the prompt, or a chosen
worker with badly more requests in flight than the least-loaded one, goes to the least-loaded worker.
Torch-free and deterministic: ties rotate on a counter, never at random.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import xxhash

from splitserve.config import RouterConfig, RoutingStrategy

_DEFAULTS = RouterConfig()
CACHE_THRESHOLD = _DEFAULTS.cache_threshold
BALANCE_ABS = _DEFAULTS.balance_abs_threshold
BALANCE_REL = _DEFAULTS.balance_rel_threshold
L2_WEIGHT = _DEFAULTS.l2_weight
RING_SEED = 0x5E55_1011  # the router's (router/policies.py)
VNODES_PER_WORKER = 64


class RoutedWorker(Protocol):
    """What a strategy may look at on a worker."""

    name: str
    in_flight: int  # requests routed to it and not finished

    def held_tokens(self, group: str, max_tokens: int) -> tuple[int, int]:
        """Tokens of ``group`` (at most ``max_tokens``) in its engine cache plus L1, and in the shared L2."""
        ...


@dataclass(frozen=True, slots=True)
class RoutingQuery:
    prompt_tokens: int
    prefix_group: str | None
    prefix_tokens: int


@dataclass(frozen=True, slots=True)
class Routed:
    """A strategy's pick, and the prompt tokens it believes the worker holds (the router's ``matched_tokens``:
    a disaggregated endpoint sends a request straight to decode when the rest is under the threshold)."""

    worker: RoutedWorker
    matched_tokens: int = 0


class _Guard:
    def __init__(self) -> None:
        self._tie = itertools.count()

    def least_loaded(self, workers: Sequence[RoutedWorker]) -> RoutedWorker:
        least = min(w.in_flight for w in workers)
        tied = [w for w in workers if w.in_flight == least]
        return tied[next(self._tie) % len(tied)]

    def check(
        self, chosen: RoutedWorker, query: RoutingQuery, workers: Sequence[RoutedWorker], matched: int, worth: float
    ) -> Routed:
        """``chosen`` with its ``matched`` tokens, unless the match is not worth it or ``chosen`` is too busy."""
        if worth < CACHE_THRESHOLD * query.prompt_tokens:
            return Routed(self.least_loaded(workers), 0)
        least = min(w.in_flight for w in workers)
        if chosen.in_flight - least > BALANCE_ABS and chosen.in_flight > BALANCE_REL * (least + 1):
            return Routed(self.least_loaded(workers), 0)
        return Routed(chosen, matched)


class SimRouter:
    """One pool's strategy (a disaggregated endpoint has one per pool, as the router does)."""

    def __init__(self, strategy: RoutingStrategy, workers: Sequence[RoutedWorker]) -> None:
        self.strategy = strategy
        self.workers = list(workers)
        self._turn = itertools.count()
        self._guard = _Guard()
        self._index: dict[str, tuple[RoutedWorker, int]] = {}  # prefixaware: group -> (worker, tokens sent)
        ring = ((_ring_hash(f"{w.name}#{i}"), j) for j, w in enumerate(self.workers) for i in range(VNODES_PER_WORKER))
        self._ring = sorted(ring)

    def select(self, query: RoutingQuery) -> Routed:
        """The worker for ``query``; records the choice (prefixaware's index)."""
        routed = self._select(query)
        if query.prefix_group is not None:
            self._index[query.prefix_group] = (routed.worker, query.prompt_tokens)
        return routed

    def _select(self, query: RoutingQuery) -> Routed:
        if self.strategy == RoutingStrategy.ROUNDROBIN:
            return Routed(self.workers[next(self._turn) % len(self.workers)])
        if query.prefix_group is None:
            return Routed(self._guard.least_loaded(self.workers))
        if self.strategy == RoutingStrategy.SESSION:
            start = bisect.bisect_left(self._ring, (_ring_hash(query.prefix_group), -1))
            return Routed(self.workers[self._ring[start % len(self._ring)][1]])
        if self.strategy == RoutingStrategy.KVAWARE:
            return self._kvaware(query)
        return self._prefixaware(query)

    def _prefixaware(self, query: RoutingQuery) -> Routed:
        assert query.prefix_group is not None
        entry = self._index.get(query.prefix_group)
        if entry is None:
            return Routed(self._guard.least_loaded(self.workers))
        worker, sent = entry
        matched = min(sent, query.prefix_tokens)
        return self._guard.check(worker, query, self.workers, matched, matched)

    def _kvaware(self, query: RoutingQuery) -> Routed:
        assert query.prefix_group is not None
        scored = []
        for worker in self.workers:
            local, shared = worker.held_tokens(query.prefix_group, query.prefix_tokens)
            scored.append((local + L2_WEIGHT * shared, max(local, shared), worker))
        best = max(score for score, _, _ in scored)
        if best <= 0:
            return self._prefixaware(query)
        _, held, chosen = min((s for s in scored if s[0] == best), key=lambda s: s[2].in_flight)
        return self._guard.check(chosen, query, self.workers, held, best)


def _ring_hash(text: str) -> int:
    return xxhash.xxh3_64_intdigest(text.encode(), seed=RING_SEED)

"""The router's strategies as the simulator sees them: a request's prompt is only its prefix group.

Each strategy follows ``splitserve.router.policies`` with prompts reduced to ``(prefix_group, prefix_tokens)``:

- ``roundrobin``: the next worker in turn.
- ``session``: the prefix group is the session id, hashed onto the same consistent-hash ring as the router's
  (xxh3, 64 virtual nodes per worker); no group: the least-loaded worker.
- ``prefixaware``: the worker the router last sent the group to (its own index; it never hears of evictions),
  matching as many tokens as it sent then; no match: the least-loaded worker.
- ``kvaware``: the worker whose caches hold most of the group, by what the workers really hold (engine and L1
  in full, then what the shared L2 holds past them at ``L2_WEIGHT``); nothing held anywhere: ``prefixaware``.

The cache-aware ones share the router's load guard and ``session`` its ring (``splitserve.policy``, one
implementation for both): a match under ``CACHE_THRESHOLD`` of the prompt, or a chosen worker with badly more
requests in flight than the least-loaded one, goes to the least-loaded worker, the one with the least prefill
queued on it (``pending_prefill_tokens``, which the simulator keeps as the router does), then the fewest
requests in flight. Matches count whole KV blocks, as the router's indexes do.
Torch-free and deterministic: ties rotate on a counter, never at random.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from splitserve.config import RouterConfig, RoutingStrategy
from splitserve.policy.balance import Decision, LoadGuard
from splitserve.policy.ring import HashRing

_DEFAULTS = RouterConfig()
CACHE_THRESHOLD = _DEFAULTS.cache_threshold
L2_WEIGHT = _DEFAULTS.l2_weight


class RoutedWorker(Protocol):
    """What a strategy may look at on a worker."""

    name: str
    in_flight: int  # requests routed to it and not finished
    pending_prefill_tokens: int  # uncached tokens of those that have not started to answer

    def held_tokens(self, group: str, max_tokens: int) -> tuple[int, int]:
        """Tokens of ``group`` (at most ``max_tokens``) in its engine cache plus L1, and in the shared L2."""
        ...


@dataclass(frozen=True, slots=True)
class RoutingQuery:
    prompt_tokens: int
    prefix_group: str | None
    prefix_tokens: int


Routed = Decision[RoutedWorker]  # the pick, the tokens it is believed to hold and those it must compute


class SimRouter:
    """One pool's strategy (a disaggregated endpoint has one per pool, as the router does)."""

    def __init__(self, strategy: RoutingStrategy, workers: Sequence[RoutedWorker], block_size: int = 16) -> None:
        self.strategy = strategy
        self.workers = list(workers)
        self.block_size = block_size
        self._turn = itertools.count()
        self._guard = LoadGuard(_DEFAULTS.balance_abs_threshold, _DEFAULTS.balance_rel_threshold, CACHE_THRESHOLD)
        self._index: dict[str, tuple[RoutedWorker, int]] = {}  # prefixaware: group -> (worker, tokens sent)
        self._by_name = {w.name: w for w in self.workers}
        self._ring = HashRing(self._by_name)

    def select(self, query: RoutingQuery) -> Routed:
        """The worker for ``query``; records the choice (prefixaware's index)."""
        routed = self._select(query)
        if query.prefix_group is not None:
            self._index[query.prefix_group] = (routed.worker, query.prompt_tokens)
        return routed

    def _select(self, query: RoutingQuery) -> Routed:
        # roundrobin and session do not tokenize: the router counts none of their tokens as queued prefill
        if self.strategy == RoutingStrategy.ROUNDROBIN:
            return Decision(self.workers[next(self._turn) % len(self.workers)], "roundrobin")
        if self.strategy == RoutingStrategy.SESSION:
            if query.prefix_group is None:
                return Decision(self._guard.least_loaded(self.workers), "least_loaded")
            return Decision(self._by_name[self._ring.owner(query.prefix_group)], "session")
        if query.prefix_group is None:
            return Decision(self._guard.least_loaded(self.workers), "fallback", 0, query.prompt_tokens)
        if self.strategy == RoutingStrategy.KVAWARE:
            return self._kvaware(query)
        return self._prefixaware(query)

    def _blocks(self, tokens: float) -> int:
        return int(tokens) // self.block_size * self.block_size

    def _prefixaware(self, query: RoutingQuery) -> Routed:
        assert query.prefix_group is not None
        entry = self._index.get(query.prefix_group)
        matched = self._blocks(min(entry[1], query.prefix_tokens)) if entry is not None else 0
        if entry is None or matched == 0:
            return Decision(self._guard.least_loaded(self.workers), "fallback", 0, query.prompt_tokens)
        return self._guard.check(entry[0], query.prompt_tokens, self.workers, matched, matched)

    def _kvaware(self, query: RoutingQuery) -> Routed:
        assert query.prefix_group is not None
        scored = []
        for worker in self.workers:
            local, shared = (self._blocks(t) for t in worker.held_tokens(query.prefix_group, query.prefix_tokens))
            beyond = max(0, shared - local)  # as the router's index counts: the local run, then L2 past it
            scored.append((local + L2_WEIGHT * beyond, local + beyond, worker))
        best = max(score for score, _, _ in scored)
        if best <= 0:
            return self._prefixaware(query)
        _, held, chosen = min((s for s in scored if s[0] == best), key=lambda s: s[2].in_flight)
        return self._guard.check(chosen, query.prompt_tokens, self.workers, held, best)

"""The router's strategies as the simulator sees them: a request's prompt is only its prefix group.

Each strategy follows ``splitserve.router.policies`` with prompts reduced to ``(prefix_group, prefix_tokens)``:

- ``roundrobin``: the next worker in turn.
- ``session``: the prefix group is the session id, hashed onto the same consistent-hash ring as the router's
  (xxh3, 64 virtual nodes per worker); no group: the least-loaded worker.
- ``prefixaware``: the worker the router last sent the group to (its own index; it never hears of evictions),
  matching as many tokens as it sent then; no match: the least-loaded worker.
- ``kvaware``: the worker whose caches hold most of the group, by what the workers really hold (engine and L1
  in full, then what the shared L2 holds past them at ``L2_WEIGHT``); nothing held anywhere: ``prefixaware``.

The cache-aware ones score as the router does (``splitserve.policy.balance``, one implementation for both): the
worker with the lowest estimated TTFT, from the prefill queued there that goes first (``pending_prefill``, which
the simulator keeps as the router does), the tokens it lacks and its seconds per prefill token (the router
measures them; here the worker's calibrated prefill cost, ``s_per_token``). With ``cost_model`` off they share
the router's load guard instead: a match under ``CACHE_THRESHOLD`` of the prompt, or a chosen worker with badly
more requests in flight than the least-loaded one, goes to the least-loaded worker, the one with the least
prefill queued on it, then the fewest requests in flight. ``session`` shares the router's ring. Matches count
whole KV blocks, as the router's indexes do.
Torch-free and deterministic: ties rotate on a counter, never at random.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from splitserve.config import RouterConfig, RoutingStrategy
from splitserve.policy import balance
from splitserve.policy.balance import Decision, LoadGuard, PendingPrefill, Unseen
from splitserve.policy.ring import HashRing

_DEFAULTS = RouterConfig()
CACHE_THRESHOLD = _DEFAULTS.cache_threshold
L2_WEIGHT = _DEFAULTS.l2_weight


class RoutedWorker(Protocol):
    """What a strategy may look at on a worker."""

    name: str
    in_flight: int  # requests routed to it and not finished
    unseen: Unseen  # NOTHING_UNSEEN: the simulated router sends every request

    @property
    def s_per_token(self) -> float:
        """Seconds per prefill token, as the router would measure them."""
        ...

    @property
    def pending_prefill(self) -> PendingPrefill:
        """Uncached tokens of those that have not started to answer."""
        ...

    @property
    def pending_prefill_tokens(self) -> int: ...

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

    def __init__(
        self,
        strategy: RoutingStrategy,
        workers: Sequence[RoutedWorker],
        block_size: int = 16,
        cost_model: bool = _DEFAULTS.routing_cost_model,
    ) -> None:
        self.strategy = strategy
        self.workers = list(workers)
        self.block_size = block_size
        self.cost_model = cost_model
        self._turn = itertools.count()
        self._prefix_turn = itertools.count()  # the router's prefixaware policy counts its own ties
        self._guard = LoadGuard(_DEFAULTS.balance_abs_threshold, _DEFAULTS.balance_rel_threshold, CACHE_THRESHOLD)
        self._index: dict[str, tuple[RoutedWorker, int]] = {}  # prefixaware: group -> (newest worker, tokens sent)
        self._sent: dict[str, dict[str, int]] = {}  # prefixaware: group -> worker -> most tokens sent
        self._by_name = {w.name: w for w in self.workers}
        self._ring = HashRing(self._by_name)

    def select(self, query: RoutingQuery) -> Routed:
        """The worker for ``query``; records the choice (prefixaware's index)."""
        routed = self._select(query)
        if query.prefix_group is not None:
            self._index[query.prefix_group] = (routed.worker, query.prompt_tokens)
            sent = self._sent.setdefault(query.prefix_group, {})
            sent[routed.worker.name] = max(sent.get(routed.worker.name, 0), query.prompt_tokens)
        return routed

    def _select(self, query: RoutingQuery) -> Routed:
        # roundrobin and session do not tokenize: the router counts none of their tokens as queued prefill
        if self.strategy == RoutingStrategy.ROUNDROBIN:
            return Decision(self.workers[next(self._turn) % len(self.workers)], "roundrobin")
        if self.strategy == RoutingStrategy.SESSION:
            if query.prefix_group is None:
                return Decision(self._guard.least_loaded(self.workers), "least_loaded")
            return Decision(self._by_name[self._ring.owner(query.prefix_group)], "session")
        if self.cost_model:
            return self._kvaware_cost(query) if self.strategy == RoutingStrategy.KVAWARE else self._prefix_cost(query)
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

    def _cheapest(self, query: RoutingQuery, held: dict[str, int], turn: int) -> Routed:
        """``router.policies.cost_decision``: the lowest estimated TTFT, given the tokens each worker holds."""
        options = [(w, max(0, query.prompt_tokens - held.get(w.name, 0))) for w in self.workers]
        worker, uncached = balance.cheapest(options, lambda w: w.s_per_token, turn)
        matched = query.prompt_tokens - uncached
        return Decision(worker, "matched" if matched > 0 else "least_cost", matched, uncached)

    def _prefix_cost(self, query: RoutingQuery) -> Routed:
        sent = self._sent.get(query.prefix_group, {}) if query.prefix_group is not None else {}
        held = {name: self._blocks(min(tokens, query.prefix_tokens)) for name, tokens in sent.items()}
        return self._cheapest(query, held, next(self._prefix_turn))

    def _kvaware_cost(self, query: RoutingQuery) -> Routed:
        if query.prefix_group is None:
            return self._prefix_cost(query)
        held: dict[str, int] = {}
        for worker in self.workers:
            local, shared = (self._blocks(t) for t in worker.held_tokens(query.prefix_group, query.prefix_tokens))
            held[worker.name] = int(local + L2_WEIGHT * max(0, shared - local))
        if max(held.values()) <= 0:
            return self._prefix_cost(query)
        return self._cheapest(query, held, next(self._turn))

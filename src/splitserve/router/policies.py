"""Routing strategies: each picks one worker among the routable candidates for a request.

Every policy implements :class:`RoutingPolicy` and is built by :func:`build_policy` from the registry. The
cache-aware ones pick, by default, the worker with the lowest estimated TTFT (``policy.balance``'s score, with the
seconds per token ``router/cost.py`` measures; the planner's simulator scores the same way): a prefix held is
worth the prefill it saves there, and the prefill queued there costs what it delays the request, so a conversation
stays on its worker until that worker is saturated, and a prefix every worker holds counts for nothing. With
``--no-routing-cost-model`` they share a load guard instead: when the worker they would pick has badly more
requests in flight than the least-loaded one, the request goes to the least-loaded worker, and a match covering
less than ``cache_threshold`` of the prompt goes there too. ``session`` hashes onto ``policy.ring``'s ring.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from splitserve.config import RouterConfig, RoutingStrategy
from splitserve.keys import hash_blocks, salt_root
from splitserve.policy import balance
from splitserve.policy.balance import LoadGuard
from splitserve.policy.ring import HashRing
from splitserve.router.cost import PrefillCostModel, cheapest
from splitserve.router.discovery import Worker
from splitserve.router.kv_index import KVIndex, PrefixIndex, TierMatch

logger = logging.getLogger(__name__)


@dataclass
class RoutingRequest:
    """What a policy may look at. ``token_ids`` is set only for policies that ask (``needs_tokens``)."""

    path: str
    session_id: str | None = None
    token_ids: list[int] | None = None
    block_size: int = 16
    cache_salt: str | None = None  # the request's tenant: its hashes are the workers' (``keys.salt_root``)
    _block_hashes: list[int] | None = field(default=None, repr=False)

    @property
    def block_hashes(self) -> list[int]:
        if self._block_hashes is None:
            root = salt_root(self.cache_salt)
            self._block_hashes = hash_blocks(self.token_ids or [], self.block_size, parent_hash=root)
        return self._block_hashes


Decision = balance.Decision[Worker]


class RoutingPolicy(Protocol):
    name: str
    needs_tokens: bool

    def select(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Decision:
        """Pick one of ``candidates`` (never empty)."""
        ...

    def on_routed(self, request: RoutingRequest, worker: Worker) -> None:
        """The request was accepted by ``worker`` (its response started)."""
        ...


class RoundRobinPolicy:
    name = RoutingStrategy.ROUNDROBIN.value
    needs_tokens = False

    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Decision:
        return Decision(candidates[next(self._counter) % len(candidates)], "roundrobin")

    def on_routed(self, request: RoutingRequest, worker: Worker) -> None:
        pass


class SessionPolicy:
    """Consistent hashing of the session id over every configured worker (healthy or not), so a session
    stays put while other workers come and go; an unroutable owner hands over to the next on the ring.
    Requests without a session go to the least-loaded worker."""

    name = RoutingStrategy.SESSION.value
    needs_tokens = False

    def __init__(self, all_workers: Callable[[], Sequence[Worker]], guard: LoadGuard) -> None:
        self._all_workers = all_workers
        self._guard = guard
        self._ring = HashRing(())

    def select(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Decision:
        if not request.session_id:
            return Decision(self._guard.least_loaded(candidates), "least_loaded")
        by_url = {w.url: w for w in candidates}
        for i, url in enumerate(self._current_ring().walk(request.session_id)):
            worker = by_url.get(url)
            if worker is not None:
                return Decision(worker, "session" if i == 0 else "handover")
        return Decision(self._guard.least_loaded(candidates), "least_loaded")

    def on_routed(self, request: RoutingRequest, worker: Worker) -> None:
        pass

    def _current_ring(self) -> HashRing:
        urls = tuple(sorted({w.url for w in self._all_workers()}))
        if urls != self._ring.names:
            self._ring = HashRing(urls)
        return self._ring


class PrefixAwarePolicy:
    """By the router's own index of what it sent where (no events). With the cost model (the default), the worker
    with the lowest estimated TTFT, counting what the index says each worker was sent as cached there; without,
    the worker last sent the longest matching prefix, under the load guard."""

    name = RoutingStrategy.PREFIXAWARE.value
    needs_tokens = True

    def __init__(self, index: PrefixIndex, guard: LoadGuard, cost: PrefillCostModel | None = None) -> None:
        self.index = index
        self._guard = guard
        self.cost = cost
        self._turn = itertools.count()

    def select(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Decision:
        if self.cost is not None:
            held = {url: n * request.block_size for url, n in self.index.matches(request.block_hashes).items()}
            return cost_decision(self.cost, request, candidates, held, next(self._turn), "matched")
        owner, num_blocks = self.index.match(request.block_hashes)
        chosen = next((w for w in candidates if w.url == owner), None)
        matched = num_blocks * request.block_size if chosen is not None else 0
        if chosen is None:
            return Decision(self._guard.least_loaded(candidates), "fallback", 0, len(request.token_ids or []))
        return self._guard.check(chosen, len(request.token_ids or []), candidates, matched, matched)

    def on_routed(self, request: RoutingRequest, worker: Worker) -> None:
        self.index.insert(request.block_hashes, worker.url)


class KVAwarePolicy:
    """The worker holding the most of the prompt's KV by the workers' own events: engine cache and L1 count
    in full, the shared L2 at ``l2_weight`` (it helps every worker alike, so it mostly breaks ties). Where no
    worker's events show any of the prompt (a new prompt, or workers whose events are not coming), the
    router's own prefix index decides, as ``prefixaware`` would."""

    name = RoutingStrategy.KVAWARE.value
    needs_tokens = True

    def __init__(
        self,
        index: KVIndex,
        guard: LoadGuard,
        l2_weight: float,
        prefix: PrefixIndex,
        cost: PrefillCostModel | None = None,
    ) -> None:
        self.index = index
        self._guard = guard
        self.l2_weight = l2_weight
        self.prefix = PrefixAwarePolicy(prefix, guard, cost)
        self.cost = cost
        self._turn = itertools.count()

    def select(self, request: RoutingRequest, candidates: Sequence[Worker]) -> Decision:
        hashes = request.block_hashes
        matches = [(self._score(m := self.index.match(hashes, w.url)), m, w) for w in candidates]
        best_score = max(score for score, _, _ in matches)
        if self.cost is not None and best_score > 0:
            held = {w.url: int(score) for score, _, w in matches}
            return cost_decision(self.cost, request, candidates, held, next(self._turn), "matched")
        if best_score <= 0:
            decision = self.prefix.select(request, candidates)
            return (
                decision
                if decision.outcome in ("fallback", "least_cost")
                else replace(decision, outcome="prefix_index")
            )
        best = [(m, w) for score, m, w in matches if score == best_score]
        match, chosen = min(best, key=lambda mw: mw[1].in_flight)
        return self._guard.check(chosen, len(request.token_ids or []), candidates, match.total, best_score)

    def on_routed(self, request: RoutingRequest, worker: Worker) -> None:
        self.prefix.on_routed(request, worker)  # the worker's own events will say exactly what it now holds

    def _score(self, match: TierMatch) -> float:
        return match.engine + match.l1 + self.l2_weight * match.l2


def cost_decision(
    cost: PrefillCostModel,
    request: RoutingRequest,
    candidates: Sequence[Worker],
    held: dict[str, int],
    turn: int,
    outcome: str,
) -> Decision:
    """The candidate with the lowest estimated TTFT, given the tokens each holds (``held``, by URL). The
    outcome is ``outcome`` where the pick holds some of the prompt, else ``least_cost``."""
    num_tokens = len(request.token_ids or [])
    options = [(w, max(0, num_tokens - held.get(w.url, 0))) for w in candidates]
    worker, uncached = cheapest(cost, options, turn)
    matched = num_tokens - uncached
    return Decision(worker, outcome if matched > 0 else "least_cost", matched, uncached)


@dataclass(frozen=True)
class PolicyContext:
    """What a policy factory may use."""

    config: RouterConfig
    all_workers: Callable[[], Sequence[Worker]]
    kv_index: KVIndex
    guard: LoadGuard
    cost: PrefillCostModel | None = None


POLICIES: dict[RoutingStrategy, Callable[[PolicyContext], RoutingPolicy]] = {
    RoutingStrategy.ROUNDROBIN: lambda ctx: RoundRobinPolicy(),
    RoutingStrategy.SESSION: lambda ctx: SessionPolicy(ctx.all_workers, ctx.guard),
    RoutingStrategy.PREFIXAWARE: lambda ctx: PrefixAwarePolicy(
        PrefixIndex(ctx.config.prefix_index_max_blocks), ctx.guard, ctx.cost
    ),
    RoutingStrategy.KVAWARE: lambda ctx: KVAwarePolicy(
        ctx.kv_index, ctx.guard, ctx.config.l2_weight, PrefixIndex(ctx.config.prefix_index_max_blocks), ctx.cost
    ),
}


def build_policy(
    config: RouterConfig,
    all_workers: Callable[[], Sequence[Worker]],
    kv_index: KVIndex,
    cost: PrefillCostModel | None = None,
) -> RoutingPolicy:
    """The configured strategy; the cache-aware ones pick by ``cost`` when given, else by their thresholds."""
    guard = LoadGuard(config.balance_abs_threshold, config.balance_rel_threshold, config.cache_threshold)
    return POLICIES[config.routing_strategy](PolicyContext(config, all_workers, kv_index, guard, cost))

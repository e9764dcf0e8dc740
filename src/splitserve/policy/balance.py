"""How the cache-aware strategies weigh a prefix against load, on anything that reports its load.

**The score** (the default): the estimated time to first token of the request on each worker,

    (the queued prefill it would wait for there + its tokens that worker does not hold
     + the streams decoding there x the steps its prefill spans) x the worker's seconds per prefill token,

where the queued prefill it waits for is that of the requests sent there that have not answered, each counted up to
the request's own uncached tokens (``PendingPrefill.ahead_of``): the engines schedule the fewest uncached tokens
first (``lpm``) and, with their step-time target, a short request passes a long prompt within a short step, so a
longer request ahead delays it by about its own length at most (a cached follow-up behind a cold prompt waits
little; a cold prompt behind another waits for it). Every step its prefill spans (one per
``PREFILL_TOKENS_PER_STEP`` of the tokens computed, the engine's default step budget) also carries one row of each
stream the worker is decoding (the requests in flight there that have answered), each costing about what a prompt
token does (``DECODE_ROW_TOKENS``): a worker streaming many answers is slower to start a new one, and a new
conversation whose only match is a short prefix goes to a quieter worker rather than pile onto the one holding it.
The lowest estimate wins (``cheapest``; within 10% of it, the fewest requests in flight). A cache hit is worth
exactly the prefill it saves and a queue costs exactly the prefill it holds, so affinity wins only when it saves
more than the queue costs; a prefix every worker holds (a shared system prompt) changes every estimate alike and
counts for nothing; and a conversation stays on the worker holding it until that worker has so many shorter requests
queued that recomputing the history elsewhere is faster ("sticky until saturated", as llm-d's and SGLang's balancers
switch to load). The seconds per token are measured by the router (``router/cost.py``) or calibrated by the planner.

**The load guard** (``--no-routing-cost-model``, SGLang's cache-aware router's thresholds):

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
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from splitserve.config import DEFAULT_MAX_NUM_BATCHED_TOKENS

SCORE_TOLERANCE = 1.1  # scores within 10% of the lowest are ties
PREFILL_TOKENS_PER_STEP = DEFAULT_MAX_NUM_BATCHED_TOKENS  # the engine's default step budget
# A decode row's cost in a step, in prompt tokens: on a CPU both are a row through every matrix (a decode row
# also reads its context's KV, which a prompt token of a short prompt does not), within a factor of 2 at 135M-1B.
DECODE_ROW_TOKENS = 1.0


class PendingPrefill:
    """The uncached tokens of each request sent to a worker that has not started to answer, as a multiset: what a
    new request waits for there depends on which of them go before it."""

    __slots__ = ("_counts", "num_requests", "total")

    def __init__(self) -> None:
        self._counts: Counter[int] = Counter()
        self.total = 0
        self.num_requests = 0

    def add(self, tokens: int) -> None:
        if tokens > 0:
            self._counts[tokens] += 1
            self.total += tokens
            self.num_requests += 1

    def remove(self, tokens: int) -> None:
        if tokens > 0 and self._counts[tokens] > 0:
            self._counts[tokens] -= 1
            if not self._counts[tokens]:
                del self._counts[tokens]
            self.total -= tokens
            self.num_requests -= 1

    def ahead_of(self, uncached: int) -> int:
        """The pending tokens a request with ``uncached`` tokens to compute waits for: all of those of the requests
        with no more than it (``lpm`` runs them first; ties in arrival order, and they arrived first), and of each
        longer one as much as its own (a running prompt's chunks share the steps with it)."""
        return sum(min(tokens, uncached) * count for tokens, count in self._counts.items())


@dataclass(frozen=True, slots=True)
class Unseen:
    """What a worker reports running beyond what this router sent it: the requests other router replicas sent
    (``router/discovery.py``, ``Worker.unseen``)."""

    requests: int = 0  # not answered yet (waiting or prefilling)
    tokens: int = 0  # their prompt tokens still to compute
    decoding: int = 0  # streams


NOTHING_UNSEEN = Unseen()


class Loaded(Protocol):
    """What the score and the guard look at on a worker."""

    in_flight: int  # requests sent there and not finished

    @property
    def unseen(self) -> Unseen:
        """The load others put there (``NOTHING_UNSEEN`` where this is the only router)."""
        ...

    @property
    def pending_prefill(self) -> PendingPrefill:
        """The uncached tokens of those that have not started to answer."""
        ...

    @property
    def pending_prefill_tokens(self) -> int:
        """Their sum."""
        ...


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


def answered(worker: Loaded) -> int:
    """This router's streams on ``worker``: its requests in flight there that have answered (none queued as
    prefill)."""
    return max(0, worker.in_flight - worker.pending_prefill.num_requests)


def decoding(worker: Loaded) -> int:
    """The streams ``worker`` is decoding: this router's (:func:`answered`) and those others sent."""
    return answered(worker) + worker.unseen.decoding


def load_count(worker: Loaded) -> int:
    """The requests on ``worker``: in flight from this router, and those others sent."""
    return worker.in_flight + worker.unseen.requests + worker.unseen.decoding


def work_tokens(worker: Loaded, uncached: int) -> float:
    """What a request with ``uncached`` tokens to compute waits for on ``worker``, in prompt tokens: the queued
    prefill that goes before it (of others' requests, whose sizes are not known, each up to its own as well),
    its own tokens, and a row of each decoding stream in every step that takes."""
    unseen = worker.unseen
    prefill = worker.pending_prefill.ahead_of(uncached) + min(unseen.tokens, unseen.requests * uncached) + uncached
    steps = max(1, -(-prefill // PREFILL_TOKENS_PER_STEP))
    return prefill + decoding(worker) * steps * DECODE_ROW_TOKENS


def estimated_ttft_s(worker: Loaded, uncached: int, s_per_token: float) -> float:
    """The score: the estimated TTFT of a request with ``uncached`` tokens to compute, sent to ``worker`` now."""
    return work_tokens(worker, uncached) * s_per_token


def cheapest(options: Sequence[tuple[W, int]], s_per_token: Callable[[W], float], turn: int = 0) -> tuple[W, int]:
    """The (worker, uncached tokens) of ``options`` with the lowest score. Scores within ``SCORE_TOLERANCE`` of the
    lowest are ties (the measured rates of alike workers differ by noise, which must not pick the worker): of
    those, the fewest requests in flight (the streams a worker is decoding, which the queue does not count), then
    the ``turn``-th (callers count up, so that new conversations alternate over idle workers)."""
    scores = [estimated_ttft_s(worker, uncached, s_per_token(worker)) for worker, uncached in options]
    near = [option for option, score in zip(options, scores, strict=True) if score <= min(scores) * SCORE_TOLERANCE]
    fewest = min(load_count(worker) for worker, _ in near)
    tied = [option for option in near if load_count(option[0]) == fewest]
    return tied[turn % len(tied)]


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
            return worker.pending_prefill_tokens + worker.unseen.tokens, load_count(worker)

        least = min(load(w) for w in candidates)
        tied = [w for w in candidates if load(w) == least]
        return tied[next(self._tie) % len(tied)]

    def is_skewed(self, chosen: W, candidates: Sequence[W]) -> bool:
        least = min(load_count(w) for w in candidates)
        gap = load_count(chosen) - least
        return gap > self.abs_threshold and load_count(chosen) > self.rel_threshold * (least + 1)

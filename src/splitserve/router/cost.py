"""The cache-aware policies' cost model: the estimated time to first token of a request on each worker.

    estimated TTFT(worker) = (prefill tokens queued on the worker + the request's tokens it does not hold)
                             x that worker's seconds per prefill token

- *Tokens it does not hold*: the prompt's tokens minus the worker's match in the policy's index (the workers'
  KV events for ``kvaware``, the router's own prefix index for ``prefixaware``).
- *Queued prefill tokens*: the router's own count, per worker, of the uncached tokens of the requests it sent
  there that have not yet started to answer (``Worker.pending_prefill_tokens``).
- *Seconds per prefill token*: measured, not configured. Each streamed completion's TTFT (a chat's first
  chunk can be its role alone, sent before any prefill, so chats teach nothing), over the tokens the worker
  had to compute before it (its queue then, plus the request's own), updates the worker's rate (an
  exponentially weighted mean), from answers that computed at least ``MIN_SAMPLE_TOKENS`` (below that the
  fixed costs of a step dominate). Until a worker has its own rate it gets the median of the others', or a
  prior.

The worker with the lowest estimate wins; ties go to the one with fewer requests in flight. This is the shape
of llm-d's scorers (prefix-cache score against queue score) with a measured exchange rate between the two:
a cache hit is worth exactly the prefill it saves, and a queue costs exactly the prefill it holds, so under
saturation the policies spread load as roundrobin does, and below it they follow the cache.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from splitserve.router.discovery import Worker

PRIOR_S_PER_TOKEN = 1e-3  # until some worker measured its own: ~1,000 prompt tokens/s
MIN_SAMPLE_TOKENS = 128  # answers that computed fewer tokens say more about fixed costs than about prefill
EWMA_WEIGHT = 0.2  # of each new sample


@dataclass
class PrefillCostModel:
    """Per worker seconds per prefill token, learned from streamed answers' TTFT."""

    s_per_token: dict[str, float] = field(default_factory=dict)

    def rate(self, url: str) -> float:
        """The worker's seconds per prefill token: its own, else the median of the others', else the prior."""
        own = self.s_per_token.get(url)
        if own is not None:
            return own
        return statistics.median(self.s_per_token.values()) if self.s_per_token else PRIOR_S_PER_TOKEN

    def estimate_s(self, worker: Worker, uncached_tokens: int) -> float:
        """Estimated TTFT of a request with ``uncached_tokens`` to compute, sent to ``worker`` now."""
        return (worker.pending_prefill_tokens + uncached_tokens) * self.rate(worker.url)

    def observe(self, url: str, ttft_s: float, tokens_computed: int) -> None:
        """A streamed answer's TTFT after ``tokens_computed`` prefill tokens (queued ahead of it, and its own)."""
        if tokens_computed < MIN_SAMPLE_TOKENS or ttft_s <= 0:
            return
        sample = ttft_s / tokens_computed
        old = self.s_per_token.get(url)
        self.s_per_token[url] = sample if old is None else (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * sample


def cheapest(model: PrefillCostModel, options: list[tuple[Worker, int]], turn: int = 0) -> tuple[Worker, int]:
    """The (worker, uncached tokens) of ``options`` with the lowest estimated TTFT; ties: fewer in flight, then
    the ``turn``-th of those left (callers count up, so that new conversations alternate over idle workers)."""
    best = min((model.estimate_s(*option), option[0].in_flight) for option in options)
    tied = [option for option in options if (model.estimate_s(*option), option[0].in_flight) == best]
    return tied[turn % len(tied)]

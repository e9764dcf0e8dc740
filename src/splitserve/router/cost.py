"""The cache-aware policies' cost model: the estimated time to first token of a request on each worker, the score
of ``policy.balance`` (``estimated_ttft_s``; the planner's simulator uses the same):

    estimated TTFT(worker) = (prefill queued on the worker that goes before the request + the request's tokens
                              it does not hold + the streams decoding there x the steps its prefill spans)
                             x that worker's seconds per prefill token

- *Tokens it does not hold*: the prompt's tokens minus the worker's match in the policy's index (the workers'
  KV events for ``kvaware``, the router's own prefix index for ``prefixaware``).
- *Queued prefill that goes before it*: the router's own count, per worker, of the uncached tokens of the
  requests it sent there that have not yet started to answer (``Worker.pending_prefill``), each up to this
  request's own uncached tokens (the engines run the fewest first, and a short request passes a long prompt
  within a short step).
- *Streams decoding there*: the router's requests in flight to the worker that have answered; each puts a row
  in every step (``policy.balance.work_tokens``).
- *Seconds per prefill token*: measured, not configured. Each streamed completion's TTFT (a chat's first chunk can
  be its role alone, sent before any prefill, so chats teach nothing), over the work the worker had to do before it
  (the queue ahead of it then, its own tokens and the decode rows beside them), updates the worker's rate (an
  exponentially weighted mean), from answers that computed at least ``MIN_SAMPLE_TOKENS`` (below that the fixed
  costs of a step dominate). Until a worker has its own rate it gets the median of the others', or a prior.

The worker with the lowest estimate wins; estimates within 10% of it are ties, which go to the one with fewer
requests in flight. This is the shape
of llm-d's scorers (prefix-cache score against queue score) with a measured exchange rate between the two:
a cache hit is worth exactly the prefill it saves, and a queue costs exactly the prefill it holds, so under
saturation the policies spread load as roundrobin does, and below it they follow the cache: a conversation
stays where its history is until that worker is saturated.

The same model prices a disaggregation (``router/disagg.py``, :func:`pd_costs`): the prefill worker's estimate
plus the KV push, against the decode worker's estimate plus the stall its prefill inflicts on the requests it is
running. *Seconds per token of the push*: measured too, from each successful push as the prefill worker timed it
(its answer's ``kv_transfer_params.transfer_ms`` over ``num_tokens``), an exponentially weighted mean over pushes
of at least ``MIN_SAMPLE_TOKENS``; a prior until the first one. A prefill worker's own rate is learned from its
answers' time less the push they waited for. Not counted: the decode worker's copy of the pushed record into its
cache (the planner measured 11 us per token), which the router cannot time apart from decoding.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from splitserve.policy import balance
from splitserve.router.discovery import Worker, WorkerLease

PRIOR_S_PER_TOKEN = 1e-3  # until some worker measured its own: ~1,000 prompt tokens/s
MIN_SAMPLE_TOKENS = 128  # answers that computed fewer tokens say more about fixed costs than about prefill
EWMA_WEIGHT = 0.2  # of each new sample
# until a push was measured: this project's planner measured 0.94 GB/s at 23,040 bytes of KV per token
# (SmolLM2-135M, bfloat16, loopback; docs/planner.md), about 25 us per token
PRIOR_TRANSFER_S_PER_TOKEN = 25e-6


@dataclass
class PrefillCostModel:
    """Per worker seconds per prefill token, learned from streamed answers' TTFT (and prefill workers' answers);
    seconds per token of a KV push from prefill to decode, learned from the pushes."""

    s_per_token: dict[str, float] = field(default_factory=dict)
    transfer_s_per_token: float | None = None  # None: no push measured yet (the prior)

    def rate(self, url: str) -> float:
        """The worker's seconds per prefill token: its own, else the median of the others', else the prior."""
        own = self.s_per_token.get(url)
        if own is not None:
            return own
        return statistics.median(self.s_per_token.values()) if self.s_per_token else PRIOR_S_PER_TOKEN

    def estimate_s(self, worker: Worker, uncached_tokens: int) -> float:
        """Estimated TTFT of a request with ``uncached_tokens`` to compute, sent to ``worker`` now."""
        return balance.estimated_ttft_s(worker, uncached_tokens, self.rate(worker.url))

    def transfer_s(self, num_tokens: int) -> float:
        """Estimated seconds to push ``num_tokens`` tokens' KV from a prefill to a decode worker."""
        measured = self.transfer_s_per_token
        return num_tokens * (measured if measured is not None else PRIOR_TRANSFER_S_PER_TOKEN)

    def observe(self, url: str, ttft_s: float, work_tokens: float) -> None:
        """A streamed answer's TTFT after ``work_tokens`` of work (``policy.balance.work_tokens``: the prefill
        queued ahead of it, its own, the decode rows beside them)."""
        if work_tokens < MIN_SAMPLE_TOKENS or ttft_s <= 0:
            return
        self.s_per_token[url] = _ewma(self.s_per_token.get(url), ttft_s / work_tokens)

    def observe_transfer(self, elapsed_s: float, num_tokens: int) -> None:
        """A successful KV push of ``num_tokens`` tokens that took ``elapsed_s`` (as the prefill worker timed it)."""
        if num_tokens < MIN_SAMPLE_TOKENS or elapsed_s <= 0:
            return
        self.transfer_s_per_token = _ewma(self.transfer_s_per_token, elapsed_s / num_tokens)


def _ewma(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * sample


def cheapest(model: PrefillCostModel, options: list[tuple[Worker, int]], turn: int = 0) -> tuple[Worker, int]:
    """The (worker, uncached tokens) of ``options`` with the lowest estimated TTFT (``balance.cheapest``)."""
    return balance.cheapest(options, lambda worker: model.rate(worker.url), turn)


@dataclass(frozen=True, slots=True)
class PDCosts:
    """The estimates one disaggregation decision compares, in seconds."""

    remote_s: float  # the prefill worker's queue and uncached tokens, then the KV push of the whole prompt
    local_s: float  # the decode worker's queue and uncached tokens
    harm_s: float  # the requests running on the decode worker, each stalled for the local prefill

    @property
    def is_remote_cheaper(self) -> bool:
        return self.remote_s < self.local_s + self.harm_s


def pd_costs(
    model: PrefillCostModel, decode: tuple[Worker, int], prefill: tuple[Worker, int], num_prompt_tokens: int
) -> PDCosts:
    """The costs of prefilling a prompt of ``num_prompt_tokens`` on ``prefill`` (worker, tokens it must compute)
    and pushing its KV to ``decode`` (worker, tokens it would compute itself), against prefilling it on ``decode``.

    ``harm_s`` is what keeps decode latency flat, the point of disaggregation: a decode worker that prefills stalls
    every request it is running (the router's requests in flight to it) for as long as the prefill takes, so each
    of them counts the local prefill time once. An idle decode worker costs nothing but its own prefill, so a long
    prompt stays there (no push to pay); one running streams sends it to the prefill pool.
    """
    decoder, decode_uncached = decode
    local_prefill_s = decode_uncached * model.rate(decoder.url)
    return PDCosts(
        remote_s=model.estimate_s(*prefill) + model.transfer_s(num_prompt_tokens),
        local_s=model.estimate_s(*decode),
        harm_s=decoder.in_flight * local_prefill_s,
    )


class QueuedPrefill:
    """A request's uncached tokens, counted in its worker's queued prefill (by its ``WorkerLease``) until the
    worker answers (or fails). The first answer also teaches the cost model the worker's seconds per prefill
    token."""

    def __init__(self, lease: WorkerLease) -> None:
        self.lease = lease
        self.worker = lease.worker
        self.tokens = lease.queued_tokens
        # the work before its first token (the lease already counts its tokens as queued: not twice)
        self.work = balance.work_tokens(lease.worker, self.tokens) - self.tokens
        self.sent_s = time.perf_counter()

    def answered(self, cost: PrefillCostModel | None, not_prefill_s: float = 0.0) -> None:
        """The worker answered: teach ``cost`` the time since sending, less ``not_prefill_s`` (a prefill worker's
        KV push, which its answer waited for), over the work it waited for; then release the tokens."""
        if self.tokens and cost is not None:
            elapsed_s = time.perf_counter() - self.sent_s - not_prefill_s
            cost.observe(self.worker.url, elapsed_s, self.work)
        self.release()

    def release(self) -> None:
        """Stop counting the tokens as queued (idempotent)."""
        self.lease.answered()
        self.tokens = 0

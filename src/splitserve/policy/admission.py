"""Admission: whether a worker takes a new request now, or answers 429 so the router (or the client) tries elsewhere.

A worker counts what is ahead of a new request in the engine's :class:`Backlog` and refuses it when a bound is
reached. Each bound is named for the flag an anchor gives it, and counts what that anchor counts:

- ``--max-queued-requests`` (SGLang's): requests **waiting to start**, not yet given a seat in the running batch.
  A prompt being prefilled has its seat: it is running, not queued.
- ``--max-num-queued-reqs`` (vLLM's): requests **in flight**, waiting or running; a request with ``n``
  choices counts ``n``.
- ``--max-num-queued-tokens`` (vLLM's): prompt tokens **still to compute**, of the requests waiting or in
  prefill. vLLM counts every prefilling prompt whole; the engine here knows its progress, so a prompt's chunks
  already computed and its cache hits are not counted (a request not yet started counts whole).
- ``--max-queue-delay`` (the default bound, 30 s): the queue's delay, from what the worker measures. A request
  is refused while the oldest request waiting to start has waited that long (whatever holds it back: prompts
  ahead, seats all taken, KV full), or while the prompt tokens still to compute would take that long at the
  cost per token the engine measured on its own steps. It follows the machine and the load: a slow CPU or a
  large model refuses sooner, a fast one later, and an idle worker takes any prompt.

The queue's age is the oldest wait since a request was added or last preempted. A request with ``n`` choices is
checked once for all n; its sequences are then handed over one after another, so a request arriving in between
may see fewer of them, and while they wait each counts the prompt that the engine computes once: approximations
on the side of refusing early.

A token or delay bound refuses only when work is already ahead (``current >= bound``, as vLLM checks), so a
single long prompt is never refused by an idle worker. Refusals are counted in
``vllm:admission_rejections_total`` under vLLM's two reasons: ``max_num_queued_reqs`` for the request counts,
``max_num_queued_tokens`` for the token and delay bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

ADMISSION_QUEUED_REQUESTS = "max_num_queued_reqs"  # the reasons of vllm:admission_rejections_total
ADMISSION_QUEUED_TOKENS = "max_num_queued_tokens"


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """The bounds; None (or a delay of 0) is no bound. ``ServerConfig.validate`` checks the flags' values."""

    max_waiting: int | None = None  # --max-queued-requests
    max_in_flight: int | None = None  # --max-num-queued-reqs
    max_prefill_tokens: int | None = None  # --max-num-queued-tokens
    max_queue_delay_s: float = 0.0  # --max-queue-delay (a worker's default: 30 s, ServerConfig)


NO_LIMITS = AdmissionLimits()


@dataclass(frozen=True, slots=True)
class Backlog:
    """What is ahead of a new request on one engine."""

    num_waiting: int = 0  # requests not yet started (no seat in the running batch)
    num_in_flight: int = 0  # requests waiting or running
    prefill_tokens: int = 0  # prompt tokens still to compute, of the requests waiting or in prefill
    seconds_per_token: float | None = None  # the engine's measured prefill cost (None: not measured yet)
    oldest_waiting_since: float | None = None  # time.monotonic() the oldest waiting request arrived at
    num_prefilling: int = 0  # running requests whose prompt is not all computed

    def added(self, num_requests: int, num_prompt_tokens: int) -> Backlog:
        """This backlog with requests just handed to the engine (waiting, and whole)."""
        return Backlog(
            self.num_waiting + num_requests,
            self.num_in_flight + num_requests,
            self.prefill_tokens + num_prompt_tokens,
            self.seconds_per_token,
            self.oldest_waiting_since,
            self.num_prefilling,
        )

    def prefill_delay_s(self) -> float | None:
        """How long the prompt tokens ahead take to compute at the measured rate (None: not measured)."""
        return None if self.seconds_per_token is None else self.prefill_tokens * self.seconds_per_token


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: str  # the label of vllm:admission_rejections_total
    message: str


def refusal(limits: AdmissionLimits, backlog: Backlog, num_sequences: int, now: float) -> Refusal | None:
    """Why a request of ``num_sequences`` sequences must be refused now (None: admit it); ``now`` is
    ``time.monotonic()``."""
    if limits.max_waiting is not None and backlog.num_waiting + 1 > limits.max_waiting:
        return Refusal(ADMISSION_QUEUED_REQUESTS, f"{backlog.num_waiting} requests are already waiting to start "
                       f"(--max-queued-requests {limits.max_waiting})")  # fmt: skip
    if limits.max_in_flight is not None and backlog.num_in_flight + num_sequences > limits.max_in_flight:
        return Refusal(ADMISSION_QUEUED_REQUESTS, f"{backlog.num_in_flight} requests are already in flight "
                       f"(--max-num-queued-reqs {limits.max_in_flight})")  # fmt: skip
    if limits.max_prefill_tokens is not None and backlog.prefill_tokens >= limits.max_prefill_tokens:
        return Refusal(ADMISSION_QUEUED_TOKENS, f"{backlog.prefill_tokens} prompt tokens are already waiting to be "
                       f"computed (--max-num-queued-tokens {limits.max_prefill_tokens})")  # fmt: skip
    bound = limits.max_queue_delay_s
    if bound > 0:
        if backlog.oldest_waiting_since is not None and now - backlog.oldest_waiting_since >= bound:
            waited = now - backlog.oldest_waiting_since
            return Refusal(ADMISSION_QUEUED_TOKENS, f"the oldest request waiting to start has waited {waited:.0f} s "
                           f"(--max-queue-delay {bound:g} s)")  # fmt: skip
        delay = backlog.prefill_delay_s()
        if delay is not None and delay >= bound:
            return Refusal(ADMISSION_QUEUED_TOKENS, f"the {backlog.prefill_tokens} prompt tokens ahead take about "
                           f"{delay:.0f} s to compute (--max-queue-delay {bound:g} s)")  # fmt: skip
    return None

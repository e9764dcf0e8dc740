"""The engine scheduler's arithmetic, which the planner's simulator runs too (on token counts).

- **lpm order**: requests waiting longer than ``max_wait_s`` first (oldest first), then the fewest tokens left
  to compute first (ties: arrival order) — SGLang's longest-prefix-match policy with a bound on waiting.
- **The running-prefill cap**: when the request next in line is short (its uncached tokens fit in the step
  beside the cap), the prompts already in prefill share at most ``cap`` tokens that step, and the rest admits
  short requests whole, so a cached follow-up gets its first token in one short step.
- **Admission**: a waiting prompt takes its uncached tokens, chunked to what the budget leaves unless only
  whole prompts may go (after a cap held a running prompt back) or chunked prefill is off.
"""

from __future__ import annotations

from dataclasses import dataclass

LPM_KEY = tuple[int, float, float]


def lpm_key(arrival_s: float, num_uncached: int, oldest_allowed_s: float) -> LPM_KEY:
    """The sort key of a waiting request under ``lpm``."""
    if arrival_s < oldest_allowed_s:
        return (0, arrival_s, 0.0)
    return (1, float(num_uncached), arrival_s)


def running_prefill_cap(
    cap: int,
    *,
    num_waiting: int,
    num_running: int,
    max_num_seqs: int,
    num_decodes: int,
    max_num_batched_tokens: int,
    head_uncached: int,
) -> int | None:
    """Tokens the running prompts may take this step (``cap``), or None for no cap: there is a cap only when a
    request waits, a seat is free, and the first waiting request's ``head_uncached`` tokens fit beside it."""
    if not cap or not num_waiting or num_running >= max_num_seqs:
        return None
    room = max_num_batched_tokens - num_decodes - cap
    return cap if head_uncached <= room else None


@dataclass
class RunningBudget:
    """The step's budget as the running requests take it, in order."""

    tokens: int
    cap: int | None  # what the running prompts may still take between them; None: no cap
    held_back: bool = False  # a running prompt got less than it could: admit only whole prompts after it

    def take(self, num_left: int) -> int:
        """The tokens a running request with ``num_left`` to compute gets now (0: none this step); the caller
        takes them off ``tokens`` once they are allocated."""
        num_new = min(num_left, self.tokens)
        if num_new > 1 and self.cap is not None:  # mid-prefill, with a short request next in line
            self.held_back |= num_new > self.cap
            num_new = min(num_new, self.cap)
            self.cap -= num_new
        return num_new


def admitted_tokens(num_new: int, budget: int, *, whole_only: bool, chunked: bool = True) -> int | None:
    """The tokens a waiting prompt with ``num_new`` uncached ones is admitted with, or None: admission stops."""
    if num_new <= budget:
        return num_new
    if whole_only or not chunked:
        return None
    return budget

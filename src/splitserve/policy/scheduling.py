"""The engine scheduler's arithmetic, which the planner's simulator runs too (on token counts).

- **lpm order**: requests waiting longer than ``max_wait_s`` first (oldest first), then the fewest tokens left
  to compute first (ties: arrival order) — SGLang's longest-prefix-match policy with a bound on waiting.
- **The step-time target** (``step_budget``): each step's token budget follows from a target time and the
  engine's measured step cost (``StepRate``: a fixed cost per step plus a cost per token), not from a constant.
  A step that carries prompt chunks takes at most ``COLD_STEP_FACTOR`` targets, so a request arriving meanwhile
  waits at most that long for the step in flight; but never so few tokens that the step's fixed cost is more
  than ``MAX_FIXED_SHARE`` of it (where one step's fixed cost is near the target, a slow CPU or a large model,
  prompts would otherwise crawl). When the request next in line is short (its uncached tokens
  fit in such a step), the step takes one target: the running prompts share what the short request leaves of
  it (at least ``MIN_PREFILL_CHUNK`` tokens: cold prompts keep progressing), and the rest admits short requests
  whole, so a cached follow-up gets its first token in one short step, on whatever CPU the engine runs.
- **Admission**: a waiting prompt takes its uncached tokens, chunked to what the budget leaves unless only
  whole prompts may go (after a cap held a running prompt back) or chunked prefill is off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LPM_KEY = tuple[int, float, float]

COLD_STEP_FACTOR = 4  # a step with no short request waiting may take this many step-time targets
MIN_PREFILL_CHUNK = 16  # a running prompt's least share of a step that admits a short request
MAX_FIXED_SHARE = 0.2  # of a step carrying prompt chunks: its fixed cost at most, whatever the target
LARGE_STEP_TOKENS = 64  # steps from this many tokens teach the cost per token; smaller ones the fixed cost
RATE_WEIGHT = 0.1  # of each new step in the exponentially weighted means


def lpm_key(arrival_s: float, num_uncached: int, oldest_allowed_s: float) -> LPM_KEY:
    """The sort key of a waiting request under ``lpm``."""
    if arrival_s < oldest_allowed_s:
        return (0, arrival_s, 0.0)
    return (1, float(num_uncached), arrival_s)


@dataclass
class StepRate:
    """An engine's step time, measured, as a line in the tokens a step computes: a fixed cost (reading the
    weights, the step's own overhead) plus a cost per token. Two exponentially weighted means, of small steps
    (decodes: mostly the fixed cost) and of large ones (prompt chunks), are the line's two points; before any
    small step, the line goes through zero. Nothing is known before the first large step."""

    small: tuple[float, float] | None = None  # (mean tokens, mean seconds) of steps under LARGE_STEP_TOKENS
    large: tuple[float, float] | None = None  # the same, of steps from LARGE_STEP_TOKENS

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step that computed ``num_tokens`` tokens took ``seconds``."""
        if num_tokens <= 0 or seconds <= 0:
            return
        sample = (float(num_tokens), seconds)
        if num_tokens >= LARGE_STEP_TOKENS:
            self.large = _mean(self.large, sample)
        else:
            self.small = _mean(self.small, sample)

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds per step, seconds per token), or None before the first large step."""
        if self.large is None:
            return None
        large_tokens, large_s = self.large
        if self.small is not None:
            small_tokens, small_s = self.small
            per_token = (large_s - small_s) / (large_tokens - small_tokens)
            if per_token > 0:
                return max(0.0, small_s - per_token * small_tokens), per_token
        return 0.0, large_s / large_tokens

    def tokens_within(self, seconds: float) -> int | None:
        """The tokens a step computes in ``seconds`` (at least 1), or None while nothing is measured."""
        line = self.line()
        return None if line is None else _tokens_within(line, seconds)

    def step_tokens(self, target_s: float) -> StepTokens | None:
        """The budgets of the steps under a target of ``target_s`` (None: no target, or nothing measured yet)."""
        line = self.line() if target_s > 0 else None
        if line is None:
            return None
        fixed_s, per_token = line
        efficient = math.ceil(fixed_s * (1 - MAX_FIXED_SHARE) / MAX_FIXED_SHARE / per_token)
        cold = _tokens_within(line, COLD_STEP_FACTOR * target_s)
        return StepTokens(_tokens_within(line, target_s), max(cold, efficient))


def _tokens_within(line: tuple[float, float], seconds: float) -> int:
    fixed_s, per_token = line
    return max(1, int((seconds - fixed_s) / per_token))


@dataclass(frozen=True, slots=True)
class StepTokens:
    """The tokens of each kind of step, from the measured step cost and the target."""

    short: int  # a step admitting a short request: one target
    cold: int  # a step carrying prompt chunks: at most COLD_STEP_FACTOR targets (or what keeps it efficient)


def _mean(old: tuple[float, float] | None, sample: tuple[float, float]) -> tuple[float, float]:
    if old is None:
        return sample
    return (
        (1 - RATE_WEIGHT) * old[0] + RATE_WEIGHT * sample[0],
        (1 - RATE_WEIGHT) * old[1] + RATE_WEIGHT * sample[1],
    )


def step_budget(
    max_num_batched_tokens: int, step_tokens: StepTokens | None, *, num_decodes: int, head_uncached: int | None
) -> tuple[int, int | None]:
    """The step's token budget and what the running prompts may take of it (None: no cap).

    ``step_tokens``: from the target and the measured step cost (None: no target, or nothing measured yet: the
    whole ``max_num_batched_tokens``). ``head_uncached``: the uncached tokens of the request next in line, when
    one waits and a seat is free (None otherwise)."""
    if step_tokens is None:
        return max_num_batched_tokens, None
    tokens = min(max_num_batched_tokens, max(step_tokens.cold, num_decodes + MIN_PREFILL_CHUNK))
    if head_uncached is None or num_decodes + head_uncached + MIN_PREFILL_CHUNK > tokens:
        return tokens, None  # no short request waits
    short = max(step_tokens.short, num_decodes + head_uncached + MIN_PREFILL_CHUNK)
    return short, short - num_decodes - head_uncached


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

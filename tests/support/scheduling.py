"""Driving the engine's scheduler without a model: what ``LLMEngine._update`` does with a step's results."""

from __future__ import annotations

from splitserve.engine.outputs import FinishReason
from splitserve.engine.scheduler import Scheduler, SchedulerOutput


def account_step(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """The engine's bookkeeping after a step: tokens computed, then a token sampled (always 0) where a request caught
    up, and requests at their ``max_tokens`` finished."""
    for scheduled in out.scheduled:
        request = scheduled.request
        request.num_computed_tokens += scheduled.num_new_tokens
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token(0)
            if request.num_output_tokens >= request.params.max_tokens:
                scheduler.finish(request, FinishReason.LENGTH)

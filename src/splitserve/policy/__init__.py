"""The pure decisions that the router, the engine's scheduler and the planner's simulator share: one
implementation of each, torch-free and free of I/O, so that the planner predicts the router and the scheduler
that really run.

- :mod:`~splitserve.policy.balance`: the cache-aware score (estimated TTFT from the queue that goes first, the
  tokens held and the seconds per token), and the load guard (least loaded, skew, a match worth following);
- :mod:`~splitserve.policy.ring`: the consistent-hash ring of ``session`` routing;
- :mod:`~splitserve.policy.scheduling`: ``lpm`` ordering, the step-time target (the measured step cost, each
  step's budget) and admission's arithmetic.
"""

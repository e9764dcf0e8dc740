"""Replicas that follow the load (``spec.autoscaling``): the local supervisor's decisions, one role at a time.

Every ``intervalSeconds`` each scaled role gets a recommendation:

- ``targetConcurrency``: the requests in flight on the role's pods (running and waiting, from each worker's
  ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``) over the target, rounded up: Knative's
  concurrency rule. At a steady load the requests in flight are the arrival rate times the latency, so the
  replicas follow the rate, and a load that stops leaves none in flight.
- ``decodeRatio`` (prefill only, instead of targets): the decode pool's replicas, as just decided, times the ratio,
  rounded up: the prefill pool keeps the P:D ratio ``splitserve plan`` recommends while decode follows the load.
  Decode's requests in flight then count the endpoint's, those still in prefill too (they decode next): a
  prefill bottleneck queues requests before they reach a decode pod, and would otherwise scale nothing. The
  prefill pool follows at once, both ways: decode's own window already held its scale-down.
- ``targetTtftSeconds``: the replicas now times the 90th percentile of the time to first token clients saw at
  the router over the interval, over the target, rounded up: HPA's proportional rule, with its tolerance (within
  10% of the target, no change). An interval without a first token recommends the minimum.

The role's recommendation is the larger of the two (missing either target is a reason to add a replica), within
``minReplicas`` and ``maxReplicas``. A scale-up is applied at once. A scale-down goes only to the highest
recommendation of the last ``scaleDownStabilizationSeconds`` (HPA's stabilization window), so a lull between
bursts removes nothing the next burst needs, and the replica count does not flap. How the supervisor applies a
decision (new pods ready before they take traffic, removed ones drained first) is ``deploy/supervisor.py``'s; on
Kubernetes the render writes HorizontalPodAutoscalers with the same bounds, targets and window
(``deploy/render.py``).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from splitserve.endpoint import AutoscalingSpec, RoleScaling

TOLERANCE = 0.1  # HPA's: a TTFT within 10% of its target changes nothing
TTFT_QUANTILE = 0.9


@dataclass(frozen=True, slots=True)
class RoleLoad:
    """One role's load, as read at one interval."""

    replicas: int  # the role's pods now
    in_flight: float  # requests running and waiting on them
    ttft_p90_s: float | None = None  # at the router, over the interval; None: no first token in it
    decode_replicas: int | None = None  # prefill: the decode pool's replicas (decodeRatio)


def recommend(scaling: RoleScaling, load: RoleLoad) -> int:
    """The replicas ``load`` asks for by ``scaling``'s targets, within its bounds."""
    wanted = [scaling.min_replicas]
    if scaling.target_concurrency is not None:
        wanted.append(math.ceil(load.in_flight / scaling.target_concurrency - 1e-9))
    if scaling.decode_ratio is not None and load.decode_replicas is not None:
        wanted.append(math.ceil(load.decode_replicas * scaling.decode_ratio - 1e-9))
    if scaling.target_ttft_seconds is not None and load.ttft_p90_s is not None:
        ratio = load.ttft_p90_s / scaling.target_ttft_seconds
        wanted.append(load.replicas if abs(ratio - 1) <= TOLERANCE else math.ceil(load.replicas * ratio - 1e-9))
    return min(scaling.max_replicas, max(wanted))


class Autoscaler:
    """The decisions for every role ``spec`` scales; ``clock`` in seconds."""

    def __init__(self, spec: AutoscalingSpec, clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self._clock = clock
        self._recommended: dict[str, deque[tuple[float, int]]] = {role: deque() for role in spec.roles()}

    def decide(self, role: str, load: RoleLoad) -> int:
        """The replicas ``role`` should have now: at once any more the load asks for, and fewer only as far as
        every recommendation of the stabilization window allows."""
        scaling = self.spec.roles()[role]
        recommendation = recommend(scaling, load)
        if scaling.decode_ratio is not None:  # decode's replicas are already past its window: no second one
            return recommendation
        now, history = self._clock(), self._recommended[role]
        history.append((now, recommendation))
        while history and history[0][0] < now - self.spec.scale_down_stabilization_seconds:
            history.popleft()
        if recommendation >= load.replicas:
            return recommendation
        return min(load.replicas, max(r for _, r in history))


def quantile_of(buckets: Mapping[float, float], q: float) -> float | None:
    """The ``q`` quantile of a histogram's cumulative bucket counts (``le`` bound -> count), as the upper bound of
    the bucket where the count reaches it (an over-estimate by at most one bucket, on the safe side for an SLO);
    None without any count. The ``+Inf`` bucket answers with the largest finite bound."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    finite = [b for b in bounds if math.isfinite(b)]
    for bound in bounds:
        if buckets[bound] >= q * total:
            return bound if math.isfinite(bound) else (finite[-1] if finite else None)
    return None

"""Silent misses: the cache hits the router predicts against the cached tokens its workers report.

Cache-aware routing fails quietly: when a worker's events stop, its tokenizer or chat template differs from the
router's, or a ``cache_salt`` splits what the router thinks is shared, requests still go where the router
believes their prefix is, and the worker just computes it. Users see slow TTFT and no error.

So the router counts, per worker, the prompt tokens its policy expected that worker to hold for every request
the worker took (``splitserve:router_predicted_hit_tokens_total{worker}``), and the scraper reads the tokens
the worker says it did not compute (``vllm:prompt_tokens_cached_total``, vLLM's name, which splitserve workers
expose too; else ``vllm:prefix_cache_hits_total`` plus ``vllm:external_prefix_cache_hits_total``). Once a
worker's window has gathered ``MIN_PREDICTED_TOKENS`` predicted tokens, the window is judged: a worker that
reports under ``MIN_REPORTED_SHARE`` of them raises an alarm (a warning naming the usual causes, at most one
per worker every ``ALARM_EVERY_S``, and ``splitserve:router_hit_alarms_total{worker}``), then a new window
starts. A worker reporting more than predicted is fine (other routers, or hits the policy did not look for).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from splitserve.metrics import RouterMetrics

logger = logging.getLogger("splitserve.router")

MIN_PREDICTED_TOKENS = 2048  # a window is judged once this many cached tokens were predicted in it
MIN_REPORTED_SHARE = 0.5  # below this share of the predicted tokens, the prediction is failing
ALARM_EVERY_S = 300.0


class HitPredictionCheck:
    """Per worker: predicted hit tokens (from routing) against reported ones (from scrapes), judged by window."""

    def __init__(self, metrics: RouterMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self._clock = clock
        self._predicted: dict[str, float] = {}  # cumulative, per worker URL
        self._window_start: dict[str, tuple[float, float]] = {}  # (predicted, reported) when the window began
        self._last_alarm_s: dict[str, float] = {}

    def predicted(self, worker: str, num_tokens: int) -> None:
        """The policy expected ``worker`` to hold ``num_tokens`` of the prompt of a request it took."""
        if num_tokens > 0:
            self._predicted[worker] = self._predicted.get(worker, 0.0) + num_tokens
            self.metrics.predicted_hit_tokens.labels(worker).inc(num_tokens)

    def reported(self, worker: str, cached_tokens: float | None) -> str | None:
        """The worker's cumulative cached prompt tokens as just scraped (None: the scrape failed). Returns the
        alarm's message when this scrape judged a window and found the prediction failing."""
        if cached_tokens is None:
            self._window_start.pop(worker, None)
            return None
        self.metrics.reported_hit_tokens.labels(worker).set(cached_tokens)
        predicted = self._predicted.get(worker, 0.0)
        start = self._window_start.get(worker)
        if start is None or cached_tokens < start[1]:  # the first scrape, or the worker restarted
            self._window_start[worker] = (predicted, cached_tokens)
            return None
        num_predicted, num_reported = predicted - start[0], cached_tokens - start[1]
        if num_predicted < MIN_PREDICTED_TOKENS:
            return None
        self._window_start[worker] = (predicted, cached_tokens)
        if num_reported >= MIN_REPORTED_SHARE * num_predicted:
            return None
        self.metrics.hit_alarms.labels(worker).inc()
        message = (
            f"cache-aware routing predicted {num_predicted:.0f} cached prompt tokens on worker {worker}, which "
            f"reports {num_reported:.0f}: requests land where their prefix is not. Check that the worker's KV "
            "events reach the router, that router and worker use the same model, tokenizer and chat template, "
            "and that --block-size matches"
        )
        now_s = self._clock()
        if now_s - self._last_alarm_s.get(worker, -ALARM_EVERY_S) >= ALARM_EVERY_S:
            self._last_alarm_s[worker] = now_s
            logger.warning("%s", message)
        return message

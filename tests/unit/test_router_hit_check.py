"""The router's predicted cache hits against the cached tokens workers report: windows, alarms, page parsing."""

from __future__ import annotations

import logging

import pytest

from splitserve.metrics import RouterMetrics, sum_samples
from splitserve.router.hit_check import ALARM_EVERY_S, MIN_PREDICTED_TOKENS, HitPredictionCheck
from splitserve.router.scrape import cached_prompt_tokens, page_totals

W = "http://127.0.0.1:8001"


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def check(clock: Clock) -> HitPredictionCheck:
    return HitPredictionCheck(RouterMetrics("kvaware"), clock)


def test_a_worker_that_reports_what_was_predicted_raises_nothing(check: HitPredictionCheck) -> None:
    assert check.reported(W, 1000.0) is None  # the window starts
    for _ in range(4):
        check.predicted(W, MIN_PREDICTED_TOKENS // 2)
    assert check.reported(W, 1000.0 + 2 * MIN_PREDICTED_TOKENS * 0.9) is None
    page = check.metrics.render().decode()
    assert sum_samples(page, "splitserve:router_predicted_hit_tokens_total", worker=W) == 2 * MIN_PREDICTED_TOKENS
    assert (
        sum_samples(page, "splitserve:router_reported_hit_tokens", worker=W) == 1000.0 + 2 * MIN_PREDICTED_TOKENS * 0.9
    )
    assert sum_samples(page, "splitserve:router_hit_alarms_total") == 0


def test_silent_misses_raise_one_warning_per_interval_and_count_every_window(
    check: HitPredictionCheck, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    check.reported(W, 0.0)
    reported = 0.0
    with caplog.at_level(logging.WARNING, logger="splitserve.router"):
        for window in range(3):
            check.predicted(W, MIN_PREDICTED_TOKENS)
            reported += MIN_PREDICTED_TOKENS * 0.2  # a fifth of what routing expected
            clock.now_s += 30
            message = check.reported(W, reported)
            assert message is not None and f"predicted {MIN_PREDICTED_TOKENS} cached prompt tokens" in message, window
    warnings = [r for r in caplog.records if "requests land where their prefix is not" in r.getMessage()]
    assert len(warnings) == 1  # the next one only after ALARM_EVERY_S
    assert sum_samples(check.metrics.render().decode(), "splitserve:router_hit_alarms_total", worker=W) == 3
    clock.now_s += ALARM_EVERY_S
    check.predicted(W, MIN_PREDICTED_TOKENS)
    with caplog.at_level(logging.WARNING, logger="splitserve.router"):
        assert check.reported(W, reported) is not None
    assert len([r for r in caplog.records if "prefix is not" in r.getMessage()]) == 2


def test_windows_wait_for_enough_predictions_and_restart_with_the_worker(check: HitPredictionCheck) -> None:
    check.reported(W, 5000.0)
    check.predicted(W, MIN_PREDICTED_TOKENS - 1)
    assert check.reported(W, 5000.0) is None  # too few predicted tokens to judge: the window goes on
    check.predicted(W, 1)
    assert check.reported(W, 5000.0) is not None  # now judged: nothing reported
    check.predicted(W, MIN_PREDICTED_TOKENS)
    assert check.reported(W, 10.0) is None  # the counter went back: a restarted worker starts a new window
    assert check.reported(W, None) is None  # a failed scrape forgets the window
    check.predicted(W, MIN_PREDICTED_TOKENS)
    assert check.reported(W, 10.0) is None  # the first scrape after it only starts one


def test_the_cached_tokens_of_a_splitserve_or_a_vllm_page() -> None:
    splitserve = (
        '# TYPE vllm:prompt_tokens_cached counter\nvllm:prompt_tokens_cached_total{engine="0",model_name="m"} 640.0\n'
        '# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{engine="0",model_name="m"} 512.0\n'
    )
    assert cached_prompt_tokens(page_totals(splitserve)) == 640.0
    older_vllm = (
        '# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{model_name="m"} 512.0\n'
        '# TYPE vllm:external_prefix_cache_hits counter\nvllm:external_prefix_cache_hits_total{model_name="m"} 64.0\n'
    )
    assert cached_prompt_tokens(page_totals(older_vllm)) == 576.0
    assert cached_prompt_tokens(page_totals("# TYPE other counter\nother_total 1.0\n")) is None
    assert cached_prompt_tokens(page_totals("not {a metrics page")) is None

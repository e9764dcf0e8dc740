"""Admission bounds: each counts what its flag says (``policy.admission``), and an idle worker takes any prompt."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from splitserve.config import ServerConfig
from splitserve.engine.async_engine import AsyncEngine, QueueFullError
from splitserve.engine.sampling_params import SamplingParams
from splitserve.metrics import WorkerMetrics
from splitserve.policy.admission import (
    ADMISSION_QUEUED_REQUESTS,
    ADMISSION_QUEUED_TOKENS,
    AdmissionLimits,
    Backlog,
    refusal,
)
from splitserve.worker.run import admission_limits
from tests.support.fake_engine import FakeEngine

NOW = 1000.0


async def _until(predicate: Callable[[], bool]) -> None:
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not reached in 5 s")


def test_max_queued_requests_counts_only_the_requests_waiting_to_start() -> None:
    limits = AdmissionLimits(max_waiting=2)
    assert refusal(limits, Backlog(num_waiting=1, num_in_flight=40), 1, NOW) is None  # 39 running do not count
    refused = refusal(limits, Backlog(num_waiting=2, num_in_flight=2), 1, NOW)
    assert refused is not None and refused.reason == ADMISSION_QUEUED_REQUESTS
    assert "2 requests are already waiting to start" in refused.message


def test_max_num_queued_reqs_counts_waiting_and_running_and_n_counts_n() -> None:
    limits = AdmissionLimits(max_in_flight=4)
    assert refusal(limits, Backlog(num_waiting=0, num_in_flight=3), 1, NOW) is None
    assert refusal(limits, Backlog(num_waiting=0, num_in_flight=3), 2, NOW) is not None  # n=2 needs two
    assert refusal(limits, Backlog(num_waiting=3, num_in_flight=4), 1, NOW) is not None


def test_the_token_bound_refuses_only_with_work_already_ahead() -> None:
    limits = AdmissionLimits(max_prefill_tokens=1000)
    assert refusal(limits, Backlog(prefill_tokens=0), 1, NOW) is None  # an idle worker takes a prompt of any length
    assert refusal(limits, Backlog(prefill_tokens=999), 1, NOW) is None
    refused = refusal(limits, Backlog(prefill_tokens=1000), 1, NOW)
    assert refused is not None and refused.reason == ADMISSION_QUEUED_TOKENS


def test_the_queue_delay_follows_the_measured_rate_and_the_oldest_wait() -> None:
    limits = AdmissionLimits(max_queue_delay_s=30.0)
    unmeasured = Backlog(num_waiting=50, num_in_flight=60, prefill_tokens=10**6)
    assert refusal(limits, unmeasured, 1, NOW) is None  # nothing measured, nobody waiting long: admitted
    fast = Backlog(prefill_tokens=20_000, seconds_per_token=1e-3)  # 20 s of prompts ahead
    assert refusal(limits, fast, 1, NOW) is None
    slow = Backlog(prefill_tokens=20_000, seconds_per_token=2e-3)  # the same tokens on a CPU half as fast: 40 s
    refused = refusal(limits, slow, 1, NOW)
    assert refused is not None and "take about 40 s" in refused.message
    stuck = Backlog(num_waiting=1, num_in_flight=9, oldest_waiting_since=NOW - 31)  # seats taken by long decodes
    refused = refusal(limits, stuck, 1, NOW)
    assert refused is not None and "has waited 31 s" in refused.message
    assert refusal(AdmissionLimits(max_queue_delay_s=0.0), slow, 1, NOW) is None  # 0: no bound


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_queued_requests": 0},
        {"max_num_queued_reqs": -1},
        {"max_num_queued_tokens": 0},
        {"max_queue_delay_s": -1.0},
    ],
)
def test_bad_bounds_are_refused_and_good_ones_reach_the_engine(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ServerConfig(**kwargs).validate()  # type: ignore[arg-type]
    limits = admission_limits(ServerConfig(max_queued_requests=3, max_num_queued_reqs=5, max_num_queued_tokens=7))
    assert limits == AdmissionLimits(max_waiting=3, max_in_flight=5, max_prefill_tokens=7, max_queue_delay_s=30.0)


def test_the_engine_counts_running_and_waiting_requests_as_documented() -> None:
    """One seat: the first request runs, the next waits; --max-queued-requests 1 refuses the third, and takes one
    again once the first finished."""
    fake = FakeEngine(step_delay_s=0.05, max_num_seqs=1)

    async def main() -> None:
        engine = AsyncEngine(lambda: fake, WorkerMetrics("m"), limits=AdmissionLimits(max_waiting=1))
        engine.start()
        await engine.wait_until_ready(5)
        try:
            engine.admit()
            first = await engine.submit([72, 105], SamplingParams(max_tokens=8), "r1")
            with pytest.raises(QueueFullError):  # r1 waits to start until the engine's next step
                engine.admit()
            await _until(lambda: engine.backlog.num_waiting == 0)
            engine.admit()  # r1 has its seat: nobody waits
            second = await engine.submit([72, 105, 33], SamplingParams(max_tokens=3), "r2")
            await _until(lambda: engine.backlog.num_in_flight == 2 and engine.backlog.num_waiting == 1)
            assert (engine.backlog.num_waiting, engine.backlog.num_in_flight, engine.backlog.prefill_tokens) == (
                1,
                2,
                3,
            )
            with pytest.raises(QueueFullError, match="waiting to start"):
                engine.admit()
            async for _ in first:
                pass
            await _until(lambda: engine.backlog.num_waiting == 0)  # r2 takes the seat r1 left
            engine.admit()
            async for _ in second:
                pass
        finally:
            engine.shutdown()

    asyncio.run(main())

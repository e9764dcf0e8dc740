"""AsyncEngine: outputs flow back in order, rejections surface, early exits abort, failures never hang."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from splitserve.engine.async_engine import AsyncEngine, EngineDeadError, EngineNotReadyError
from splitserve.engine.outputs import FinishReason
from splitserve.engine.sampling_params import SamplingParams
from splitserve.metrics import WorkerMetrics
from tests.support.fake_engine import REPLY, FakeEngine

T = TypeVar("T")
PROMPT = [72, 105]  # "Hi"


def run_with_engine(fake: FakeEngine, body: Callable[[AsyncEngine], Awaitable[T]]) -> T:
    """Start an AsyncEngine over ``fake``, run ``body``, shut it down."""

    async def main() -> T:
        engine = AsyncEngine(lambda: fake, WorkerMetrics("fake-model"))
        engine.start()
        await engine.wait_until_ready(5)
        try:
            return await asyncio.wait_for(body(engine), 20)
        finally:
            engine.shutdown()

    return asyncio.run(main())


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


class TestGenerate:
    def test_streams_outputs_in_order_until_finished(self) -> None:
        async def body(engine: AsyncEngine) -> list[str]:
            return [o.new_text async for o in engine.generate(PROMPT, SamplingParams(max_tokens=5), "r1")]

        assert "".join(run_with_engine(FakeEngine(), body)) == REPLY[:5]

    def test_last_output_carries_finish_reason(self) -> None:
        async def body(engine: AsyncEngine) -> list[FinishReason | None]:
            return [o.finish_reason async for o in engine.generate(PROMPT, SamplingParams(max_tokens=3), "r1")]

        assert run_with_engine(FakeEngine(), body) == [None, None, FinishReason.LENGTH]

    def test_concurrent_requests_are_batched_and_separated(self) -> None:
        async def one(engine: AsyncEngine, rid: str, n: int) -> str:
            return "".join([o.new_text async for o in engine.generate(PROMPT, SamplingParams(max_tokens=n), rid)])

        async def body(engine: AsyncEngine) -> list[str]:
            return list(await asyncio.gather(*(one(engine, f"r{n}", n) for n in (2, 4, 6))))

        assert run_with_engine(FakeEngine(), body) == [REPLY[:2], REPLY[:4], REPLY[:6]]

    def test_engine_is_only_called_from_one_thread_not_the_loop(self) -> None:
        fake = FakeEngine()

        async def body(engine: AsyncEngine) -> int:
            async for _ in engine.generate(PROMPT, SamplingParams(max_tokens=3), "r1"):
                pass
            return threading.get_ident()

        loop_thread = run_with_engine(fake, body)
        assert len(fake.caller_threads) == 1
        assert loop_thread not in fake.caller_threads

    def test_rejected_request_raises_value_error_to_the_caller(self) -> None:
        async def body(engine: AsyncEngine) -> None:
            with pytest.raises(ValueError, match="max_model_len"):
                await engine.submit(PROMPT, SamplingParams(max_tokens=1000), "too-long")
            with pytest.raises(ValueError, match="empty"):
                async for _ in engine.generate([], SamplingParams(), "empty"):
                    pass
            assert engine.num_in_flight == 0

        run_with_engine(FakeEngine(), body)

    def test_idle_engine_thread_does_not_spin(self) -> None:
        fake = FakeEngine()

        async def body(engine: AsyncEngine) -> None:
            async for _ in engine.generate(PROMPT, SamplingParams(max_tokens=2), "r1"):
                pass
            await asyncio.sleep(0.05)
            steps_before = fake.num_steps
            await asyncio.sleep(0.3)
            assert fake.num_steps == steps_before

        run_with_engine(fake, body)


class TestAbort:
    def test_breaking_out_of_generate_aborts_the_request(self) -> None:
        fake = FakeEngine(step_delay_s=0.01)

        async def body(engine: AsyncEngine) -> None:
            stream = engine.generate(PROMPT, SamplingParams(max_tokens=30), "r1")
            async for _ in stream:
                break
            await stream.aclose()  # what `async for` + a disconnect do via the generator's finaliser
            await wait_for(lambda: fake.aborted_ids == ["r1"] and not fake.requests)

        run_with_engine(fake, body)

    def test_cancelled_consumer_aborts_the_request(self) -> None:
        fake = FakeEngine(step_delay_s=0.01)

        async def consume(engine: AsyncEngine) -> None:
            async for _ in engine.generate(PROMPT, SamplingParams(max_tokens=30), "r1"):
                pass

        async def body(engine: AsyncEngine) -> None:
            task = asyncio.create_task(consume(engine))
            await wait_for(lambda: fake.num_steps >= 2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await wait_for(lambda: fake.aborted_ids == ["r1"])
            assert engine.num_in_flight == 0

        run_with_engine(fake, body)

    def test_abort_counts_as_finished_with_reason_abort(self) -> None:
        fake = FakeEngine(step_delay_s=0.01)

        async def body(engine: AsyncEngine) -> bytes:
            stream = await engine.submit(PROMPT, SamplingParams(max_tokens=30), "r1")
            await anext(stream)
            stream.close()
            await wait_for(lambda: fake.aborted_ids == ["r1"])
            return engine.metrics.render()

        text = run_with_engine(fake, body).decode()
        assert 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="fake-model"} 1.0' in text


class TestFailure:
    def test_engine_failure_ends_in_flight_requests_and_turns_unhealthy(self) -> None:
        fake = FakeEngine(step_delay_s=0.01)

        async def body(engine: AsyncEngine) -> None:
            stream = await engine.submit(PROMPT, SamplingParams(max_tokens=30), "r1")
            await anext(stream)
            assert engine.is_healthy
            fake.fail_on_step = True
            with pytest.raises(EngineDeadError, match="injected"):
                async for _ in stream:
                    pass
            assert not engine.is_healthy
            with pytest.raises(EngineDeadError):
                await engine.submit(PROMPT, SamplingParams(), "r2")

        run_with_engine(fake, body)

    def test_load_failure_is_reported_not_hung(self) -> None:
        def broken() -> FakeEngine:
            raise RuntimeError("no weights")

        async def main() -> None:
            engine = AsyncEngine(broken, WorkerMetrics("m"))
            engine.start()
            with pytest.raises(EngineDeadError, match="no weights"):
                await engine.wait_until_ready(5)
            assert not engine.is_healthy
            with pytest.raises(EngineDeadError):
                await engine.submit(PROMPT, SamplingParams(), "r1")

        asyncio.run(main())

    def test_requests_while_loading_are_refused(self) -> None:
        release = threading.Event()

        def slow() -> FakeEngine:
            release.wait(5)
            return FakeEngine()

        async def main() -> None:
            engine = AsyncEngine(slow, WorkerMetrics("m"))
            engine.start()
            assert not engine.is_healthy
            with pytest.raises(EngineNotReadyError):
                await engine.submit(PROMPT, SamplingParams(), "r1")
            release.set()
            await engine.wait_until_ready(5)
            assert engine.is_healthy
            engine.shutdown()
            assert not engine.is_healthy

        asyncio.run(main())

    def test_shutdown_ends_in_flight_requests(self) -> None:
        fake = FakeEngine(step_delay_s=0.01)

        async def body(engine: AsyncEngine) -> None:
            stream = await engine.submit(PROMPT, SamplingParams(max_tokens=100), "r1")
            await anext(stream)
            await asyncio.to_thread(engine.shutdown)
            with pytest.raises(EngineDeadError, match="shut down"):
                async for _ in stream:
                    pass

        run_with_engine(fake, body)


class TestMetrics:
    def test_latency_and_token_metrics_are_observed(self) -> None:
        async def body(engine: AsyncEngine) -> bytes:
            async for _ in engine.generate(PROMPT, SamplingParams(max_tokens=4), "r1"):
                pass
            return engine.metrics.render()

        text = run_with_engine(FakeEngine(), body).decode()
        label = '{engine="0",model_name="fake-model"}'
        assert f"vllm:time_to_first_token_seconds_count{label} 1.0" in text
        assert f"vllm:inter_token_latency_seconds_count{label} 3.0" in text
        assert f"vllm:e2e_request_latency_seconds_count{label} 1.0" in text
        assert f"vllm:request_queue_time_seconds_count{label} 1.0" in text
        assert f"vllm:prompt_tokens_total{label} 2.0" in text
        assert f"vllm:generation_tokens_total{label} 4.0" in text
        assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="fake-model"} 1.0' in text

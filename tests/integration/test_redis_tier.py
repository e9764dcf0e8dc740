"""RedisTier and TieredStore against a real redis-server started by the test: round trips, one pipelined MGET,
TTL, a stalled server, and a server killed mid-run (errors counted, breaker open, no exception) then
restarted (the tier reconnects after its back-off)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import torch

from splitserve.breaker import BreakerState, CircuitBreaker
from splitserve.keys import cache_key, kv_layout
from splitserve.kvcache import serde
from splitserve.kvcache.cpu import CPUTier
from splitserve.kvcache.redis import RedisTier, connect
from splitserve.kvcache.store import TieredStore
from tests.support.redis import REDIS_SERVER, RedisServer

torch.set_num_threads(1)

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not on PATH (`make setup` installs it)"),
]

LAYOUT = kv_layout("bfloat16", 2, 2, 8, 16)


def key(i: int) -> str:
    return cache_key("tiny", LAYOUT, i)


def record(seed: int, num_tokens: int = 16) -> bytes:
    kv = torch.randn(2, 2, num_tokens, 2, 8, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return serde.encode(kv, num_tokens, LAYOUT)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    srv = RedisServer()
    srv.start()
    yield srv
    srv.stop()


def fast_breaker() -> CircuitBreaker:
    return CircuitBreaker(failure_threshold=2, base_backoff_s=0.2, max_backoff_s=0.4)


def test_a_get_per_record(server: RedisServer) -> None:
    tier = RedisTier(server.url)
    records = [record(i) for i in range(4)]
    for i, value in enumerate(records):
        tier.put(key(i), value)
    admin: Any = redis.Redis(port=server.port)  # redis-py types every reply as maybe-awaitable
    admin.config_resetstat()
    assert tier.get_many([key(i) for i in range(5)]) == [*records, None]
    assert admin.info("commandstats")["cmdstat_get"]["calls"] == 5
    assert tier.contains_many([key(0), key(9)]) == [True, False]
    decoded = serde.decode(tier.get_many([key(2)])[0] or b"", LAYOUT)
    assert torch.equal(decoded.view(torch.uint8), serde.decode(records[2], LAYOUT).view(torch.uint8))
    tier.delete(key(0))
    assert tier.contains_many([key(0)]) == [False]
    stats = tier.stats()
    assert (stats.num_hits, stats.num_misses, stats.num_errors, stats.num_puts) == (5, 1, 0, 4)
    admin.close()
    tier.close()


def test_megabyte_values_error_replies_and_a_dropped_connection(server: RedisServer) -> None:
    tier = RedisTier(server.url, breaker=CircuitBreaker(failure_threshold=5))
    big = bytes(range(256)) * (3 * 4096 + 7)  # ~3 MB, longer than one read
    small = b"x\r\n$-1\r\n"  # protocol bytes inside a value are only bytes
    tier.put("big", big)
    tier.put("small", small)
    tier.put("empty", b"")
    assert [None if v is None else bytes(v) for v in tier.get_many(["big", "small", "empty", "none"])] == [
        big, small, b"", None,
    ]  # fmt: skip
    admin: Any = redis.Redis(port=server.port)  # redis-py types every reply as maybe-awaitable
    admin.rpush("a-list", "v")
    assert tier.get_many(["big", "a-list"]) == [None, None]  # WRONGTYPE: the whole read is a miss, counted
    assert tier.stats().num_errors == 1
    admin.client_kill_filter(_type="normal", skipme=True)  # every connection of the tier's, while idle
    assert [None if v is None else bytes(v) for v in tier.get_many(["small"])] == [small]  # connected again at once
    assert tier.stats().num_errors == 1
    admin.close()
    tier.close()
    assert tier.get_many(["small"]) == [None]  # closed: a miss, never a new connection


def test_ttl_expires_records(server: RedisServer) -> None:
    tier = RedisTier(server.url, ttl_s=0.3)
    tier.put(key(1), record(1))
    admin: Any = redis.Redis(port=server.port)  # redis-py types every reply as maybe-awaitable
    assert 0 < admin.pttl(key(1)) <= 300
    time.sleep(0.4)
    assert tier.get_many([key(1)]) == [None]
    admin.close()
    tier.close()


def test_a_stalled_redis_times_out_instead_of_hanging(server: RedisServer) -> None:
    tier = RedisTier(connect(server.url, socket_timeout_s=0.3), breaker=fast_breaker())
    tier.put(key(1), record(1))
    server.pause()
    try:
        started = time.monotonic()
        assert tier.get_many([key(1)]) == [None]
        assert time.monotonic() - started < 2.0
        assert tier.stats().num_errors == 1
    finally:
        server.resume()


def test_killed_mid_run_then_restarted(server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="splitserve.kvcache.redis")
    tier = RedisTier(server.url, breaker=fast_breaker())
    tier.put(key(1), record(1))
    assert tier.get_many([key(1)]) == [record(1)]

    server.stop()
    assert tier.get_many([key(1)]) == [None]  # no exception: a miss
    tier.put(key(2), record(2))  # dropped, counted
    assert tier.breaker_state is BreakerState.OPEN
    started = time.monotonic()
    assert tier.contains_many([key(1)]) == [False]  # refused by the breaker without a connection attempt
    assert time.monotonic() - started < 0.05
    stats = tier.stats()
    assert (stats.num_errors, stats.num_skipped) == (2, 1)
    assert len([r for r in caplog.records if "failed" in r.getMessage()]) == 1  # logged once per burst
    assert any("circuit open" in r.getMessage() for r in caplog.records)

    server.start()  # same port, empty (no persistence)
    time.sleep(0.25)  # past the first back-off
    tier.put(key(3), record(3))  # the trial call: reconnects and closes the breaker
    assert tier.breaker_state is BreakerState.CLOSED
    assert tier.get_many([key(1), key(3)]) == [None, record(3)]
    tier.close()


def test_a_dead_redis_at_start_is_degraded_mode(server: RedisServer) -> None:
    url = server.url
    server.stop()
    tier = RedisTier(url, breaker=fast_breaker())  # no exception at construction
    assert not tier.ping()
    assert tier.get_many([key(1)]) == [None]
    server.start()
    time.sleep(0.25)
    assert tier.ping()
    tier.close()


def test_a_chunk_stored_by_one_worker_is_served_to_another(server: RedisServer) -> None:
    """Two stores (two workers) share one Redis: B finds A's chunks in L2, validates and promotes them."""

    def validate(_key: str, value: bytes) -> None:
        serde.verify(value, LAYOUT)

    worker_a = TieredStore(CPUTier(10**7), RedisTier(server.url), validate=validate)
    worker_b = TieredStore(CPUTier(10**7), RedisTier(server.url), validate=validate)
    keys = [key(i) for i in range(3)]
    for i, k in enumerate(keys):
        worker_a.put(k, record(i))
    assert worker_a.flush(timeout_s=10)

    corrupt = bytearray(record(2))
    corrupt[-1] ^= 0x01
    redis.Redis(port=server.port).set(keys[2], bytes(corrupt))  # a bit flip in the last chunk, in L2
    assert worker_b.lookup(keys) == (0, 3)
    assert worker_b.get_prefix(keys) == [record(0), record(1)]  # the corrupt record is a miss
    assert worker_b.lookup(keys) == (2, 2)  # promoted; the corrupt one deleted from L2
    assert worker_b.stats().num_invalid_records == 1
    worker_a.close()
    worker_b.close()

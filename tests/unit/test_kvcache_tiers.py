"""The KV tiers: byte bounds and LRU eviction, a disk tier that survives restarts, bad files, a full disk and a
directory it cannot use, and a Redis tier (against a fake client) that turns every failure into a counted miss
behind a circuit breaker."""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from splitserve.breaker import BreakerState, CircuitBreaker
from splitserve.config import KVTierConfig, L2Backend
from splitserve.kvcache import disk as disk_module
from splitserve.kvcache.connector import build_connector
from splitserve.kvcache.cpu import CPUTier
from splitserve.kvcache.disk import DiskTier
from splitserve.kvcache.redis import RedisTier
from splitserve.kvcache.tiers import KVTier


def key(i: int) -> str:
    return f"splitserve:v1:smollm2:bfloat16-L2-H2-D8-B16:{i:016x}"


def value(i: int, num_bytes: int = 100) -> bytes:
    return bytes([i % 256]) * num_bytes


class TestCPUTier:
    def test_round_trip_and_counts(self) -> None:
        tier = CPUTier(max_bytes=1000)
        tier.put(key(1), value(1))
        assert tier.get_many([key(1), key(2)]) == [value(1), None]
        assert tier.contains_many([key(2), key(1)]) == [False, True]
        stats = tier.stats()
        assert (stats.num_hits, stats.num_misses, stats.num_puts) == (1, 1, 1)
        assert (stats.stored_bytes, stats.num_entries) == (100, 1)

    def test_bytes_stay_under_the_bound_by_evicting_least_recently_used(self) -> None:
        evicted: list[str] = []
        tier = CPUTier(max_bytes=350, on_evict=evicted.append)
        for i in range(3):
            tier.put(key(i), value(i))
        tier.get_many([key(0)])  # key(0) is now the most recently used
        tier.put(key(3), value(3))
        assert evicted == [key(1)]
        assert tier.contains_many([key(i) for i in range(4)]) == [True, False, True, True]
        assert tier.stats().stored_bytes == 300
        assert tier.stats().num_evictions == 1

    def test_replacing_a_key_does_not_double_count_its_bytes(self) -> None:
        tier = CPUTier(max_bytes=250)
        tier.put(key(1), value(1))
        tier.put(key(1), value(2, 200))
        assert tier.get_many([key(1)]) == [value(2, 200)]
        assert tier.stats().stored_bytes == 200 and tier.stats().num_evictions == 0

    def test_a_value_larger_than_the_tier_is_skipped(self) -> None:
        tier = CPUTier(max_bytes=50)
        tier.put(key(1), value(1))
        assert tier.contains_many([key(1)]) == [False]
        assert tier.stats().num_skipped == 1

    def test_delete(self) -> None:
        tier = CPUTier(max_bytes=500)
        tier.put(key(1), value(1))
        tier.delete(key(1))
        tier.delete(key(9))
        assert tier.contains_many([key(1)]) == [False]
        assert tier.stats().stored_bytes == 0


class TestDiskTier:
    def test_survives_a_reopen_on_the_same_directory(self, tmp_path: Path) -> None:
        tier = DiskTier(tmp_path, max_bytes=10_000)
        tier.put(key(1), value(1))
        tier.put(key(2), value(2, 300))
        reopened = DiskTier(tmp_path, max_bytes=10_000)
        assert reopened.get_many([key(1), key(2), key(3)]) == [value(1), value(2, 300), None]
        assert (reopened.stats().stored_bytes, reopened.stats().num_entries) == (400, 2)

    def test_evicts_least_recently_used_by_bytes(self, tmp_path: Path) -> None:
        evicted: list[str] = []
        tier = DiskTier(tmp_path, max_bytes=350, on_evict=evicted.append)
        for i in range(3):
            tier.put(key(i), value(i))
        tier.get_many([key(0)])
        tier.put(key(3), value(3))
        assert evicted == [key(1)]
        assert tier.contains_many([key(i) for i in range(4)]) == [True, False, True, True]
        assert len(list(tmp_path.iterdir())) == 3
        assert tier.stats().stored_bytes == 300

    def test_reopen_with_a_smaller_budget_evicts_oldest_files_first(self, tmp_path: Path) -> None:
        tier = DiskTier(tmp_path, max_bytes=10_000)
        for i in range(3):
            tier.put(key(i), value(i))
        for i, path in enumerate(sorted(tmp_path.iterdir(), key=lambda p: p.name)):
            os.utime(path, ns=(10**18 + i, 10**18 + i))  # key(0) oldest
        reopened = DiskTier(tmp_path, max_bytes=250)
        assert reopened.contains_many([key(i) for i in range(3)]) == [False, True, True]

    def test_a_truncated_file_is_a_miss_and_is_removed(self, tmp_path: Path) -> None:
        tier = DiskTier(tmp_path, max_bytes=10_000)
        tier.put(key(1), value(1))
        (path,) = tmp_path.iterdir()
        path.write_bytes(value(1, 40))
        assert tier.get_many([key(1)]) == [None]
        assert tier.stats().num_errors == 1 and tier.stats().num_misses == 1
        assert not path.exists() and tier.contains_many([key(1)]) == [False]

    def test_a_file_removed_by_another_worker_is_a_plain_miss(self, tmp_path: Path) -> None:
        tier = DiskTier(tmp_path, max_bytes=10_000)
        tier.put(key(1), value(1))
        (path,) = tmp_path.iterdir()
        path.unlink()
        assert tier.get_many([key(1)]) == [None]
        assert tier.stats().num_errors == 0 and tier.stats().stored_bytes == 0

    def test_a_value_read_maps_the_file_and_outlives_its_eviction_and_rewrite(self, tmp_path: Path) -> None:
        tier, other = DiskTier(tmp_path, max_bytes=10_000), DiskTier(tmp_path, max_bytes=10_000)
        tier.put(key(1), value(1))
        (held,) = tier.get_many([key(1)])
        assert isinstance(held, memoryview) and held == value(1)  # a view of the page cache, not a copy
        other.put(key(1), value(2))  # another worker rewrites the record (a rename over it), then evicts it
        other.delete(key(1))
        assert held == value(1) and tier.get_many([key(1)]) == [None]

    def test_a_record_written_by_another_worker_is_found(self, tmp_path: Path) -> None:
        reader = DiskTier(tmp_path, max_bytes=10_000)
        DiskTier(tmp_path, max_bytes=10_000).put(key(1), value(1))
        assert reader.contains_many([key(1)]) == [True]
        assert reader.get_many([key(1)]) == [value(1)]

    def test_a_full_disk_is_counted_not_raised(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        tier = DiskTier(tmp_path, max_bytes=10_000)

        class FullDiskFile:
            def __init__(self, path: Path) -> None:
                self.file = open(path, "wb")  # noqa: SIM115  # closed in __exit__

            def __enter__(self) -> FullDiskFile:
                return self

            def __exit__(self, *exc: object) -> None:
                self.file.close()

            def write(self, data: bytes) -> int:
                self.file.write(data[:10])  # a partial write, then the disk is full
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(disk_module, "open", lambda path, mode: FullDiskFile(path), raising=False)
        with caplog.at_level(logging.WARNING, logger=disk_module.__name__):
            for i in range(5):
                tier.put(key(i), value(i))
        assert tier.stats().num_errors == 5 and tier.stats().num_puts == 0
        assert list(tmp_path.iterdir()) == []  # no temporary file left behind
        assert len([r for r in caplog.records if "No space left" in r.getMessage()]) == 1  # once per burst

        monkeypatch.undo()
        tier.put(key(9), value(9))
        assert tier.get_many([key(9)]) == [value(9)]

    @pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
    def test_a_full_disk_found_only_when_the_file_is_closed_is_counted_not_raised(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        tier = DiskTier(tmp_path, max_bytes=10_000)
        monkeypatch.setattr(disk_module, "open", lambda path, mode: open("/dev/full", mode), raising=False)  # noqa: SIM115
        tier.put(key(1), value(1))  # 100 bytes stay buffered: the kernel's ENOSPC comes from close()
        assert (tier.stats().num_errors, tier.stats().num_puts) == (1, 0)
        assert tier.is_available and tier.get_many([key(1)]) == [None]

    def test_stale_temporary_files_are_removed_on_start(self, tmp_path: Path) -> None:
        stale = tmp_path / f"{disk_module.TMP_PREFIX}123-abc"
        fresh = tmp_path / f"{disk_module.TMP_PREFIX}456-def"
        stale.write_bytes(b"x")
        fresh.write_bytes(b"x")
        old = time.time() - 2 * disk_module.STALE_TMP_S
        os.utime(stale, (old, old))
        DiskTier(tmp_path, max_bytes=100)
        assert not stale.exists() and fresh.exists()

    def test_keys_with_slashes_round_trip_through_file_names(self, tmp_path: Path) -> None:
        odd = "splitserve:v1:HuggingFaceTB/SmolLM2-135M:bf16:00ff"
        DiskTier(tmp_path, max_bytes=1000).put(odd, value(1))
        assert DiskTier(tmp_path, max_bytes=1000).get_many([odd]) == [value(1)]


class TestAnUnusableDiskDirectory:
    """A directory that cannot be created or written starts the tier unavailable: misses, counted drops."""

    def test_a_path_under_a_regular_file_reads_as_misses_and_drops_writes(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        (tmp_path / "file").write_bytes(b"x")
        with caplog.at_level(logging.WARNING, logger=disk_module.__name__):
            tier = DiskTier(tmp_path / "file" / "kv", max_bytes=10_000)  # does not raise
            for i in range(3):
                tier.put(key(i), value(i))
        assert not tier.is_available
        assert tier.get_many([key(0), key(1)]) == [None, None]
        assert tier.contains_many([key(0)]) == [False]
        stats = tier.stats()
        assert (stats.num_errors, stats.num_misses, stats.num_puts, stats.stored_bytes) == (4, 2, 0, 0)  # open + 3
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 1 and "open failed (NotADirectoryError" in warnings[0]  # once per burst

    def test_a_read_only_file_system_is_found_at_start(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        def read_only(path: Path, mode: str) -> Any:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

        monkeypatch.setattr(disk_module, "open", read_only, raising=False)  # root ignores chmod, not a ro mount
        tier = DiskTier(tmp_path, max_bytes=10_000)
        assert not tier.is_available and tier.stats().num_errors == 1

    def test_it_is_picked_up_once_it_can_be_created_with_the_records_already_there(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        now = [0.0]
        mount = tmp_path / "mnt"
        mount.write_bytes(b"not yet a directory")
        tier = DiskTier(mount / "kv", max_bytes=10_000, clock=lambda: now[0])
        mount.unlink()
        DiskTier(mount / "kv", max_bytes=10_000).put(key(1), value(1))  # e.g. another worker, or a restore
        tier.put(key(2), value(2))  # retried at most every REOPEN_INTERVAL_S: still dropped
        assert not tier.is_available and tier.stats().num_errors == 2
        now[0] += disk_module.REOPEN_INTERVAL_S
        with caplog.at_level(logging.WARNING, logger=disk_module.__name__):
            tier.put(key(3), value(3))
        assert tier.is_available
        assert tier.get_many([key(1), key(2), key(3)]) == [value(1), None, value(3)]
        assert (tier.stats().num_entries, tier.stats().num_errors) == (2, 2)
        assert any("recovered after 2 errors" in r.getMessage() for r in caplog.records)

    def test_the_worker_logs_degraded_mode_at_start(self, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        (tmp_path / "file").write_bytes(b"x")
        path = str(tmp_path / "file" / "kv")
        config = KVTierConfig(l2_backend=L2Backend.TIEREDSTORAGE, l2_path=path)
        with caplog.at_level(logging.INFO, logger="splitserve.kvcache"):
            build_connector(config, "smollm2", "float32-L2-H2-D8-B16").close()
        messages = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert any(f"L2 tieredstorage at {path} is unavailable" in m and "degraded mode" in m for m in messages)
        assert not any("initialized successfully" in r.getMessage() for r in caplog.records)


class TestCircuitBreaker:
    def test_opens_after_threshold_and_backs_off_exponentially_with_a_cap(self) -> None:
        now = [0.0]
        breaker = CircuitBreaker(failure_threshold=2, base_backoff_s=1.0, max_backoff_s=3.0, clock=lambda: now[0])
        assert breaker.record_failure() is False and breaker.allow()
        assert breaker.record_failure() is True and breaker.state is BreakerState.OPEN
        # failed trials re-open it with back-offs 1, 2, 3 (capped), 3 s: trials at t = 1, 3, 6, 9
        for trial_at in (1.0, 3.0, 6.0, 9.0):
            now[0] = trial_at - 0.01
            assert not breaker.allow()
            now[0] = trial_at
            assert breaker.allow()
            assert breaker.state is BreakerState.HALF_OPEN and not breaker.allow()  # one trial at a time
            assert breaker.record_failure() is False  # a failed trial is not a new opening
        assert breaker.num_opens == 1

    def test_success_closes_and_resets_the_backoff(self) -> None:
        now = [0.0]
        breaker = CircuitBreaker(failure_threshold=1, base_backoff_s=1.0, clock=lambda: now[0])
        breaker.record_failure()
        now[0] = 1.0
        assert breaker.allow()
        assert breaker.record_success() is True
        assert breaker.state is BreakerState.CLOSED and breaker.backoff_s == 1.0


class FakeRedis:
    """Enough of redis.Redis for RedisTier; ``down`` makes every command raise like a dead server."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.ttls_ms: dict[str, int | None] = {}
        self.down = False
        self.num_round_trips = 0

    def _trip(self) -> None:
        self.num_round_trips += 1
        if self.down:
            raise redis.ConnectionError("Error 111 connecting to localhost:6399. Connection refused.")

    def ping(self) -> bool:
        self._trip()
        return True

    def get(self, k: str) -> bytes | None:
        self._trip()
        return self.data.get(k)

    def set(self, k: str, v: bytes, px: int | None = None) -> bool:
        self._trip()
        self.data[k], self.ttls_ms[k] = v, px
        return True

    def delete(self, k: str) -> int:
        self._trip()
        return int(self.data.pop(k, None) is not None)

    def pipeline(self, transaction: bool = True) -> FakePipeline:
        assert transaction is False
        return FakePipeline(self)

    def close(self) -> None:
        pass


class FakePipeline:
    def __init__(self, client: FakeRedis) -> None:
        self.client = client
        self.commands: list[Callable[[], Any]] = []

    def exists(self, k: str) -> None:
        self.commands.append(lambda: int(k in self.client.data))

    def execute(self) -> list[Any]:
        self.client._trip()  # one round trip for the whole pipeline
        return [command() for command in self.commands]


class TestRedisTierWithAFakeClient:
    def make(self, **kwargs: Any) -> tuple[RedisTier, FakeRedis, list[float]]:
        client, now = FakeRedis(), [0.0]
        breaker = CircuitBreaker(failure_threshold=3, base_backoff_s=1.0, clock=lambda: now[0])
        tier = RedisTier(client, breaker=breaker, **kwargs)
        return tier, client, now

    def test_a_get_per_record_and_one_pipelined_round_trip_for_existence(self) -> None:
        tier, client, _ = self.make(ttl_s=1.5)
        for i in range(5):
            tier.put(key(i), value(i))
        client.num_round_trips = 0
        assert tier.get_many([key(i) for i in range(6)]) == [*(value(i) for i in range(5)), None]
        assert tier.contains_many([key(0), key(9)]) == [True, False]
        assert client.num_round_trips == 6 + 1
        assert client.ttls_ms[key(0)] == 1500
        stats = tier.stats()
        assert (stats.num_hits, stats.num_misses, stats.num_puts, stats.written_bytes) == (5, 1, 5, 500)
        assert stats.stored_bytes is None

    def test_a_dead_redis_is_misses_and_counted_errors_then_the_breaker_stops_calling(self) -> None:
        tier, client, now = self.make()
        tier.put(key(1), value(1))
        client.down = True
        assert not tier.ping()
        assert tier.get_many([key(1)]) == [None]
        tier.put(key(2), value(2))
        assert tier.breaker_state is BreakerState.OPEN
        num_trips = client.num_round_trips
        assert tier.get_many([key(1)]) == [None] and tier.contains_many([key(1)]) == [False]
        tier.put(key(3), value(3))
        assert client.num_round_trips == num_trips  # nothing sent while open
        stats = tier.stats()
        assert (stats.num_errors, stats.num_skipped, stats.num_puts) == (3, 3, 1)

        client.down = False
        now[0] += 1.0  # the back-off has passed: the next call is the trial, and it succeeds
        assert tier.get_many([key(1)]) == [value(1)]
        assert tier.breaker_state is BreakerState.CLOSED

    def test_a_dead_redis_at_start_is_degraded_mode_not_an_exception(self) -> None:
        tier = RedisTier("redis://127.0.0.1:1/0")  # nothing listens on port 1
        started = time.monotonic()
        assert tier.get_many([key(1)]) == [None]
        assert time.monotonic() - started < 2.0
        assert tier.stats().num_errors == 1
        tier.close()


@pytest.mark.parametrize("make_tier", [lambda p: CPUTier(1000), lambda p: DiskTier(p, 1000)], ids=["cpu", "disk"])
def test_local_tiers_keep_the_protocol(make_tier: Callable[[Path], KVTier], tmp_path: Path) -> None:
    tier = make_tier(tmp_path)
    assert tier.get_many([]) == [] and tier.contains_many([]) == []
    tier.put(key(1), value(1))
    tier.delete(key(1))
    assert tier.get_many([key(1)]) == [None]
    tier.close()

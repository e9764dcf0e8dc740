"""L2 ``redis``: one Redis value per KV record, shared by every worker that points at the same server.

Reads are one round trip (MGET batches in a non-transactional pipeline). Every call has a socket timeout and
redis-py's own retries are off: a slow or dead Redis costs a caller at most one timeout, and after
``failure_threshold`` consecutive failures the circuit breaker stops calling it at all (every read a miss,
every write dropped) until a trial call after the back-off succeeds. A Redis that is down at start is the same
case, not an exception: the worker runs in degraded mode (recompute) and reconnects on its own.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from splitserve.breaker import BreakerState, CircuitBreaker
from splitserve.kvcache.tiers import ErrorBurstLog, KVValue, TierStats

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_SOCKET_TIMEOUT_S = 2.0
DEFAULT_CONNECT_TIMEOUT_S = 0.5
DEFAULT_MAX_KEYS_PER_MGET = 16  # a chunk is ~6 MB in bfloat16 for SmolLM2: keep each reply under ~100 MB


def connect(
    url: str,
    socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    *,
    username: str | None = None,
    password: str | None = None,
) -> redis.Redis:
    """A client for ``redis://host:port/db`` (``rediss://`` for TLS, with redis-py's ``ssl_*`` query parameters,
    e.g. ``?ssl_ca_certs=/etc/ca.pem``) with timeouts and no hidden retries. Does not connect yet.

    ``username``/``password`` authenticate (ACL user, or ``requirepass``) when the URL carries none.
    """
    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s,
        retry=Retry(NoBackoff(), 0),  # the breaker decides when to try again, not redis-py
        retry_on_timeout=False,
        username=username,
        password=password,
    )


class RedisTier:
    """KV records in Redis.

    Args:
        client: a ``redis.Redis`` (with ``decode_responses=False``; tests inject fakes) or a URL, for which a
            client with timeouts is made by :func:`connect` and closed by :meth:`close`.
        ttl_s: expire each record this long after it is written; None keeps records until Redis evicts them.
        breaker: the circuit breaker (default: open after 3 consecutive errors, back-off 0.5 s doubling to 30 s).
        max_keys_per_mget: keys per MGET command within one pipelined round trip.
        key_prefix: put before every key in Redis (the records' own keys, and so their MACs, stay the same).
        owns_client: close a given client in :meth:`close` (a URL's client is always closed).
    """

    def __init__(
        self,
        client: redis.Redis | str,
        *,
        ttl_s: float | None = None,
        breaker: CircuitBreaker | None = None,
        max_keys_per_mget: int = DEFAULT_MAX_KEYS_PER_MGET,
        name: str = "redis",
        key_prefix: str = "",
        owns_client: bool = False,
    ) -> None:
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive or None, got {ttl_s}")
        if max_keys_per_mget < 1:
            raise ValueError(f"max_keys_per_mget must be >= 1, got {max_keys_per_mget}")
        self.name = name
        self.key_prefix = key_prefix
        self._owns_client = owns_client or isinstance(client, str)
        self._client = connect(client) if isinstance(client, str) else client
        self._ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self.breaker = breaker or CircuitBreaker()
        self.max_keys_per_mget = max_keys_per_mget
        self._lock = threading.Lock()
        self._stats = TierStats(stored_bytes=None, num_entries=None)
        self._errors = ErrorBurstLog(logger, f"Redis KV tier ({name})")

    @property
    def breaker_state(self) -> BreakerState:
        return self.breaker.state

    def ping(self) -> bool:
        """Whether Redis answers now (through the breaker); for start-up logs and health checks."""
        return self._call("PING", lambda: bool(self._client.ping()), False)

    # -- the tier contract ------------------------------------------------------------------------------

    def get_many(self, keys: Sequence[str]) -> list[KVValue | None]:
        if not keys:
            return []
        got = self._call("MGET", lambda: self._mget(self._keys(keys)), None)
        values: list[KVValue | None] = [None] * len(keys) if got is None else list(got)
        num_hits = sum(v is not None for v in values)
        with self._lock:
            self._stats.num_hits += num_hits
            self._stats.num_misses += len(keys) - num_hits
        return values

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        return self._call("EXISTS", lambda: self._exists(self._keys(keys)), [False] * len(keys))

    def put(self, key: str, value: KVValue) -> None:
        view = memoryview(value)  # sent as it is: hiredis's packer would copy a bytes value into the command
        if self._call("SET", lambda: bool(self._client.set(self.key_prefix + key, view, px=self._ttl_ms)), False):
            with self._lock:
                self._stats.num_puts += 1
                self._stats.written_bytes += len(value)

    def delete(self, key: str) -> None:
        self._call("DEL", lambda: bool(self._client.delete(self.key_prefix + key)), False)

    def stats(self) -> TierStats:
        with self._lock:
            return self._stats.snapshot()

    def close(self) -> None:
        if self._owns_client:
            self._client.close()

    # -- Redis commands ---------------------------------------------------------------------------------

    def _keys(self, keys: Sequence[str]) -> Sequence[str]:
        return [self.key_prefix + key for key in keys] if self.key_prefix else keys

    def _mget(self, keys: Sequence[str]) -> list[bytes | None]:
        pipe = self._client.pipeline(transaction=False)
        for start in range(0, len(keys), self.max_keys_per_mget):
            pipe.mget(keys[start : start + self.max_keys_per_mget])
        return [value for batch in pipe.execute() for value in batch]

    def _exists(self, keys: Sequence[str]) -> list[bool]:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return [bool(n) for n in pipe.execute()]

    def _call(self, command: str, fn: Callable[[], T], default: T) -> T:
        """Run one round trip through the breaker; any Redis or socket error gives ``default``."""
        if not self.breaker.allow():
            with self._lock:
                self._stats.num_skipped += 1
            return default
        try:
            result = fn()
        except (RedisError, OSError) as exc:
            self._on_failure(command, exc)
            return default
        if self.breaker.record_success():
            logger.warning("Redis KV tier (%s): reachable again, circuit closed", self.name)
        self._errors.success()
        return result

    def _on_failure(self, command: str, exc: Exception) -> None:
        with self._lock:
            self._stats.num_errors += 1
        self._errors.error(command, exc)
        if self.breaker.record_failure():
            logger.warning(
                "Redis KV tier (%s): circuit open after %d consecutive errors; not calling Redis for %.1f s "
                "(back-off doubles up to %.0f s). Running in degraded mode: misses are recomputed.",
                self.name,
                self.breaker.failure_threshold,
                self.breaker.base_backoff_s,
                self.breaker.max_backoff_s,
            )

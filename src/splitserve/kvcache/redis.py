"""L2 ``redis``: one Redis value per KV record, shared by every worker that points at the same server.

Reads are a GET per record, one round trip each, read off the socket straight into a buffer of the reply's size
(``BulkReader``): records are megabytes (a chunk of SmolLM2's KV is 5.9 MB), and a parser that buffers replies
pays for it. On a Zen 4, ten 5.9 MB records over loopback took 68-81 ms as one MGET through redis-py (and
hiredis), 72 ms as ten pipelined GETs, 45-64 ms as ten GETs, and 35-47 ms read into fresh buffers, most of
which is the kernel handing the process fresh pages on these VMs (16-20 ms into buffers already in memory; a
pool of such buffers, faulted in by a thread of its own, was tried and gained nothing measurable end to end on
2 cores, where faulting them in competes with the request's MAC check and copy). A round trip is tens of
microseconds. Every call has a socket timeout and
redis-py's own retries are off: a slow or dead Redis costs a caller at most one timeout, and after
``failure_threshold`` consecutive failures the circuit breaker stops calling it at all (every read a miss,
every write dropped) until a trial call after the back-off succeeds. A Redis that is down at start is the same
case, not an exception: the worker runs in degraded mode (recompute) and reconnects on its own.
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError
from redis.retry import Retry

from splitserve.breaker import BreakerState, CircuitBreaker
from splitserve.kvcache.tiers import ErrorBurstLog, KVValue, TierStats

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_SOCKET_TIMEOUT_S = 2.0
DEFAULT_CONNECT_TIMEOUT_S = 0.5


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


class BulkReader:
    """GETs of large values on a connection of their own: the command goes out on the socket redis-py connected
    (so TLS, AUTH and SELECT are redis-py's; RESP2 and no maintenance notifications, so that nothing but replies
    ever arrives on it), and the reply is read with ``recv_into``, in reads of up to 1 MiB (few releases of the
    GIL, no parser buffer, no copy), into a fresh anonymous mapping of its size (whose pages the kernel faults in
    during the reads, outside the GIL, where a ``bytearray`` would zero them under it). Any error drops the
    connection (its stream may be mid-reply); a reused connection found closed before any byte of the reply came
    (the server or a NAT dropped it while idle) is replaced once at once, so that costs no miss. Thread-safe (one
    read at a time); after ``close``, every read fails.
    """

    READ_BYTES = 1 << 20
    HEADER_BYTES = 1 << 16

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self._pool = pool
        self._conn: Any = None
        self._lock = threading.Lock()
        self._closed = False

    def get(self, key: str) -> memoryview | None:
        with self._lock:
            for attempt in range(2):
                if self._closed:
                    raise ConnectionError("the Redis reader is closed")
                reused, replied = self._conn is not None, [False]
                try:
                    return self._get(key, replied)
                except ConnectionError:
                    self._drop()
                    if attempt or not reused or replied[0]:
                        raise
                except BaseException:
                    self._drop()
                    raise
            raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop()

    def _connect(self) -> Any:
        kwargs = dict(self._pool.connection_kwargs)
        kwargs["protocol"] = 2  # RESP3 could interleave push frames with the replies read here by hand
        if "maint_notifications_config" in kwargs:  # redis-py 8
            from redis.maint_notifications import MaintNotificationsConfig

            kwargs["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)
            kwargs.pop("maint_notifications_pool_handler", None)
        conn = self._pool.connection_class(**kwargs)
        conn.connect()
        return conn

    def _get(self, key: str, replied: list[bool]) -> memoryview | None:
        if self._conn is None:
            self._conn = self._connect()
        sock = self._conn._sock
        name = key.encode()
        sock.sendall(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(name), name))
        head = bytearray(self.HEADER_BYTES)
        got = 0
        while (end := head.find(b"\r\n", 0, got)) < 0:
            if got == len(head):
                raise RedisError("Redis reply header too long")
            n = sock.recv_into(memoryview(head)[got:])
            if n == 0:
                raise ConnectionError("Redis closed the connection")
            got, replied[0] = got + n, True
        kind, line = head[:1], bytes(head[1:end])
        if kind == b"-":
            raise ResponseError(line.decode(errors="replace"))
        if kind == b"$" and line == b"-1" and got == end + 2:  # the null bulk string, nothing after it
            return None
        if kind != b"$" or not line.isdigit() or got - end - 2 > int(line) + 2:
            raise RedisError(f"unexpected Redis reply to GET: {bytes(head[:end])[:40]!r}")
        size = int(line)
        value = mmap.mmap(-1, size + 2)  # the value and its CRLF
        view = memoryview(value)
        have = got - end - 2
        view[:have] = memoryview(head)[end + 2 : got]
        while have < len(value):
            n = sock.recv_into(view[have:], min(len(value) - have, self.READ_BYTES))
            if n == 0:
                raise ConnectionError("Redis closed the connection mid-reply")
            have += n
        if view[size:] != b"\r\n":
            raise RedisError("malformed Redis bulk reply")
        return view[:size]

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.disconnect()


class RedisTier:
    """KV records in Redis.

    Args:
        client: a ``redis.Redis`` (with ``decode_responses=False``; tests inject fakes) or a URL, for which a
            client with timeouts is made by :func:`connect` and closed by :meth:`close`.
        ttl_s: expire each record this long after it is written; None keeps records until Redis evicts them.
        breaker: the circuit breaker (default: open after 3 consecutive errors, back-off 0.5 s doubling to 30 s).
        key_prefix: put before every key in Redis (the records' own keys, and so their MACs, stay the same).
        owns_client: close a given client in :meth:`close` (a URL's client is always closed).
    """

    def __init__(
        self,
        client: redis.Redis | str,
        *,
        ttl_s: float | None = None,
        breaker: CircuitBreaker | None = None,
        name: str = "redis",
        key_prefix: str = "",
        owns_client: bool = False,
    ) -> None:
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive or None, got {ttl_s}")
        self.name = name
        self.key_prefix = key_prefix
        self._owns_client = owns_client or isinstance(client, str)
        self._client = connect(client) if isinstance(client, str) else client
        pool = getattr(self._client, "connection_pool", None)
        self._reader = BulkReader(pool) if isinstance(pool, redis.ConnectionPool) else None
        self._ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self.breaker = breaker or CircuitBreaker()
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
        got = self._call("GET", lambda: self._get_each(self._keys(keys)), None)
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
        if self._reader is not None:
            self._reader.close()
        if self._owns_client:
            self._client.close()

    # -- Redis commands ---------------------------------------------------------------------------------

    def _keys(self, keys: Sequence[str]) -> Sequence[str]:
        return [self.key_prefix + key for key in keys] if self.key_prefix else keys

    def _get_each(self, keys: Sequence[str]) -> list[KVValue | None]:
        if self._reader is None:  # a client that is not redis-py's own (tests' fakes)
            return [cast("bytes | None", self._client.get(key)) for key in keys]
        return [self._reader.get(key) for key in keys]

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

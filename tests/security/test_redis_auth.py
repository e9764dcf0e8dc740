"""The Redis L2 behind a password, an ACL user and TLS, against real redis-server processes: an unauthenticated client
is refused, the worker's tier authenticates from its configuration, a key prefix keeps endpoints apart (and an ACL can
confine a user to its prefix), and ``rediss://`` works with the server's CA."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from splitserve.config import KVTierConfig, L2Backend
from splitserve.keys import cache_key
from splitserve.kvcache import serde
from splitserve.kvcache.connector import build_connector
from splitserve.kvcache.redis import RedisTier, connect
from tests.support.redis import PASSWORD, REDIS_SERVER, ConfiguredRedis

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")

LAYOUT = "float32-L2-H1-D8-B16"
MODEL = "m"


@pytest.fixture(scope="module")
def protected() -> Iterator[ConfiguredRedis]:
    """``requirepass``, plus an ACL user ``ep-a`` that may touch only keys under ``ep-a:``."""
    server = ConfiguredRedis([f"requirepass {PASSWORD}", "user ep-a on >a-pass-987654 ~ep-a:* +@all"])
    yield server
    server.stop()


def record(key: str) -> bytes:
    return serde.RecordSigner.for_secret(None, MODEL, LAYOUT).encode(torch.ones(2, 2, 16, 1, 8), 16, key)


KEY = cache_key(MODEL, LAYOUT, 0xABC)


def test_an_unauthenticated_client_is_refused(protected: ConfiguredRedis) -> None:
    url = f"redis://127.0.0.1:{protected.port}/0"
    with pytest.raises(redis.AuthenticationError):
        connect(url).get("anything")
    with pytest.raises(redis.AuthenticationError):
        connect(url, password="wrong").get("anything")
    tier = RedisTier(f"redis://127.0.0.1:{protected.port}/0")  # a worker without the password: misses, no crash
    tier.put(KEY, record(KEY))
    assert tier.get_many([KEY]) == [None] and tier.stats().num_errors >= 1
    tier.close()


def test_the_worker_tier_authenticates_from_its_config_and_prefixes_its_keys(protected: ConfiguredRedis) -> None:
    config = KVTierConfig(
        l2_backend=L2Backend.REDIS,
        l2_url=f"redis://127.0.0.1:{protected.port}/0",
        l2_password=PASSWORD,
        l2_key_prefix="ep-b:",
    )
    assert PASSWORD not in repr(config)
    connector = build_connector(config, MODEL, LAYOUT)
    store = connector.store
    store.put(KEY, record(KEY))
    assert store.flush(timeout_s=10)
    admin = redis.Redis(port=protected.port, password=PASSWORD)
    assert admin.exists(f"ep-b:{KEY}") and not admin.exists(KEY)
    store.l1.delete(KEY)
    assert store.get_prefix([KEY]) == [record(KEY)]  # read back from Redis, its MAC checked
    connector.close()


def test_an_acl_user_reaches_only_its_own_prefix(protected: ConfiguredRedis) -> None:
    url = f"redis://127.0.0.1:{protected.port}/0"
    own = RedisTier(connect(url, username="ep-a", password="a-pass-987654"), key_prefix="ep-a:", owns_client=True)
    own.put(KEY, record(KEY))
    assert own.get_many([KEY]) == [record(KEY)]
    other = RedisTier(connect(url, username="ep-a", password="a-pass-987654"), key_prefix="ep-b:", owns_client=True)
    other.put(KEY, record(KEY))  # NOPERM: a miss and an error, never a crash
    assert other.get_many([KEY]) == [None] and other.stats().num_errors >= 1
    own.close()
    other.close()


def test_rediss_with_the_servers_ca(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    tls = [f"tls-cert-file {cert}", f"tls-key-file {key}", f"tls-ca-cert-file {cert}", "tls-auth-clients no"]
    server = ConfiguredRedis([*tls, f"requirepass {PASSWORD}"], tls=True)
    try:
        url = f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={cert}"
        tier = RedisTier(connect(url, password=PASSWORD), owns_client=True)
        tier.put(KEY, record(KEY))
        assert tier.get_many([KEY]) == [record(KEY)]
        tier.close()
        plain = RedisTier(connect(f"redis://127.0.0.1:{server.port}/0", password=PASSWORD), owns_client=True)
        assert plain.get_many([KEY]) == [None]  # no TLS: the server drops it
        plain.close()
        unverified = RedisTier(connect(f"rediss://127.0.0.1:{server.port}/0", password=PASSWORD), owns_client=True)
        assert unverified.get_many([KEY]) == [None]  # TLS against an unknown CA: refused
        unverified.close()
    finally:
        server.stop()

"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.redis import RedisServer


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """A throw-away redis-server for the module's tests."""
    server = RedisServer()
    server.start()
    yield server
    server.stop()

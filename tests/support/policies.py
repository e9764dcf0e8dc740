"""The routing policies' tests' small world: block and chunk sizes, prompts of whole blocks, routing requests, the
default load guard, and a KV index with two registered workers."""

from __future__ import annotations

from splitserve.config import RouterConfig
from splitserve.protocol.kv_events import EventKind, Tier
from splitserve.router.kv_index import KVIndex
from splitserve.router.policies import LoadGuard, RoutingRequest

BLOCK_SIZE = 4
CHUNK_SIZE = 16  # 4 blocks per chunk
PATH = "/v1/completions"
W0, W1 = "http://w0:8000", "http://w1:8000"


def prompt(num_blocks: int, start: int = 0) -> list[int]:
    """``num_blocks`` full blocks of distinct token ids; a different ``start`` gives an unrelated prompt."""
    return list(range(start, start + num_blocks * BLOCK_SIZE))


def routing(token_ids: list[int] | None = None, session_id: str | None = None) -> RoutingRequest:
    return RoutingRequest(PATH, session_id, token_ids, block_size=BLOCK_SIZE)


def guard() -> LoadGuard:
    defaults = RouterConfig()
    return LoadGuard(defaults.balance_abs_threshold, defaults.balance_rel_threshold)  # 4 and 1.5


def kv_index(max_blocks: int = 10_000) -> KVIndex:
    index = KVIndex(BLOCK_SIZE, CHUNK_SIZE, max_blocks)
    for i, url in enumerate((W0, W1)):
        assert index.apply(url, f"w-{i}", True, [], {"block_size": BLOCK_SIZE})
    return index


def stored(index: KVIndex, url: str, tier: Tier, hashes: list[int]) -> None:
    assert index.apply(url, "w", False, [(tier, EventKind.STORED, hashes)])

"""The KV connector tests' tiered store (an L1 in memory over any L2, records checked with the model's signer) and
the keys of the records a worker saves for a prompt."""

from __future__ import annotations

from splitserve.keys import cache_key, chunk_hashes, hash_blocks
from splitserve.kvcache import serde
from splitserve.kvcache.cpu import CPUTier
from splitserve.kvcache.store import TieredStore
from splitserve.kvcache.tiers import KVTier, NullTier

BLOCK = 16
CHUNK = 32
MODEL_ID = "tiny"


def make_store(layout: str, l2: KVTier | None, l1: bool = True, max_pending: int = 1 << 28) -> TieredStore:
    return TieredStore(
        CPUTier(64 << 20) if l1 else NullTier(),
        l2,
        validate=serde.RecordSigner.for_secret(None, MODEL_ID, layout).verify,
        max_pending_write_bytes=max_pending,
    )


def chunk_keys(layout: str, prompt: list[int]) -> list[str]:
    hashes = chunk_hashes(hash_blocks(prompt, BLOCK), CHUNK // BLOCK)
    return [cache_key(MODEL_ID, layout, h) for h in hashes]


def record_keys(layout: str, prompt: list[int]) -> list[str]:
    """Keys of the records a worker saves for ``prompt``: its whole chunks, then its tail of full blocks if any."""
    hashes = hash_blocks(prompt, BLOCK)
    keys = chunk_keys(layout, prompt)
    if len(hashes) % (CHUNK // BLOCK):
        keys.append(cache_key(MODEL_ID, layout, hashes[-1]))
    return keys

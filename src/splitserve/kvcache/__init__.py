"""Tiered KV cache: records (serde), tiers (CPU memory, disk, Redis) and the TieredStore over them.

Every tier is keyed by ``keys.cache_key(model_id, layout, chunk_hash)`` and holds ``serde`` records. The
record format (``splitserve.kvcache.serde``) needs torch and is imported explicitly; the tiers and the store
do not, so importing this package stays light.
"""

from splitserve.breaker import BreakerState, CircuitBreaker
from splitserve.kvcache.cpu import CPUTier
from splitserve.kvcache.disk import DiskTier
from splitserve.kvcache.redis import RedisTier
from splitserve.kvcache.store import PrefixHit, StoreStats, TieredStore
from splitserve.kvcache.tiers import KVTier, NullTier, TierStats

__all__ = [
    "BreakerState",
    "CPUTier",
    "CircuitBreaker",
    "DiskTier",
    "KVTier",
    "NullTier",
    "PrefixHit",
    "RedisTier",
    "StoreStats",
    "TierStats",
    "TieredStore",
]

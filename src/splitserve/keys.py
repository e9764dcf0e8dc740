"""The one KV key scheme, shared by the engine's prefix cache, the KV tiers, PD transfer and the router.

Tokens are grouped in blocks of ``block_size`` tokens. A block's hash is xxh3-64, seeded with
``KEY_SEED``, over (parent block hash as 8 little-endian bytes, the block's token ids as little-endian
uint32, extra key bytes). The first block's parent is ``ROOT_HASH``, or for a request with a ``cache_salt``
a hash of the salt (:func:`salt_root`). Only full blocks are hashed. A chunk
(``chunk_size`` tokens, a multiple of ``block_size``) is named by the hash of its last block, and so is a
shorter stored run of blocks that starts at a chunk boundary (a prompt's tail): a name always covers the
tokens from the chunk boundary at or before its block to the end of that block.

Never Python's ``hash()``: that is salted per process, and these keys cross processes and machines.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

KEY_SEED = 0x5B117_5E7E  # fixed project constant; changing it invalidates every stored key
ROOT_HASH = 0
KEY_FORMAT_VERSION = "v1"


MAX_CACHE_SALT_CHARS = 256


def is_valid_cache_salt(salt: object) -> bool:
    """A ``cache_salt`` :func:`salt_root` can hash: a string of 1 to ``MAX_CACHE_SALT_CHARS`` characters that
    UTF-8 can encode (a lone surrogate cannot)."""
    if not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        return False
    try:
        salt.encode()
    except UnicodeEncodeError:
        return False
    return True


def salt_root(cache_salt: str | None) -> int:
    """The parent hash of a prompt's first block: ``ROOT_HASH``, or one derived from ``cache_salt``.

    vLLM's ``cache_salt`` semantics: the salt is mixed into the first block's hash, so every block hash of a
    salted prompt differs from the same prompt's under another salt (or none). Prompts that share a salt share
    their cached prefixes as before; across salts nothing is shared: engine prefix cache, L1/L2 keys, the
    router's indexes and ``/kv/lookup`` all build on these hashes.
    """
    if not cache_salt:
        return ROOT_HASH
    return xxhash.xxh3_64_intdigest(b"splitserve cache salt\0" + cache_salt.encode(), seed=KEY_SEED)


def hash_block(parent_hash: int, token_ids: Sequence[int], extra_key: bytes = b"") -> int:
    """Hash one block of tokens chained to its parent's hash; returns an unsigned 64-bit int."""
    h = xxhash.xxh3_64(seed=KEY_SEED)
    h.update(parent_hash.to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    if extra_key:
        h.update(extra_key)
    return h.intdigest()


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    parent_hash: int = ROOT_HASH,
    extra_key: bytes = b"",
    start_block: int = 0,
) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` from block ``start_block`` on.

    ``parent_hash`` must be the hash of block ``start_block - 1`` (``ROOT_HASH`` when starting at 0), so
    callers can extend a hash list incrementally as tokens arrive.
    """
    hashes: list[int] = []
    num_full = len(token_ids) // block_size
    for i in range(start_block, num_full):
        parent_hash = hash_block(parent_hash, token_ids[i * block_size : (i + 1) * block_size], extra_key)
        hashes.append(parent_hash)
    return hashes


def chunk_hashes(block_hashes: Sequence[int], blocks_per_chunk: int) -> list[int]:
    """Names of the full chunks: the hash of each chunk's last block."""
    return [block_hashes[i] for i in range(blocks_per_chunk - 1, len(block_hashes), blocks_per_chunk)]


def kv_layout(dtype: str, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int) -> str:
    """A short string naming the KV layout; records with another layout are not interchangeable."""
    return f"{dtype}-L{num_layers}-H{num_kv_heads}-D{head_dim}-B{block_size}"


def cache_key(model_id: str, layout: str, block_hash: int) -> str:
    """The full namespaced key of a chunk or block: ``splitserve:v1:{model_id}:{layout}:{hash:016x}``."""
    return f"splitserve:{KEY_FORMAT_VERSION}:{model_id}:{layout}:{block_hash:016x}"


def hash_of_key(key: str) -> int:
    """The block hash a ``cache_key`` names (its last field)."""
    return int(key.rsplit(":", 1)[1], 16)


def hash_tokens(token_ids: Sequence[int]) -> int:
    """One xxh3-64 (seeded with ``KEY_SEED``) over a whole token sequence: names the tokens a transfer holds."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(token_ids)}I", *token_ids), seed=KEY_SEED)

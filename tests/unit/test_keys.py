"""The key scheme is stable: same tokens, same hashes, in any process, whatever PYTHONHASHSEED is."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from splitserve.keys import ROOT_HASH, cache_key, chunk_hashes, hash_block, hash_blocks, kv_layout

TOKENS = list(range(1000, 1100))

# Python's hash() of small ints does not depend on PYTHONHASHSEED but its hash of bytes and str does, so the
# child also hashes with extra key bytes and builds string keys: a hash()-based scheme would differ here.
SCRIPT = (
    "import json; from splitserve.keys import hash_blocks, hash_block, cache_key, kv_layout; "
    f"hs = hash_blocks({TOKENS!r}, 16); "
    f"print(json.dumps([hs, hash_block(7, {TOKENS[:16]!r}, b'lora-adapter'), "
    "cache_key('smollm2', kv_layout('bfloat16', 30, 3, 64, 16), hs[-1])]))"
)


def test_hashes_identical_across_processes_with_different_hashseeds() -> None:
    results = []
    for seed in ("0", "1", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
        results.append(json.loads(out.stdout))
    assert all(r == results[0] for r in results)
    hashes = hash_blocks(TOKENS, 16)
    assert results[0] == [
        hashes,
        hash_block(7, TOKENS[:16], b"lora-adapter"),
        cache_key("smollm2", kv_layout("bfloat16", 30, 3, 64, 16), hashes[-1]),
    ]


def test_only_full_blocks_are_hashed_and_chained() -> None:
    hashes = hash_blocks(TOKENS, 16)
    assert len(hashes) == 6
    assert hashes[0] == hash_block(ROOT_HASH, TOKENS[:16])
    assert hashes[1] == hash_block(hashes[0], TOKENS[16:32])
    # the same block content under a different parent gets a different hash
    assert hash_block(123, TOKENS[16:32]) != hashes[1]


def test_incremental_extension_matches_one_shot() -> None:
    first = hash_blocks(TOKENS[:40], 16)
    rest = hash_blocks(TOKENS, 16, parent_hash=first[-1], start_block=len(first))
    assert first + rest == hash_blocks(TOKENS, 16)


def test_extra_key_changes_hash() -> None:
    assert hash_block(ROOT_HASH, TOKENS[:16], b"lora-1") != hash_block(ROOT_HASH, TOKENS[:16])


def test_chunks_named_by_last_block() -> None:
    hashes = hash_blocks(list(range(16 * 40)), 16)
    assert chunk_hashes(hashes, 16) == [hashes[15], hashes[31]]


def test_cache_key_format() -> None:
    layout = kv_layout("bfloat16", 30, 3, 64, 16)
    key = cache_key("smollm2", layout, 0xABC)
    assert key == "splitserve:v1:smollm2:bfloat16-L30-H3-D64-B16:0000000000000abc"

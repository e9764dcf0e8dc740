"""vLLM's KV event wire format (``vllm.distributed.kv_events``): decode what vLLM publishes, encode the same.

vLLM started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'`` publishes
its prefix cache's events on a ZMQ PUB socket, one message per engine step, in three frames::

    topic (UTF-8, the config's "topic", "" by default) | sequence number (8 bytes, big-endian, from 0) | payload

The payload is msgpack (msgspec's encoding of ``KVEventBatch``): an array ``[ts, events, data_parallel_rank]``
(the rank may be absent or nil). Each event is tagged with its type. vLLM 0.32 (since vLLM PR #42892) writes
an event as a map, ``{"type": "BlockStored", "block_hashes": [...], ...}``, leaving out optional fields that
are nil; earlier versions wrote a positional array, ``["BlockStored", block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium, lora_name, ...]``. :func:`decode_batch` reads both; :func:`encode_batch`
writes the map layout unless asked for the array one. The three events:

- ``BlockStored``: ``block_hashes`` (a chain of full blocks), ``parent_block_hash`` (the block before the first;
  nil for a prompt's first block), ``token_ids`` (every token of those blocks), ``block_size``, ``lora_id``,
  ``medium`` (``"GPU"``, or ``"CPU"``/``"STORAGE"`` from a connector that stores KV elsewhere), ``lora_name``,
  then optional ``extra_keys`` (per block: the LoRA name, multimodal ``(identifier, offset)`` pairs and, on a
  prompt's first block, its ``cache_salt``), ``group_idx``, two fields on the KV cache's spec, and ``locality``
  (``"LOCAL"`` or ``"REMOTE"`` to the publisher: a connector's remote store is shared with other workers).
- ``BlockRemoved``: ``block_hashes``, ``medium``, optional ``group_idx`` and ``locality``.
- ``AllBlocksCleared``: no fields (the prefix cache was reset).

Block hashes are unsigned 64-bit ints by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), else 32-byte
digests; vLLM's own hash function, so opaque to anyone else: the token ids are what a consumer can rebuild.

A subscriber that sees a gap in the sequence numbers asks the replay socket (ZMQ ROUTER, the config's
``replay_endpoint``) for what it missed: from a DEALER socket it sends ``["", start]`` (start: 8 bytes
big-endian) and gets every buffered batch from ``start`` on as ``["", topic, seq, payload]``, then
``["", "", -1 (8 bytes, signed big-endian), ""]``.

``tests/data/vllm_0_32_kv_events.json`` holds batches recorded from vLLM 0.32's own publisher
(``scripts/record_vllm_kv_events.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgpack

BlockHash = int | bytes  # vLLM's ExternalBlockHash
REPLAY_END_SEQ = -1
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
LOCALITY_LOCAL = "LOCAL"
LOCALITY_REMOTE = "REMOTE"


class EventLayout(StrEnum):
    """How an event is written: vLLM 0.32's map, or the positional array of earlier versions."""

    MAP = "map"
    ARRAY = "array"


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[Any] | None = None  # per block: a tuple of extra hash keys, or None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None
    locality: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


# Each event's fields in wire order; a decoder needs the first few, vLLM writes a few more even when nil.
_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                    "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx", "locality"),
    "AllBlocksCleared": (),
}  # fmt: skip
_NUM_NEEDED = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}
_NUM_ALWAYS_WRITTEN = {"BlockStored": 7, "BlockRemoved": 2, "AllBlocksCleared": 0}
_TYPES: dict[str, type[KVCacheEvent]] = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved,
                                          "AllBlocksCleared": AllBlocksCleared}  # fmt: skip


def encode_batch(batch: EventBatch, layout: EventLayout = EventLayout.MAP) -> bytes:
    """The msgpack payload of ``batch``, as vLLM's publisher writes it (``layout``: see the module's doc)."""
    body: list[Any] = [batch.ts, [_encode_event(event, layout) for event in batch.events]]
    if batch.data_parallel_rank is not None:
        body.append(batch.data_parallel_rank)
    return msgpack.packb(body, use_bin_type=True)


def _encode_event(event: KVCacheEvent, layout: EventLayout) -> Any:
    tag = type(event).__name__
    names, num_written = _FIELDS[tag], _NUM_ALWAYS_WRITTEN[tag]
    values = [getattr(event, name) for name in names]
    if layout == EventLayout.MAP:
        fields = {n: v for i, (n, v) in enumerate(zip(names, values, strict=True)) if i < num_written or v is not None}
        return {"type": tag, **fields}
    while len(values) > num_written and values[-1] is None:  # msgspec's omit_defaults: trailing nils go
        values.pop()
    return [tag, *values]


def decode_batch(payload: bytes) -> EventBatch:
    """Read one payload; ``ValueError`` naming what is wrong. Events of types this module does not know (a newer
    vLLM's) are skipped, and so are fields it does not know."""
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    if not isinstance(body, list) or len(body) < 2 or not isinstance(body[1], list):
        raise ValueError("an event batch is an array [ts, events, data_parallel_rank]")
    ts, raw_events = body[0], body[1]
    rank = body[2] if len(body) > 2 else None
    if not isinstance(ts, int | float) or not (rank is None or type(rank) is int):
        raise ValueError("an event batch's ts must be a number and its data_parallel_rank an int or nil")
    events = []
    for i, raw in enumerate(raw_events):
        try:
            event = _decode_event(raw)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"events[{i}]: {exc}") from None
        if event is not None:
            events.append(event)
    return EventBatch(float(ts), events, rank)


def _decode_event(raw: Any) -> KVCacheEvent | None:
    if isinstance(raw, dict):
        tag, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        names = _FIELDS.get(tag, ()) if isinstance(tag, str) else ()
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise ValueError("an event is a map with a 'type' or an array starting with its type")
    if not isinstance(tag, str):
        raise ValueError("an event's type must be a string")
    if tag not in _TYPES:
        return None
    names = _FIELDS[tag]
    missing = [name for name in names[: _NUM_NEEDED[tag]] if name not in fields]
    if missing:
        raise ValueError(f"{tag} lacks {', '.join(missing)}")
    event = _TYPES[tag](**{name: fields[name] for name in names if name in fields})
    _check(event)
    return event


def _check(event: KVCacheEvent) -> None:
    if isinstance(event, AllBlocksCleared):
        return
    if not isinstance(event.block_hashes, list) or not all(_is_hash(h) for h in event.block_hashes):
        raise ValueError("block_hashes must be a list of unsigned 64-bit ints or byte strings")
    if not (event.medium is None or isinstance(event.medium, str)):
        raise ValueError("medium must be a string or nil")
    if not (event.locality is None or isinstance(event.locality, str)):
        raise ValueError("locality must be a string or nil")
    if isinstance(event, BlockStored):
        if not (event.parent_block_hash is None or _is_hash(event.parent_block_hash)):
            raise ValueError("parent_block_hash must be a block hash or nil")
        if not isinstance(event.token_ids, list) or not all(type(t) is int and t >= 0 for t in event.token_ids):
            raise ValueError("token_ids must be a list of token ids")
        if type(event.block_size) is not int or event.block_size < 1:
            raise ValueError("block_size must be a positive int")
        if not (event.extra_keys is None or isinstance(event.extra_keys, list)):
            raise ValueError("extra_keys must be a list or nil")


def _is_hash(value: object) -> bool:
    return (type(value) is int and 0 <= value < 2**64) or isinstance(value, bytes)


def encode_frames(topic: str, seq: int, payload: bytes) -> list[bytes]:
    """The three frames of one published batch."""
    return [topic.encode(), seq.to_bytes(8, "big"), payload]


def decode_frames(frames: Sequence[bytes]) -> tuple[str, int, bytes]:
    """``(topic, seq, payload)`` of a published (or replayed) message; ``ValueError`` if it is not one."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise ValueError(f"a KV event message has 3 frames (topic, 8-byte sequence number, payload), got {len(frames)}")
    try:
        topic = bytes(frames[0]).decode()
    except UnicodeDecodeError:
        raise ValueError("the topic frame is not UTF-8") from None
    return topic, int.from_bytes(frames[1], "big", signed=True), bytes(frames[2])


def cache_salt_of(event: BlockStored) -> str | None:
    """The ``cache_salt`` of a prompt's first block (its ``extra_keys`` entry), or None."""
    if event.parent_block_hash is not None or not event.extra_keys or not event.extra_keys[0]:
        return None
    keys = [key for key in event.extra_keys[0] if isinstance(key, str)]
    if event.lora_name is not None and keys:
        keys = keys[1:]  # the LoRA name comes first
    return keys[0] if keys else None


def has_foreign_keys(event: BlockStored) -> bool:
    """True when the blocks' hashes depend on more than tokens and a salt (LoRA, multimodal inputs, prompt
    embeddings): a consumer that hashes token ids alone cannot name them."""
    if event.lora_id is not None or event.lora_name is not None:
        return True
    for i, keys in enumerate(event.extra_keys or ()):
        if keys is None:
            continue
        if not isinstance(keys, list | tuple) or not all(isinstance(key, str) for key in keys):
            return True
        if i > 0 or event.parent_block_hash is not None or len(keys) > 1:
            return True  # a salt rides on a prompt's first block only, alone
    return False

"""The stored form of one KV chunk: a self-describing header, then the raw KV bytes.

A record is one value in every tier (L1, disk, Redis), so a reader never sees a header without its payload.
Layout, all little-endian::

    offset  size  field
    0       4     magic b"SSKV"
    4       2     format version (uint16)
    6       1     dtype code (see ``DTYPE_CODES``)
    7       1     ndim (uint8)
    8       4     token count (uint32)
    12      2     layout string length in bytes (uint16)
    14      2     reserved, 0
    16      8     payload length in bytes (uint64)
    24      8     xxh3-64 of the payload (uint64)
    32      8*n   shape, one uint64 per dim
    ..      L     layout string (utf-8), e.g. ``bfloat16-L30-H3-D64-B16`` from ``keys.kv_layout``
    ..      pad   zeros up to a multiple of 64 bytes, so the payload is aligned for zero-copy views
    P       N     payload: the tensor's bytes, C order

A chunk's KV tensor has shape ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]`` (bfloat16, float16 or
float32). Decoding checks everything it can and raises :class:`RecordError` otherwise; callers treat that as a
miss (recompute), never as data.
"""

from __future__ import annotations

import math
import struct
import warnings
from dataclasses import dataclass
from enum import StrEnum

import torch
import xxhash

MAGIC = b"SSKV"
FORMAT_VERSION = 1
PAYLOAD_ALIGN_BYTES = 64
KV_NDIM = 5
TOKEN_DIM = 2  # [num_layers, 2, num_tokens, num_kv_heads, head_dim]

_FIXED = struct.Struct("<4sHBBIHHQQ")  # 32 bytes, see the module docstring
_MAX_LAYOUT_BYTES = 0xFFFF

DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
_DTYPES_BY_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}

# torch.frombuffer warns (once per process) that a bytes object is read-only. Decoded tensors are views of the
# stored value by design (zero copy); callers copy them into the KV cache and never write to them.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


class RecordFault(StrEnum):
    """Why a record was rejected; one label per cause, for logs and metrics."""

    TRUNCATED = "truncated"
    MAGIC = "magic"
    VERSION = "version"
    DTYPE = "dtype"
    SHAPE = "shape"
    LAYOUT = "layout"
    CHECKSUM = "checksum"


class RecordError(ValueError):
    """A stored record that must not be served: corrupt, foreign or from another format version."""

    def __init__(self, fault: RecordFault, detail: str) -> None:
        super().__init__(f"bad KV record ({fault.value}): {detail}")
        self.fault = fault


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """The parsed header of a record; ``payload_offset`` is where the raw KV bytes start."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    num_tokens: int
    layout: str
    checksum: int
    payload_offset: int
    payload_nbytes: int


def _payload_offset(ndim: int, layout_nbytes: int) -> int:
    header_nbytes = _FIXED.size + 8 * ndim + layout_nbytes
    return -(-header_nbytes // PAYLOAD_ALIGN_BYTES) * PAYLOAD_ALIGN_BYTES


def _check_kv_shape(shape: tuple[int, ...], num_tokens: int) -> str | None:
    """A description of what is wrong with a chunk's KV shape, or None when it is well formed."""
    if len(shape) != KV_NDIM or shape[1] != 2:
        return f"shape {list(shape)} is not [num_layers, 2, num_tokens, num_kv_heads, head_dim]"
    if shape[TOKEN_DIM] != num_tokens or num_tokens <= 0:
        return f"shape {list(shape)} does not hold {num_tokens} tokens"
    if 0 in shape:
        return f"shape {list(shape)} is empty"
    return None


def encode(kv: torch.Tensor, num_tokens: int, layout: str) -> bytes:
    """Serialize one chunk's KV into a record.

    Args:
        kv: ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]`` in bfloat16, float16 or float32, on any
            device (it is copied to CPU if needed).
        num_tokens: tokens in the chunk; must equal ``kv.shape[2]``.
        layout: the layout string from ``keys.kv_layout``; a reader with another layout gets a RecordError.

    Returns the record; one copy of the payload is made (into the returned bytes).
    Raises ValueError for an unsupported dtype, a malformed shape or an over-long layout (a caller's bug).
    """
    if kv.dtype not in DTYPE_CODES:
        raise ValueError(f"unsupported KV dtype {kv.dtype}; supported: {sorted(str(d) for d in DTYPE_CODES)}")
    shape = tuple(kv.shape)
    if (problem := _check_kv_shape(shape, num_tokens)) is not None:
        raise ValueError(problem)
    layout_bytes = layout.encode()
    if len(layout_bytes) > _MAX_LAYOUT_BYTES:
        raise ValueError(f"layout string of {len(layout_bytes)} bytes is too long (max {_MAX_LAYOUT_BYTES})")
    payload = _byte_view(kv)
    checksum = xxhash.xxh3_64_intdigest(payload)
    dtype_code = DTYPE_CODES[kv.dtype]
    fixed = _FIXED.pack(
        MAGIC, FORMAT_VERSION, dtype_code, len(shape), num_tokens, len(layout_bytes), 0, len(payload), checksum
    )
    offset = _payload_offset(len(shape), len(layout_bytes))
    header = b"".join((fixed, struct.pack(f"<{len(shape)}Q", *shape), layout_bytes))
    return b"".join((header, bytes(offset - len(header)), payload))


def _byte_view(kv: torch.Tensor) -> memoryview:
    """The tensor's bytes in C order, without a copy when it is already a contiguous CPU tensor."""
    flat_bytes = kv.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # [numel * itemsize]
    return memoryview(flat_bytes.numpy())  # type: ignore[arg-type]  # ndarray implements the buffer protocol


def read_header(data: bytes | bytearray | memoryview) -> RecordHeader:
    """Parse and sanity-check a record's header (not the payload checksum). Raises RecordError."""
    if len(data) < _FIXED.size:
        raise RecordError(RecordFault.TRUNCATED, f"{len(data)} bytes is shorter than the fixed header")
    magic, version, dtype_code, ndim, num_tokens, layout_nbytes, _, payload_nbytes, checksum = _FIXED.unpack_from(data)
    if magic != MAGIC:
        raise RecordError(RecordFault.MAGIC, f"magic {magic!r} != {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise RecordError(RecordFault.VERSION, f"format version {version} != {FORMAT_VERSION}")
    if (dtype := _DTYPES_BY_CODE.get(dtype_code)) is None:
        raise RecordError(RecordFault.DTYPE, f"unknown dtype code {dtype_code}")
    offset = _payload_offset(ndim, layout_nbytes)
    if len(data) < offset:
        raise RecordError(RecordFault.TRUNCATED, f"{len(data)} bytes is shorter than the {offset}-byte header")
    shape = struct.unpack_from(f"<{ndim}Q", data, _FIXED.size)
    layout = _decode_layout(data, _FIXED.size + 8 * ndim, layout_nbytes)
    if (problem := _check_kv_shape(shape, num_tokens)) is not None:
        raise RecordError(RecordFault.SHAPE, problem)
    if payload_nbytes != math.prod(shape) * dtype.itemsize:
        raise RecordError(RecordFault.SHAPE, f"payload of {payload_nbytes} bytes does not match {list(shape)} {dtype}")
    if len(data) != offset + payload_nbytes:
        raise RecordError(RecordFault.TRUNCATED, f"record is {len(data)} bytes, header says {offset + payload_nbytes}")
    return RecordHeader(dtype, shape, num_tokens, layout, checksum, offset, payload_nbytes)


def _decode_layout(data: bytes | bytearray | memoryview, start: int, nbytes: int) -> str:
    try:
        return bytes(data[start : start + nbytes]).decode()
    except UnicodeDecodeError as exc:
        raise RecordError(RecordFault.LAYOUT, "layout string is not utf-8") from exc


FIXED_HEADER_BYTES = _FIXED.size


def payload_offset(fixed_header: bytes | bytearray | memoryview) -> int:
    """Where the payload starts, from a record's first ``FIXED_HEADER_BYTES`` (to checksum while receiving)."""
    magic, _, _, ndim, _, layout_nbytes, *_ = _FIXED.unpack_from(fixed_header)
    if magic != MAGIC:
        raise RecordError(RecordFault.MAGIC, f"magic {magic!r} != {MAGIC!r}")
    return _payload_offset(ndim, layout_nbytes)


def verify_with_checksum(data: bytes | bytearray | memoryview, expected_layout: str, checksum: int) -> RecordHeader:
    """:func:`verify`, given the payload's xxh3 already computed (e.g. while it arrived)."""
    header = read_header(data)
    if header.layout != expected_layout:
        raise RecordError(RecordFault.LAYOUT, f"layout {header.layout!r} != expected {expected_layout!r}")
    if checksum != header.checksum:
        raise RecordError(RecordFault.CHECKSUM, f"payload xxh3 {checksum:016x} != header {header.checksum:016x}")
    return header


def verify(data: bytes | bytearray | memoryview, expected_layout: str) -> RecordHeader:
    """Check a record completely (header, layout and payload checksum) without building a tensor.

    Returns the header; raises RecordError. Suitable as ``TieredStore``'s ``validate`` hook.
    """
    header = read_header(data)
    if header.layout != expected_layout:
        raise RecordError(RecordFault.LAYOUT, f"layout {header.layout!r} != expected {expected_layout!r}")
    payload = memoryview(data)[header.payload_offset :]
    if (actual := xxhash.xxh3_64_intdigest(payload)) != header.checksum:
        raise RecordError(RecordFault.CHECKSUM, f"payload xxh3 {actual:016x} != header {header.checksum:016x}")
    return header


def decode(
    data: bytes | bytearray | memoryview,
    expected_layout: str,
    expected_shape: tuple[int, ...] | None = None,
    expected_dtype: torch.dtype | None = None,
    *,
    verify_checksum: bool = True,
) -> torch.Tensor:
    """Turn a record back into its KV tensor, checking it first.

    Args:
        data: the record as stored.
        expected_layout: the reader's ``keys.kv_layout`` string; another layout is a RecordError.
        expected_shape / expected_dtype: when given, the tensor must have exactly this shape / dtype.
        verify_checksum: skip the payload checksum only when the caller already ran :func:`verify`.

    Returns a CPU tensor ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]`` that is a zero-copy view of
    ``data``: it must not be written to, and ``data`` must outlive it (copy it into the KV cache).
    Raises RecordError for any bad magic, version, dtype, shape, layout, length or checksum.
    """
    header = verify(data, expected_layout) if verify_checksum else read_header(data)
    if not verify_checksum and header.layout != expected_layout:
        raise RecordError(RecordFault.LAYOUT, f"layout {header.layout!r} != expected {expected_layout!r}")
    if expected_shape is not None and tuple(expected_shape) != header.shape:
        raise RecordError(RecordFault.SHAPE, f"shape {list(header.shape)} != expected {list(expected_shape)}")
    if expected_dtype is not None and expected_dtype != header.dtype:
        raise RecordError(RecordFault.DTYPE, f"dtype {header.dtype} != expected {expected_dtype}")
    numel = math.prod(header.shape)
    flat = torch.frombuffer(data, dtype=header.dtype, count=numel, offset=header.payload_offset)
    return flat.view(header.shape)

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
    14      2     model id length in bytes (uint16)
    16      8     payload length in bytes (uint64)
    24      8     xxh3-64 of the payload (uint64)
    32      8     token hash: the block hash the record's key names (uint64; 0 when unnamed, e.g. a PD push)
    40      32    MAC: keyed BLAKE3 over the key, this header with the MAC zeroed, and the payload (zeros: unsigned)
    72      8*n   shape, one uint64 per dim
    ..      L     layout string (utf-8), e.g. ``bfloat16-L30-H3-D64-B16`` from ``keys.kv_layout``
    ..      M     model id (utf-8)
    ..      pad   zeros up to a multiple of 64 bytes, so the payload is aligned for zero-copy views
    P       N     payload: the tensor's bytes, C order

A chunk's KV tensor has shape ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]`` (bfloat16, float16 or
float32), or ``[..., head_dim + head_dim / 16]`` bytes in the int8 or fp8 format (``model/kv_format.py``:
``--kv-cache-dtype``). Decoding checks everything it can and raises :class:`RecordError` otherwise; callers
treat that as a miss (recompute), never as data.

**Signed records.** The KV tiers sign every record they store (:func:`encode` with a ``signer``) and accept
from a shared tier (Redis, disk) only records whose MAC, made with the key derived from the cluster secret,
covers the very key they were read under, and whose header names the reader's model, layout and that key's
block hash (:meth:`RecordSigner.verify`). So a record copied under another key, written by anyone without the
secret, or made by another model is a miss. Without a cluster secret the MAC key is a public constant: the
check then catches damage and misfiled records, not forgery. A PD push is not signed this way; the transfer
itself is (``pd.wire.payload_mac``), and the xxh3 checksum is checked as the bytes arrive.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import struct
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

import blake3
import torch
import xxhash

from splitserve.errors import SplitserveError
from splitserve.keys import hash_of_key

MAGIC = b"SSKV"
FORMAT_VERSION = 2
PAYLOAD_ALIGN_BYTES = 64
KV_NDIM = 5
TOKEN_DIM = 2  # [num_layers, 2, num_tokens, num_kv_heads, head_dim]
MAC_BYTES = 32

_FIXED = struct.Struct("<4sHBBIHHQQQ32s")  # 72 bytes, see the module docstring
_MAC_OFFSET = _FIXED.size - MAC_BYTES
_NO_MAC = bytes(MAC_BYTES)
_MAX_STRING_BYTES = 0xFFFF

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.int8: 4,  # model/kv_format.py's int8 rows
    torch.uint8: 5,  # its fp8 (E4M3) rows
}
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
    IDENTITY = "identity"  # another model, or another key's tokens
    MAC = "mac"  # unsigned, or signed with another secret, or over other bytes


class RecordError(SplitserveError, ValueError):
    """A stored record that must not be served: corrupt, foreign or from another format version."""

    def __init__(self, fault: RecordFault, detail: str) -> None:
        super().__init__(f"bad KV record ({fault.value}): {detail}")
        self.fault = fault

    @property
    def is_foreign(self) -> bool:
        """Possibly sound, but someone else's: another secret (a rotation in progress), model, layout or format
        version. A reader treats it as a miss and leaves it where it is."""
        return self.fault in (RecordFault.MAC, RecordFault.IDENTITY, RecordFault.LAYOUT, RecordFault.VERSION)


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """The parsed header of a record; ``payload_offset`` is where the raw KV bytes start."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    num_tokens: int
    layout: str
    model_id: str
    token_hash: int
    checksum: int
    mac: bytes
    payload_offset: int
    payload_nbytes: int


@dataclass(frozen=True, slots=True)
class RecordSigner:
    """Signs the records a worker stores and checks the ones it reads from a shared tier.

    Build it with :meth:`for_secret`: the MAC key is derived from the cluster secret, or is a public constant
    when there is none (integrity, not authenticity).
    """

    mac_key: bytes
    model_id: str
    layout: str

    @classmethod
    def for_secret(cls, secret: str | None, model_id: str, layout: str) -> RecordSigner:
        material = b"splitserve kv record\0" + (secret or "").encode()
        return cls(hashlib.sha256(material).digest(), model_id, layout)

    def mac(self, key: str, header: bytes | bytearray | memoryview, payload: bytes | memoryview) -> bytes:
        """Keyed BLAKE3 over the key (length-prefixed), the header with its MAC zeroed, and the payload."""
        key_bytes = key.encode()
        h = blake3.blake3(key=self.mac_key, max_threads=blake3.blake3.AUTO)
        h.update(struct.pack("<I", len(key_bytes)) + key_bytes)
        h.update(bytes(header[:_MAC_OFFSET]) + _NO_MAC + bytes(header[_FIXED.size :]))
        h.update(payload)
        return h.digest()

    def encode(self, kv: torch.Tensor, num_tokens: int, key: str) -> bytes:
        """:func:`encode` for the record stored under ``key``, signed."""
        return encode(kv, num_tokens, self.layout, model_id=self.model_id, key=key, signer=self)

    def verify(self, key: str, data: bytes | bytearray | memoryview) -> RecordHeader:
        """Check a record read under ``key``: its header, then that it names this model, layout and the key's
        block hash, then its MAC. Raises RecordError; does not recompute the xxh3 (the MAC covers the payload)."""
        header = read_header(data)
        check_layout(header, self.layout)
        if header.model_id != self.model_id or header.token_hash != hash_of_key(key):
            raise RecordError(
                RecordFault.IDENTITY,
                f"record of model {header.model_id!r}, block {header.token_hash:016x} read under {key}",
            )
        view = memoryview(data)
        expected = self.mac(key, view[: header.payload_offset], view[header.payload_offset :])
        if not hmac.compare_digest(expected, header.mac):
            raise RecordError(RecordFault.MAC, "the MAC does not match (another secret, key or content)")
        return header


def _payload_offset(ndim: int, strings_nbytes: int) -> int:
    header_nbytes = _FIXED.size + 8 * ndim + strings_nbytes
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


def encode(
    kv: torch.Tensor,
    num_tokens: int,
    layout: str,
    *,
    model_id: str = "",
    key: str | None = None,
    signer: RecordSigner | None = None,
) -> bytes:
    """Serialize one chunk's KV into a record.

    Args:
        kv: ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]`` in bfloat16, float16 or float32, on any
            device (it is copied to CPU if needed).
        num_tokens: tokens in the chunk; must equal ``kv.shape[2]``.
        layout: the layout string from ``keys.kv_layout``; a reader with another layout gets a RecordError.
        model_id: the model whose KV this is (``ModelSource.model_id``), written into the header.
        key: the ``keys.cache_key`` the record is stored under; its block hash goes into the header.
        signer: signs the record (with ``key``, which it then requires); None leaves the MAC zero.

    Returns the record; one copy of the payload is made (into the returned bytes).
    Raises ValueError for an unsupported dtype, a malformed shape or an over-long string (a caller's bug).
    """
    shape = tuple(kv.shape)
    layout_bytes, model_bytes = _checked_fields(shape, kv.dtype, num_tokens, layout, model_id, key, signer)
    payload = _byte_view(kv)
    header = _header(shape, kv.dtype, num_tokens, layout_bytes, model_bytes, payload, key, signer)
    return b"".join((header, payload))


def encode_into(
    buffer: bytearray,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    fill: Callable[[torch.Tensor], None],
    layout: str,
    *,
    model_id: str = "",
    key: str | None = None,
    signer: RecordSigner | None = None,
) -> memoryview:
    """Write a record into ``buffer`` (at least :func:`record_nbytes` long) without a copy of the KV: ``fill``
    writes the KV into the payload's place, a ``shape`` tensor of ``dtype`` over the buffer, then the header
    (checksum, MAC) goes before it. Returns the record: a view of the buffer's start, valid until the buffer is
    written again. For a sender that reuses one buffer, or a store that keeps each record in a buffer of its
    own. The same arguments and errors as :func:`encode`."""
    num_tokens = shape[TOKEN_DIM] if len(shape) > TOKEN_DIM else 0
    layout_bytes, model_bytes = _checked_fields(shape, dtype, num_tokens, layout, model_id, key, signer)
    offset = _payload_offset(len(shape), len(layout_bytes) + len(model_bytes))
    nbytes = math.prod(shape) * dtype.itemsize
    if len(buffer) < offset + nbytes:
        raise ValueError(f"a buffer of {len(buffer)} bytes cannot hold a record of {offset + nbytes}")
    view = memoryview(buffer)
    tensor = torch.frombuffer(buffer, dtype=dtype, count=math.prod(shape), offset=offset).view(shape)
    fill(tensor)
    del tensor
    payload = view[offset : offset + nbytes]
    view[:offset] = _header(shape, dtype, num_tokens, layout_bytes, model_bytes, payload, key, signer)
    return view[: offset + nbytes]


def record_nbytes(shape: tuple[int, ...], dtype: torch.dtype, layout: str, model_id: str = "") -> int:
    """The size of the record :func:`encode` or :func:`encode_into` writes for KV of ``shape`` and ``dtype``."""
    strings_nbytes = len(layout.encode()) + len(model_id.encode())
    return _payload_offset(len(shape), strings_nbytes) + math.prod(shape) * dtype.itemsize


def _checked_fields(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    num_tokens: int,
    layout: str,
    model_id: str,
    key: str | None,
    signer: RecordSigner | None,
) -> tuple[bytes, bytes]:
    """The layout and model id as bytes, once the record's fields are known to be writable (ValueError)."""
    if dtype not in DTYPE_CODES:
        raise ValueError(f"unsupported KV dtype {dtype}; supported: {sorted(str(d) for d in DTYPE_CODES)}")
    if (problem := _check_kv_shape(shape, num_tokens)) is not None:
        raise ValueError(problem)
    layout_bytes, model_bytes = layout.encode(), model_id.encode()
    if max(len(layout_bytes), len(model_bytes)) > _MAX_STRING_BYTES:
        raise ValueError(f"layout or model id over {_MAX_STRING_BYTES} bytes")
    if signer is not None and key is None:
        raise ValueError("a signed record needs the key it is stored under")
    return layout_bytes, model_bytes


def _header(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    num_tokens: int,
    layout_bytes: bytes,
    model_bytes: bytes,
    payload: memoryview,
    key: str | None,
    signer: RecordSigner | None,
) -> bytearray:
    """The header (padded to the payload's offset) of a record with this payload."""
    token_hash = hash_of_key(key) if key is not None else 0
    fixed = _FIXED.pack(
        MAGIC, FORMAT_VERSION, DTYPE_CODES[dtype], len(shape), num_tokens, len(layout_bytes), len(model_bytes),
        len(payload), xxhash.xxh3_64_intdigest(payload), token_hash, _NO_MAC,
    )  # fmt: skip
    offset = _payload_offset(len(shape), len(layout_bytes) + len(model_bytes))
    header = bytearray(b"".join((fixed, struct.pack(f"<{len(shape)}Q", *shape), layout_bytes, model_bytes)))
    header += bytes(offset - len(header))
    if signer is not None:
        assert key is not None
        header[_MAC_OFFSET : _FIXED.size] = signer.mac(key, header, payload)
    return header


def _byte_view(kv: torch.Tensor) -> memoryview:
    """The tensor's bytes in C order, without a copy when it is already a contiguous CPU tensor."""
    flat_bytes = kv.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # [numel * itemsize]
    return memoryview(flat_bytes.numpy())  # type: ignore[arg-type]  # ndarray implements the buffer protocol


def read_header(data: bytes | bytearray | memoryview) -> RecordHeader:
    """Parse and sanity-check a record's header (not the payload checksum). Raises RecordError."""
    if len(data) < _FIXED.size:
        raise RecordError(RecordFault.TRUNCATED, f"{len(data)} bytes is shorter than the fixed header")
    fields = _FIXED.unpack_from(data)
    magic, version, dtype_code, ndim, num_tokens, layout_nbytes, model_nbytes, payload_nbytes = fields[:8]
    checksum, token_hash, mac = fields[8:]
    if magic != MAGIC:
        raise RecordError(RecordFault.MAGIC, f"magic {magic!r} != {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise RecordError(RecordFault.VERSION, f"format version {version} != {FORMAT_VERSION}")
    if (dtype := _DTYPES_BY_CODE.get(dtype_code)) is None:
        raise RecordError(RecordFault.DTYPE, f"unknown dtype code {dtype_code}")
    offset = _payload_offset(ndim, layout_nbytes + model_nbytes)
    if len(data) < offset:
        raise RecordError(RecordFault.TRUNCATED, f"{len(data)} bytes is shorter than the {offset}-byte header")
    shape = struct.unpack_from(f"<{ndim}Q", data, _FIXED.size)
    layout = _decode_string(data, _FIXED.size + 8 * ndim, layout_nbytes)
    model_id = _decode_string(data, _FIXED.size + 8 * ndim + layout_nbytes, model_nbytes)
    if (problem := _check_kv_shape(shape, num_tokens)) is not None:
        raise RecordError(RecordFault.SHAPE, problem)
    if payload_nbytes != math.prod(shape) * dtype.itemsize:
        raise RecordError(RecordFault.SHAPE, f"payload of {payload_nbytes} bytes does not match {list(shape)} {dtype}")
    if len(data) != offset + payload_nbytes:
        raise RecordError(RecordFault.TRUNCATED, f"record is {len(data)} bytes, header says {offset + payload_nbytes}")
    return RecordHeader(
        dtype, shape, num_tokens, layout, model_id, token_hash, checksum, bytes(mac), offset, payload_nbytes
    )


def _decode_string(data: bytes | bytearray | memoryview, start: int, nbytes: int) -> str:
    try:
        return bytes(data[start : start + nbytes]).decode()
    except UnicodeDecodeError as exc:
        raise RecordError(RecordFault.LAYOUT, "a header string is not utf-8") from exc


def check_layout(header: RecordHeader, expected_layout: str) -> RecordHeader:
    """``header``, unless its layout is not ``expected_layout`` (a RecordError)."""
    if header.layout != expected_layout:
        raise RecordError(RecordFault.LAYOUT, f"layout {header.layout!r} != expected {expected_layout!r}")
    return header


FIXED_HEADER_BYTES = _FIXED.size


def payload_offset(fixed_header: bytes | bytearray | memoryview) -> int:
    """Where the payload starts, from a record's first ``FIXED_HEADER_BYTES`` (to checksum while receiving)."""
    magic, version, _, ndim, _, layout_nbytes, model_nbytes, *_ = _FIXED.unpack_from(fixed_header)
    if magic != MAGIC:
        raise RecordError(RecordFault.MAGIC, f"magic {magic!r} != {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise RecordError(RecordFault.VERSION, f"format version {version} != {FORMAT_VERSION}")
    return _payload_offset(ndim, layout_nbytes + model_nbytes)


def verify_with_checksum(data: bytes | bytearray | memoryview, expected_layout: str, checksum: int) -> RecordHeader:
    """:func:`verify`, given the payload's xxh3 already computed (e.g. while it arrived)."""
    header = read_header(data)
    check_layout(header, expected_layout)
    if checksum != header.checksum:
        raise RecordError(RecordFault.CHECKSUM, f"payload xxh3 {checksum:016x} != header {header.checksum:016x}")
    return header


def verify(data: bytes | bytearray | memoryview, expected_layout: str) -> RecordHeader:
    """Check a record completely (header, layout and payload checksum) without building a tensor.

    Returns the header; raises RecordError. Not a MAC check: see :meth:`RecordSigner.verify` for that.
    """
    payload = memoryview(data)[read_header(data).payload_offset :]
    return verify_with_checksum(data, expected_layout, xxhash.xxh3_64_intdigest(payload))


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
        verify_checksum: skip the payload checksum only when the caller already checked the payload (its xxh3,
            or its MAC), or wrote it itself.

    Returns a CPU tensor ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]`` that is a zero-copy view of
    ``data``: it must not be written to, and ``data`` must outlive it (copy it into the KV cache).
    Raises RecordError for any bad magic, version, dtype, shape, layout, length or checksum.
    """
    header = verify(data, expected_layout) if verify_checksum else check_layout(read_header(data), expected_layout)
    if expected_shape is not None and tuple(expected_shape) != header.shape:
        raise RecordError(RecordFault.SHAPE, f"shape {list(header.shape)} != expected {list(expected_shape)}")
    if expected_dtype is not None and expected_dtype != header.dtype:
        raise RecordError(RecordFault.DTYPE, f"dtype {header.dtype} != expected {expected_dtype}")
    numel = math.prod(header.shape)
    flat = torch.frombuffer(data, dtype=header.dtype, count=numel, offset=header.payload_offset)
    return flat.view(header.shape)

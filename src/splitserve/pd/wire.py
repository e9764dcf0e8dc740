"""Framing for the KV transfer socket: length-prefixed JSON control messages, then raw payload bytes.

One connection carries one transfer: the sender asks to reserve ``nbytes`` (a :class:`Reserve`), the
receiver answers with a :class:`Reply` (``ok``, or why not: ``full`` is worth retrying); on yes the sender writes
the payload (a ``kvcache.serde`` record: header, checksum, KV bytes), then, with a cluster secret, a
:class:`Trailer` with the payload's MAC, and the receiver answers once it is verified and stored. Each message
is a dataclass here, and parsing one that is malformed is a ``WireError``: the only exception a peer's bytes
can cause.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from splitserve.errors import SplitserveError

MAX_CONTROL_BYTES = 64 * 1024
_LEN = struct.Struct("<I")


class PayloadMac:
    """The MAC a signed push's trailer carries: AES-256-GMAC over the payload as it goes by, under a key of this
    push's own (HMAC-SHA256 of the push's signed header MAC, keyed by a key derived from the cluster secret), so
    no two pushes share a key and the fixed nonce is never reused under one.

    GMAC runs on AES-NI and carry-less multiplication: 7 to 10 GB/s on one AMX-class core, where keyed BLAKE3
    does 4 GB/s and SHA-256 1.2 (``benchmarks/kv_push_signing.py`` and ``docs/benchmarks.md``).
    """

    def __init__(self, secret: str, header_mac: str) -> None:
        root = hashlib.sha256(b"splitserve kv push\0" + secret.encode()).digest()
        key = hmac.new(root, header_mac.encode(), hashlib.sha256).digest()
        self._gmac = Cipher(algorithms.AES(key), modes.GCM(bytes(12))).encryptor()

    def update(self, piece: bytes | memoryview) -> None:
        self._gmac.authenticate_additional_data(piece)

    def hexdigest(self) -> str:
        """The tag (hex) over every piece given; call once, at the end."""
        self._gmac.finalize()
        return self._gmac.tag.hex()


def payload_mac(secret: str, header_mac: str) -> PayloadMac:
    """A :class:`PayloadMac` for the push whose signed header carries ``header_mac``."""
    return PayloadMac(secret, header_mac)


class WireError(SplitserveError, ConnectionError):
    """The peer closed early or sent something malformed."""


@dataclass(frozen=True, slots=True)
class Reserve:
    """The sender's request: room for ``nbytes`` of one prompt's KV. Signed pushes add ``ts`` and ``mac``."""

    transfer_id: str
    nbytes: int
    num_tokens: int
    tokens_hash: int
    layout: str
    ts: float | None = None  # with a cluster secret: when it was signed (a stale one is refused)
    mac: str | None = None  # with a cluster secret: auth.sign over the other fields

    def as_wire(self) -> dict[str, Any]:
        """The message as sent (what ``auth.sign`` signs, without ``mac``)."""
        message: dict[str, Any] = {"op": "reserve", "transfer_id": self.transfer_id, "nbytes": self.nbytes,
                                   "num_tokens": self.num_tokens, "tokens_hash": self.tokens_hash,
                                   "layout": self.layout}  # fmt: skip
        if self.ts is not None:
            message["ts"] = self.ts
        if self.mac is not None:
            message["mac"] = self.mac
        return message

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> Reserve:
        ts, mac = message.get("ts"), message.get("mac")
        if message.get("op", "reserve") != "reserve":  # the connection's first message: nothing else comes first
            raise WireError(f"expected a reserve request, got op {message.get('op')!r}")
        return cls(
            transfer_id=_field(message, "transfer_id", str),
            nbytes=_field(message, "nbytes", int),
            num_tokens=_field(message, "num_tokens", int),
            tokens_hash=_field(message, "tokens_hash", int),
            layout=_field(message, "layout", str),
            ts=float(ts) if isinstance(ts, int | float) and not isinstance(ts, bool) else None,
            mac=mac if isinstance(mac, str) else None,
        )


@dataclass(frozen=True, slots=True)
class Reply:
    """The receiver's answer to a request, and to a payload: ``ok``, or the reason it is not."""

    ok: bool
    reason: str = ""

    def as_wire(self) -> dict[str, Any]:
        return {"ok": self.ok} if self.ok and not self.reason else {"ok": self.ok, "reason": self.reason}

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> Reply:
        ok = message.get("ok")
        if not isinstance(ok, bool):
            raise WireError("a reply without ok")
        return cls(ok, str(message.get("reason") or ("" if ok else "refused")))


@dataclass(frozen=True, slots=True)
class Trailer:
    """After a signed payload: its MAC (``PayloadMac``), which the receiver checks before storing it."""

    mac: str

    def as_wire(self) -> dict[str, Any]:
        return {"mac": self.mac}

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> Trailer:
        return cls(_field(message, "mac", str))


def _field(message: dict[str, Any], name: str, kind: type) -> Any:
    value = message.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise WireError(f"{name} must be a {kind.__name__}, got {value!r}")
    return value


def send_msg(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_msg(sock: socket.socket, deadline: float | None = None) -> dict[str, Any]:
    """One control message; ``WireError`` when malformed, or not whole by ``deadline`` (``time.monotonic``)."""
    (length,) = _LEN.unpack(recv_exact(sock, _LEN.size, deadline))
    if length > MAX_CONTROL_BYTES:
        raise WireError(f"control message of {length} bytes")
    try:
        message = json.loads(recv_exact(sock, length, deadline))
    except ValueError as exc:
        raise WireError(f"control message is not JSON: {exc}") from exc
    if not isinstance(message, dict):
        raise WireError("control message is not an object")
    return message


def recv_exact(sock: socket.socket, num_bytes: int, deadline: float | None = None) -> bytes:
    buffer = bytearray(num_bytes)

    def in_time(_: memoryview) -> None:
        if deadline is not None and time.monotonic() > deadline:
            raise WireError("the peer is too slow")

    recv_exact_into(sock, memoryview(buffer), in_time)
    return bytes(buffer)


def recv_exact_into(
    sock: socket.socket, view: memoryview, on_chunk: Callable[[memoryview], object] | None = None
) -> None:
    """Fill ``view`` from the socket (no intermediate copies), handing each received piece to ``on_chunk``
    (a running checksum, say); ``WireError`` if the peer closes first."""
    received = 0
    while received < len(view):
        n = sock.recv_into(view[received:])
        if n == 0:
            raise WireError(f"connection closed after {received} of {len(view)} bytes")
        if on_chunk is not None:
            on_chunk(view[received : received + n])
        received += n


def parse_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)

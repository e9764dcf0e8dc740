"""Framing for the KV transfer socket: length-prefixed JSON control messages, then raw payload bytes.

One connection carries one transfer: the sender asks to reserve ``nbytes`` (``{"op": "reserve", ...}``), the
receiver answers ``{"ok": true}`` or ``{"ok": false, "reason": "full"}``; on yes the sender writes the payload
(a ``kvcache.serde`` record: header, checksum, KV bytes) and the receiver answers once it is verified and stored.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import struct
import time
from collections.abc import Callable
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

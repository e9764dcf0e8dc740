"""Framing for the KV transfer socket: length-prefixed JSON control messages, then raw payload bytes.

One connection carries one transfer: the sender asks to reserve ``nbytes`` (``{"op": "reserve", ...}``), the
receiver answers ``{"ok": true}`` or ``{"ok": false, "reason": "full"}``; on yes the sender writes the payload
(a ``kvcache.serde`` record: header, checksum, KV bytes) and the receiver answers once it is verified and stored.
"""

from __future__ import annotations

import hashlib
import json
import socket
import struct
from collections.abc import Callable
from typing import Any

MAX_CONTROL_BYTES = 64 * 1024
_LEN = struct.Struct("<I")


def payload_digest(data: bytes | memoryview) -> str:
    """What a signed push names its payload by: BLAKE2b-256, hex (``digester`` for the incremental form)."""
    hasher = digester()
    hasher.update(data)
    return hasher.hexdigest()


def digester() -> hashlib.blake2b:
    return hashlib.blake2b(digest_size=32)


class WireError(ConnectionError):
    """The peer closed early or sent something malformed."""


def send_msg(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_msg(sock: socket.socket) -> dict[str, Any]:
    (length,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if length > MAX_CONTROL_BYTES:
        raise WireError(f"control message of {length} bytes")
    try:
        message = json.loads(recv_exact(sock, length))
    except ValueError as exc:
        raise WireError(f"control message is not JSON: {exc}") from exc
    if not isinstance(message, dict):
        raise WireError("control message is not an object")
    return message


def recv_exact(sock: socket.socket, num_bytes: int) -> bytes:
    buffer = bytearray(num_bytes)
    recv_exact_into(sock, memoryview(buffer))
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

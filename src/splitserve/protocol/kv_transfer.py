"""What a request carries for disaggregated prefill/decode: the API's ``kv_transfer_params``.

The router sets them (``splitserve.router.disagg``); the engine's PD connectors act on them
(``splitserve.pd``). On the prefill worker, ``decode_kv_addr`` names the decode worker's KV receiver: once the
prompt is computed its KV is pushed there under ``transfer_id``. On the decode worker, ``decode_kv_addr`` is
absent: admission takes the KV stored under ``transfer_id`` from the PD buffer (or recomputes), and
``first_token_id``, the token prefill sampled, is forced as the first output token so that both workers agree
on it; with ``skip_first_token`` its text is not streamed (the router already sent it to the client).

The prefill worker answers with its push's outcome in the answer's ``kv_transfer_params``
(:class:`KVTransferReport`), which the router reads to count the transfer and learn its cost.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_TRANSFER_ID_CHARS = 128


@dataclass(frozen=True, slots=True)
class KVTransferParams:
    transfer_id: str
    decode_kv_addr: str | None = None  # "host:port"; set on the prefill side only
    first_token_id: int | None = None  # decode side: force this first output token
    skip_first_token: bool = False  # decode side: do not stream the forced token's text

    @property
    def is_sender(self) -> bool:
        return self.decode_kv_addr is not None

    def as_api(self) -> dict[str, Any]:
        """The API field: the prefill side's address, or the decode side's forced first token."""
        if self.is_sender:
            return {"transfer_id": self.transfer_id, "decode_kv_addr": self.decode_kv_addr}
        return {
            "transfer_id": self.transfer_id,
            "first_token_id": self.first_token_id,
            "skip_first_token": self.skip_first_token,
        }

    @classmethod
    def from_api(cls, value: Mapping[str, Any]) -> KVTransferParams:
        """Parse the API field; raises ``ValueError`` naming the first bad key."""
        transfer_id = value.get("transfer_id", value.get("request_id"))
        if not isinstance(transfer_id, str) or not 0 < len(transfer_id) <= MAX_TRANSFER_ID_CHARS:
            raise ValueError(f"kv_transfer_params.transfer_id must be a string of 1 to {MAX_TRANSFER_ID_CHARS} chars")
        addr = value.get("decode_kv_addr")
        if addr is not None:
            host, _, port = str(addr).rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"kv_transfer_params.decode_kv_addr must be host:port, got {addr!r}")
        first = value.get("first_token_id")
        if first is not None and (type(first) is not int or first < 0):
            raise ValueError(f"kv_transfer_params.first_token_id must be a token id, got {first!r}")
        skip = value.get("skip_first_token", False)
        if not isinstance(skip, bool):
            raise ValueError("kv_transfer_params.skip_first_token must be a boolean")
        return cls(transfer_id, addr, first, skip and first is not None)


@dataclass(frozen=True, slots=True)
class KVTransferResult:
    """What the prefill worker reports back about one push."""

    transfer_id: str
    ok: bool
    num_tokens: int = 0
    num_bytes: int = 0
    elapsed_s: float = 0.0
    reason: str = ""

    def report(self, first_token_id: int | None) -> KVTransferReport:
        return KVTransferReport(
            ok=self.ok,
            transfer_id=self.transfer_id,
            num_tokens=self.num_tokens,
            num_bytes=self.num_bytes,
            transfer_ms=round(self.elapsed_s * 1000, 3),
            reason=self.reason,
            first_token_id=first_token_id,
        )


@dataclass(frozen=True, slots=True)
class KVTransferReport:
    """The prefill worker's ``kv_transfer_params`` in its answer: the push's outcome, its cost, the first token.

    ``transfer_ms`` is None when the push's time is unknown (the sender never reported)."""

    ok: bool
    transfer_id: str | None = None
    num_tokens: int = 0
    num_bytes: int = 0
    transfer_ms: float | None = None
    reason: str = ""
    first_token_id: int | None = None

    def as_api(self) -> dict[str, Any]:
        report: dict[str, Any] = {"ok": self.ok, "reason": self.reason, "first_token_id": self.first_token_id}
        if self.transfer_id is not None:
            report |= {"transfer_id": self.transfer_id, "num_tokens": self.num_tokens, "num_bytes": self.num_bytes}
        if self.transfer_ms is not None:
            report["transfer_ms"] = self.transfer_ms
        return report

    @classmethod
    def from_api(cls, value: object) -> KVTransferReport:
        """Read a worker's report leniently: what is missing or mistyped counts as unknown (not ok, no time)."""
        if not isinstance(value, Mapping):
            return cls(ok=False, reason="no kv_transfer_params in the prefill answer")

        def typed(key: str, kind: type | tuple[type, ...], default: Any) -> Any:
            found = value.get(key, default)
            return found if isinstance(found, kind) and not isinstance(found, bool) else default

        first = value.get("first_token_id")
        return cls(
            ok=value.get("ok") is True,
            transfer_id=typed("transfer_id", str, None),
            num_tokens=typed("num_tokens", int, 0),
            num_bytes=typed("num_bytes", int, 0),
            transfer_ms=typed("transfer_ms", (int, float), None),
            reason=str(value.get("reason") or ""),
            first_token_id=first if type(first) is int else None,
        )

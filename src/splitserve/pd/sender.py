"""The prefill side: push a computed prompt's KV to the decode worker's receiver, reserving room first.

:class:`PDSenderConnector` implements ``KVConnectorBase``: when a request carrying ``kv_transfer_params`` with a
``decode_kv_addr`` has computed its whole prompt, it copies the prompt's KV out of the paged cache (on the
engine thread, one ``index_select``) and hands it to a sender thread, which encodes the record and pushes it
(:func:`push`); the push's future, handed to the engine as the request ends (``take_transfer_result``), says
how that went. A full buffer is retried with back-off until ``deadline_s``; then the push gives up and the
decode worker will recompute.
"""

from __future__ import annotations

import logging
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import torch

from splitserve.auth import sign
from splitserve.engine.connector import KVLoad, LoadedTokens, token_slots
from splitserve.engine.request import Request
from splitserve.keys import hash_tokens
from splitserve.kvcache import serde
from splitserve.pd.wire import Reply, Reserve, Trailer, WireError, parse_addr, payload_mac, recv_msg, send_msg
from splitserve.protocol.kv_transfer import KVTransferResult

logger = logging.getLogger(__name__)

DEFAULT_DEADLINE_S = 10.0
CONNECT_TIMEOUT_S = 2.0
IO_TIMEOUT_S = 30.0
FIRST_BACKOFF_S = 0.02
MAX_BACKOFF_S = 0.5


def push(
    addr: str,
    transfer_id: str,
    record: bytes | memoryview,
    num_tokens: int,
    tokens_hash: int,
    layout: str,
    deadline_s: float = DEFAULT_DEADLINE_S,
    secret: str | None = None,
) -> KVTransferResult:
    """Reserve ``len(record)`` bytes at the receiver ``addr`` and send ``record``; retried while it is full or
    unreachable, up to ``deadline_s``. Never raises: the result says whether the KV arrived, and why not.

    With the cluster ``secret``, the reservation request carries a MAC (a receiver with the same secret
    reserves nothing without it), and the payload is followed by a trailer with its keyed MAC, computed while
    the bytes go out (``wire.payload_mac``)."""
    began = time.perf_counter()
    request = Reserve(transfer_id, len(record), num_tokens, tokens_hash, layout)
    backoff_s, num_full = FIRST_BACKOFF_S, 0
    reason = ""
    while True:
        header = request
        if secret is not None:  # signed afresh for each attempt: the receiver takes a signed request once
            stamped = replace(request, ts=time.time())
            header = replace(stamped, mac=sign(secret, stamped.as_wire()))
        try:
            with socket.create_connection(parse_addr(addr), timeout=CONNECT_TIMEOUT_S) as sock:
                sock.settimeout(IO_TIMEOUT_S)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                send_msg(sock, header.as_wire())
                reply = Reply.from_wire(recv_msg(sock))
                if reply.ok:
                    if secret is None or header.mac is None:
                        sock.sendall(record)
                    else:
                        send_signed(sock, record, header.mac, secret)
                    done = Reply.from_wire(recv_msg(sock))
                    elapsed_s = time.perf_counter() - began
                    if done.ok:
                        return KVTransferResult(transfer_id, True, num_tokens, len(record), elapsed_s)
                    return KVTransferResult(transfer_id, False, 0, 0, elapsed_s, done.reason)
                reason = reply.reason
                if reason != "full":
                    return KVTransferResult(transfer_id, False, 0, 0, time.perf_counter() - began, reason)
                num_full += 1
        except (OSError, WireError, ValueError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        if time.perf_counter() - began + backoff_s > deadline_s:
            what = f"the PD buffer stayed full ({num_full} tries)" if reason == "full" else reason
            return KVTransferResult(transfer_id, False, 0, 0, time.perf_counter() - began, f"gave up: {what}")
        time.sleep(backoff_s)
        backoff_s = min(backoff_s * 2, MAX_BACKOFF_S)


SIGNED_PIECE_BYTES = 1 << 20


def send_signed(sock: socket.socket, record: bytes | memoryview, header_mac: str, secret: str) -> None:
    """Send ``record``, MAC-ing it piece by piece as it goes, then the trailer carrying that MAC."""
    mac = payload_mac(secret, header_mac)
    view = memoryview(record)
    for start in range(0, len(view), SIGNED_PIECE_BYTES):
        piece = view[start : start + SIGNED_PIECE_BYTES]
        sock.sendall(piece)
        mac.update(piece)
    send_msg(sock, Trailer(mac.hexdigest()).as_wire())


class PDSenderConnector:
    """``KVConnectorBase`` for the prefill role: sends each transfer request's prompt KV once it is computed."""

    def __init__(
        self,
        layout: str,
        *,
        deadline_s: float = DEFAULT_DEADLINE_S,
        num_threads: int = 2,
        secret: str | None = None,
        model_id: str = "",
    ) -> None:
        self.layout = layout
        self.model_id = model_id  # written into every pushed record: the decode worker checks it
        self.deadline_s = deadline_s
        self.secret = secret  # signs every push (the cluster secret)
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="kv-sender")
        self._kv_cache: torch.Tensor | None = None
        self._block_size = 0
        self._pushes: dict[str, Future[KVTransferResult]] = {}  # request id -> its push, until the request ends

    def register_kv_cache(self, kv_cache: torch.Tensor, block_size: int) -> None:
        self._kv_cache = kv_cache
        self._block_size = block_size

    def num_external_tokens(self, request: Request, num_cached: int) -> int:
        return 0

    def lookup_tokens(self, request: Request, num_cached: int) -> tuple[tuple[str, int], ...]:
        return ()

    def update_state_after_alloc(self, request: Request, num_cached: int, num_external: int) -> None:
        pass

    def load_kv(self, load: KVLoad) -> LoadedTokens:
        return LoadedTokens()  # never a source: it offers no tokens

    def save_completed_chunks(self, request: Request, block_ids: list[int]) -> None:
        params = request.params.kv_transfer
        if (
            params is None
            or not params.is_sender
            or request.request_id in self._pushes
            or request.num_computed_tokens < request.num_prompt_tokens
            or self._kv_cache is None
        ):
            return
        num_tokens = request.num_prompt_tokens
        slots = token_slots(block_ids, range(num_tokens), self._block_size)
        kv = self._kv_cache.index_select(2, torch.tensor(slots, device=self._kv_cache.device)).cpu()
        tokens_hash = hash_tokens(request.prompt_token_ids)
        assert params.decode_kv_addr is not None
        self._pushes[request.request_id] = self._pool.submit(
            self._encode_and_push, params.decode_kv_addr, params.transfer_id, kv, num_tokens, tokens_hash
        )

    def _encode_and_push(
        self, addr: str, transfer_id: str, kv: torch.Tensor, num_tokens: int, tokens_hash: int
    ) -> KVTransferResult:
        record = serde.encode(kv, num_tokens, self.layout, model_id=self.model_id)
        result = push(addr, transfer_id, record, num_tokens, tokens_hash, self.layout, self.deadline_s, self.secret)
        if result.ok:
            logger.info(
                "KV transfer %s: %d tokens, %.1f MB to %s in %.1f ms (%.2f GB/s)",
                transfer_id, num_tokens, len(record) / 1e6, addr, result.elapsed_s * 1000,
                len(record) / max(result.elapsed_s, 1e-9) / 1e9,
            )  # fmt: skip
        else:
            logger.warning("KV transfer %s to %s failed: %s", transfer_id, addr, result.reason)
        return result

    def take_transfer_result(self, request_id: str) -> Future[KVTransferResult] | None:
        return self._pushes.pop(request_id, None)

    def request_finished(self, request: Request) -> None:
        self._pushes.pop(request.request_id, None)  # aborted: nobody waits for the push

    def stats(self) -> None:
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)

"""The decode side: a TCP receiver that fills the PD buffer, and the engine connector that loads from it.

:class:`KVReceiver` serves ``--kv-transfer-port``: one connection per transfer (see ``wire``). A reservation
that does not fit is refused (logged as ``Failed to allocate memory object, retrying...``: the sender retries);
a payload that fails its checksum or has another layout is dropped. No peer can hold the receiver: at most
``MAX_CONNECTIONS`` transfers at once (``MAX_PEER_CONNECTIONS`` from one address); beside its first transfer in
flight, which may take the whole buffer, a peer's reservations still being filled may hold at most
``PEER_RESERVATION_SHARE`` of it; and a transfer must be whole within ``TRANSFER_DEADLINE_S`` of its
connection (besides ``RECEIVE_TIMEOUT_S`` between two pieces), else it is dropped and its room freed.

With the cluster secret, a push must be signed (``auth.sign``): its reservation request carries a MAC and a
time stamp within ``MAX_CLOCK_SKEW_S`` of now, and is taken once (a replay is refused), else it gets no room;
its payload is followed by a trailer with a keyed MAC over the request's MAC and the payload
(``wire.payload_mac``), which the receiver computes as the bytes arrive, else the record is dropped.

:class:`PDReceiverConnector` implements ``KVConnectorBase``. It offers a request whose ``kv_transfer_params`` name
a transfer the KV waiting in the buffer, once it has checked that the record belongs to the request's own
prompt tokens, the model and the engine's layout, and that it decodes to the engine's shape. At admission it
claims the entry (it no longer expires); before the forward pass the model runner's ``load_kv`` copies it into
the request's blocks and releases it, and it logs
``Retrieved N out of N required tokens (from T total tokens). size: X gb, cost Y ms, throughput: Z GB/s``, or
``Retrieved 0 out of N ...`` when nothing usable arrived, and the engine computes the prompt itself.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import socket
import socketserver
import threading
import time

import torch
import xxhash

from splitserve.auth import verified
from splitserve.engine.connector import KVLoad, LoadedTokens, token_slots
from splitserve.engine.request import Request
from splitserve.keys import hash_tokens
from splitserve.kvcache import serde
from splitserve.pd.buffer import BufferEntry, PDBuffer
from splitserve.pd.wire import (
    PayloadMac,
    Reply,
    Reserve,
    Trailer,
    WireError,
    payload_mac,
    recv_exact_into,
    recv_msg,
    send_msg,
)

logger = logging.getLogger(__name__)

PD_SOURCE = "pd"
SOCKET_BUFFER_BYTES = 4 << 20
RECEIVE_TIMEOUT_S = 20.0
TRANSFER_DEADLINE_S = 60.0  # a whole transfer, however it trickles in
REQUEST_TIMEOUT_S = 5.0  # its reservation request, from the connection on
MAX_CONNECTIONS = 64
MAX_PEER_CONNECTIONS = 16
PEER_RESERVATION_SHARE = 0.5  # of the buffer, in reservations one address is still filling
MAX_SEEN_MACS = 4096  # signed requests remembered before the expired ones are swept out
MAX_CLOCK_SKEW_S = 120.0  # a signed push stamped further from now is refused (a replay, or a broken clock)
RECEIVER_NICE = 10  # receiving yields the CPU to the engine thread: decode latency first, transfer speed second


class KVReceiver:
    """A threaded TCP server storing pushed KV records in ``buffer``; ``layout`` is the engine's KV layout."""

    def __init__(
        self,
        buffer: PDBuffer,
        layout: str,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        secret: str | None = None,
    ) -> None:
        """``secret``: the cluster secret; with it, only signed pushes are taken."""
        self.buffer = buffer
        self.layout = layout
        self.secret = secret
        self.advertise_host = advertise_host
        self.max_connections, self.max_peer_connections = MAX_CONNECTIONS, MAX_PEER_CONNECTIONS
        self.transfer_deadline_s = TRANSFER_DEADLINE_S
        self._lock = threading.Lock()
        self._connections: dict[str, int] = {}  # peer address -> open connections
        self._filling: dict[str, int] = {}  # peer address -> bytes of its reservations being filled
        self._seen_macs: dict[str, float] = {}  # signed requests taken within the skew window -> when they expire
        receiver = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                receiver._serve(self.request)

        self._server = socketserver.ThreadingTCPServer((host, port), Handler, bind_and_activate=False)
        self._server.daemon_threads = True
        self._server.allow_reuse_address = True
        self._server.server_bind()
        self._server.server_activate()
        address = self._server.server_address
        self.host, self.port = str(address[0]), int(address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="kv-receiver", daemon=True)

    @property
    def addr(self) -> str:
        """Where senders connect: the advertised host, else the bound one (the host name for every interface)."""
        host = self.advertise_host or (socket.gethostname() if self.host in ("0.0.0.0", "::") else self.host)
        return f"{host}:{self.port}"

    def start(self) -> None:
        self._thread.start()
        logger.info("KV receiver listening on %s, PD buffer %.2f GiB", self.addr, self.buffer.capacity_bytes / 2**30)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _serve(self, sock: socket.socket) -> None:
        peer = _peer_of(sock)
        with self._lock:
            total = sum(self._connections.values())
            admitted = total < self.max_connections and self._connections.get(peer, 0) < self.max_peer_connections
            if admitted:
                self._connections[peer] = self._connections.get(peer, 0) + 1
        if not admitted:
            logger.warning("KV receiver: refused a connection from %s (too many transfers at once)", peer)
            return  # closing it: the sender's push fails, and decode computes the prompt itself
        try:
            self._transfer(sock, peer, time.monotonic() + self.transfer_deadline_s)
        finally:
            with self._lock:
                self._connections[peer] -= 1
                if not self._connections[peer]:
                    del self._connections[peer]

    def _transfer(self, sock: socket.socket, peer: str, deadline: float) -> None:
        _lower_thread_priority(RECEIVER_NICE)
        sock.settimeout(REQUEST_TIMEOUT_S)  # the request first, quickly: an idle peer holds a connection slot
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        try:
            raw = recv_msg(sock, min(deadline, time.monotonic() + REQUEST_TIMEOUT_S))
            sock.settimeout(RECEIVE_TIMEOUT_S)  # a sender that vanished must not hold its reservation forever
            header = Reserve.from_wire(raw)
            transfer_id, num_bytes, layout = header.transfer_id, header.nbytes, header.layout
        except (WireError, OSError) as exc:
            logger.warning("KV receiver: bad transfer request: %s", exc)
            return
        reserved = False
        try:
            room = self._reserve(sock, peer, raw, header)
            if room is None:
                return
            reserved = True  # from here on, this connection's reservation is the one to free on failure
            try:
                send_msg(sock, Reply(True).as_wire())
                mac = payload_mac(self.secret, header.mac or "") if self.secret is not None else None
                _receive_record(sock, room, layout, deadline, mac)
                if mac is not None:
                    _check_trailer(recv_msg(sock, deadline), mac.hexdigest())
            finally:
                with self._lock:
                    self._filling[peer] -= num_bytes
                    if not self._filling[peer]:
                        del self._filling[peer]
        except serde.RecordError as exc:
            self.buffer.abort(transfer_id)  # (raised only once this connection reserved)
            logger.warning("KV receiver: transfer %s dropped: %s", transfer_id, exc)
            send_msg(sock, Reply(False, f"invalid record: {exc}").as_wire())
            return
        except (WireError, OSError) as exc:
            if reserved:  # never another connection's reservation under the same id
                self.buffer.abort(transfer_id)
            logger.warning("KV receiver: transfer %s broke off: %s", transfer_id, exc)
            return
        ok = self.buffer.commit(transfer_id, header.num_tokens, header.tokens_hash, layout)
        send_msg(sock, Reply(ok, "" if ok else "reservation expired").as_wire())

    def _reserve(self, sock: socket.socket, peer: str, raw: dict[str, object], header: Reserve) -> memoryview | None:
        """Room for the push in the PD buffer, or None once the sender has been told why not (unsigned, another
        layout, too big, or no room: the peer's share is taken, or the buffer is full)."""
        transfer_id, num_bytes, layout = header.transfer_id, header.nbytes, header.layout
        refusal = self._refusal(raw, header)
        if refusal is not None:
            logger.warning("KV receiver: refused transfer %s from %s: %s", transfer_id, peer, refusal)
        elif layout != self.layout:
            refusal = f"layout {layout} is not this engine's {self.layout}"
        elif not 0 < num_bytes <= self.buffer.capacity_bytes:
            refusal = f"{num_bytes} bytes can never fit the PD buffer"
        if refusal is not None:
            send_msg(sock, Reply(False, refusal).as_wire())
            return None
        quota = int(self.buffer.capacity_bytes * PEER_RESERVATION_SHARE)
        with self._lock:
            held = self._filling.get(peer, 0)  # a peer's first transfer in flight may take the whole buffer
            if held and held + num_bytes > quota:
                room = None
                self.buffer.count_refusal()
            else:
                room = self.buffer.reserve(transfer_id, num_bytes)
            if room is not None:
                self._filling[peer] = held + num_bytes
                self._remember(header)
        if room is None:
            logger.info("Failed to allocate memory object, retrying... (transfer %s, %d bytes)", transfer_id, num_bytes)
            send_msg(sock, Reply(False, "full").as_wire())
        return room

    def _refusal(self, raw: dict[str, object], header: Reserve) -> str | None:
        """Why a push must not get a reservation (with a cluster secret: unsigned, forged or stale); None if fine.
        The MAC is checked over ``raw``, the request exactly as it arrived."""
        if self.secret is None:
            return None
        if not verified(self.secret, raw) or header.mac is None:
            return "unauthenticated: the push is not signed with this cluster's secret"
        now = time.time()
        if header.ts is None or abs(now - header.ts) > MAX_CLOCK_SKEW_S:
            return "unauthenticated: the push's time stamp is too far from now"
        with self._lock:  # a signed request is good once: a replay within the window is refused too
            if len(self._seen_macs) > MAX_SEEN_MACS:
                self._seen_macs = {mac: until for mac, until in self._seen_macs.items() if until > now}
            if self._seen_macs.get(header.mac, 0.0) > now:
                return "unauthenticated: the push replays one already taken"
        return None

    def _remember(self, header: Reserve) -> None:
        """A signed request that got room: the same bytes again, within the skew window, are a replay."""
        if self.secret is not None and header.mac is not None and header.ts is not None:  # checked by _refusal
            self._seen_macs[header.mac] = header.ts + MAX_CLOCK_SKEW_S


def _model_of(record: bytes | bytearray | memoryview) -> str | None:
    try:
        return serde.read_header(record).model_id
    except serde.RecordError:
        return None


def _check_trailer(message: dict[str, object], mac: str) -> None:
    """RecordError unless the message is a :class:`Trailer` carrying the MAC of the payload that arrived."""
    try:
        claimed = Trailer.from_wire(message).mac
    except WireError:
        claimed = ""
    if not hmac.compare_digest(claimed, mac):
        raise serde.RecordError(serde.RecordFault.CHECKSUM, "the payload is not the one the push signed")


def _lower_thread_priority(nice: int) -> None:
    """Raise this thread's nice value (Linux: per thread), so it takes the CPU only when the engine does not."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


def _peer_of(sock: socket.socket) -> str:
    try:
        return str(sock.getpeername()[0])
    except (OSError, IndexError):
        return "?"


def _receive_record(
    sock: socket.socket, room: memoryview, layout: str, deadline: float, mac: PayloadMac | None = None
) -> None:
    """Receive a record into ``room``, checksumming the payload as it arrives: ``mac`` (a signed push) takes
    every byte, else an xxh3 checks it against the header. RecordError if it is bad, WireError once
    ``deadline`` (monotonic) has passed."""

    def in_time(piece: memoryview) -> None:
        if time.monotonic() > deadline:
            raise WireError("the transfer missed its deadline")
        if mac is not None:
            mac.update(piece)

    fixed = serde.FIXED_HEADER_BYTES
    if len(room) < fixed:
        raise serde.RecordError(serde.RecordFault.TRUNCATED, f"{len(room)} bytes is shorter than a header")
    recv_exact_into(sock, room[:fixed], in_time)
    offset = serde.payload_offset(room[:fixed])
    if offset > len(room):
        raise serde.RecordError(serde.RecordFault.TRUNCATED, f"a {offset}-byte header in {len(room)} bytes")
    recv_exact_into(sock, room[fixed:offset], in_time)
    if mac is not None:  # the keyed MAC covers every byte: an xxh3 besides it would only cost time
        recv_exact_into(sock, room[offset:], in_time)
        serde.check_layout(serde.read_header(room), layout)
        return
    hasher = xxhash.xxh3_64()

    def checked(piece: memoryview) -> None:
        in_time(piece)
        hasher.update(piece)

    recv_exact_into(sock, room[offset:], checked)
    serde.verify_with_checksum(room, layout, hasher.intdigest())


class PDReceiverConnector:
    """``KVConnectorBase`` for the decode role: loads a request's transferred prompt KV from the PD buffer."""

    def __init__(self, buffer: PDBuffer, layout: str, model_id: str = "") -> None:
        self.buffer = buffer
        self.layout = layout
        self.model_id = model_id  # a record made by another model is refused, whatever its layout
        self._kv_cache: torch.Tensor | None = None
        self._block_size = 0
        self._claimed: dict[str, BufferEntry] = {}  # request id -> its entry, from admission to load_kv

    def register_kv_cache(self, kv_cache: torch.Tensor, block_size: int) -> None:
        self._kv_cache = kv_cache
        self._block_size = block_size

    def _usable(self, request: Request) -> BufferEntry | None:
        params = request.params.kv_transfer
        if params is None or params.is_sender:
            return None
        entry = self.buffer.peek(params.transfer_id)
        if entry is None:
            return None
        prompt = request.prompt_token_ids
        if (
            entry.layout != self.layout
            or (self.model_id and _model_of(entry.record) != self.model_id)
            or entry.num_tokens > len(prompt)
            or entry.tokens_hash != hash_tokens(prompt[: entry.num_tokens])
        ):
            logger.warning("PD: transfer %s does not match request %s's model, prompt or layout; recomputing",
                           params.transfer_id, request.request_id)  # fmt: skip
            self.buffer.release(params.transfer_id)
            return None
        try:  # offered only if the copy cannot fail on the record: it decodes to the engine's shape
            self._decode(entry)
        except serde.RecordError as exc:
            logger.warning("PD: transfer %s is unusable (%s); recomputing", params.transfer_id, exc)
            self.buffer.release(params.transfer_id)
            return None
        return entry

    def _decode(self, entry: BufferEntry) -> torch.Tensor:
        """The entry's KV ``[layers, 2, tokens, heads, dim]``, a view of the buffer (its checksum or MAC was
        verified when it arrived, and it has been in this process's memory since). RecordError unless it has
        the engine's layout and, once the cache is registered, its shape and dtype."""
        if self._kv_cache is None:
            return serde.decode(entry.record, self.layout, verify_checksum=False)
        num_layers, _, _, num_heads, head_dim = self._kv_cache.shape
        shape = (num_layers, 2, entry.num_tokens, num_heads, head_dim)
        return serde.decode(entry.record, self.layout, shape, self._kv_cache.dtype, verify_checksum=False)

    def num_external_tokens(self, request: Request, num_cached: int) -> int:
        entry = self._usable(request)
        if entry is None:
            return 0
        return max(0, min(entry.num_tokens, request.num_tokens - 1) - num_cached)

    def lookup_tokens(self, request: Request, num_cached: int) -> tuple[tuple[str, int], ...]:
        return ((PD_SOURCE, self.num_external_tokens(request, num_cached)),)

    def update_state_after_alloc(self, request: Request, num_cached: int, num_external: int) -> None:
        """Claim the transfer the request loads (an entry claimed no longer expires), or log that none is used."""
        params = request.params.kv_transfer
        if params is None or params.is_sender:
            return
        entry = self.buffer.claim(params.transfer_id) if num_external > 0 else None
        required = max(0, request.num_tokens - 1 - num_cached)
        if entry is None and required:  # (none required: another sequence of the request loaded it, now cached)
            logger.info("Retrieved 0 out of %d required tokens (from %d total tokens); recomputing",
                        required, request.num_prompt_tokens)  # fmt: skip
        if entry is None:
            return
        self._claimed[request.request_id] = entry

    def load_kv(self, load: KVLoad) -> LoadedTokens:
        request = load.request
        entry = self._claimed.pop(request.request_id, None)
        params = request.params.kv_transfer
        if entry is None or params is None:
            return LoadedTokens()
        assert self._kv_cache is not None
        began = time.perf_counter()
        device = self._kv_cache.device
        positions = range(load.start_token, load.end_token)
        slots = torch.tensor(token_slots(load.block_ids, positions, self._block_size), device=device)
        try:
            kv = self._decode(entry)
            with torch.no_grad():
                self._kv_cache.index_copy_(2, slots, kv[:, :, load.start_token : load.end_token].to(device))
        except (serde.RecordError, RuntimeError) as exc:  # a record that does not fit is a miss, never a dead engine
            logger.warning("PD: transfer %s is unusable (%s); recomputing", params.transfer_id, exc)
            return LoadedTokens()
        finally:
            self.buffer.release(params.transfer_id)
        required = max(0, request.num_tokens - 1 - load.start_token)
        self._log_retrieved(request, entry, load.num_tokens, required, time.perf_counter() - began)
        return LoadedTokens(load.num_tokens, ((PD_SOURCE, load.num_tokens),))

    @staticmethod
    def _log_retrieved(request: Request, entry: BufferEntry, num: int, required: int, elapsed_s: float) -> None:
        size_gb = len(entry.record) * num / max(entry.num_tokens, 1) / 1e9
        logger.info(
            "Retrieved %d out of %d required tokens (from %d total tokens). size: %.4f gb, cost %.2f ms, "
            "throughput: %.2f GB/s",
            num, required, request.num_prompt_tokens, size_gb, elapsed_s * 1000, size_gb / max(elapsed_s, 1e-9),
        )  # fmt: skip

    def save_completed_chunks(self, request: Request, block_ids: list[int]) -> None:
        pass

    def take_transfer_result(self, request_id: str) -> None:
        return None

    def request_finished(self, request: Request) -> None:
        self._claimed.pop(request.request_id, None)
        params = request.params.kv_transfer
        if params is not None and not params.is_sender:
            self.buffer.release(params.transfer_id)  # unclaimed (e.g. aborted before admission)

    def stats(self) -> None:
        return None

    def close(self) -> None:
        pass

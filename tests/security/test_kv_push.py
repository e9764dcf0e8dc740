"""The KV receiver against a peer without the cluster secret, over real sockets: an unauthenticated reservation gets no
room, a forged signature none either, and a signed request replayed byte for byte is refused although its signature and
time stamp are still good."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from splitserve.auth import sign
from splitserve.engine.request import Request
from splitserve.engine.sampling_params import SamplingParams
from splitserve.keys import hash_tokens
from splitserve.kvcache import serde
from splitserve.pd.buffer import PDBuffer
from splitserve.pd.receiver import KVReceiver, PDReceiverConnector
from splitserve.pd.sender import push
from splitserve.pd.wire import parse_addr, payload_mac, recv_msg, send_msg
from splitserve.protocol.kv_transfer import KVTransferParams

SECRET = "kv-push-secret"
LAYOUT = "float32-L2-H1-D8-B16"
RECORD = serde.encode(torch.ones(2, 2, 8, 1, 8), 8, LAYOUT)


@pytest.fixture
def receiver() -> Iterator[KVReceiver]:
    receiver = KVReceiver(PDBuffer(1 << 20), LAYOUT, secret=SECRET)
    receiver.start()
    yield receiver
    receiver.close()


def reserve(receiver: KVReceiver, header: dict[str, object]) -> tuple[socket.socket, dict[str, object]]:
    sock = socket.create_connection(parse_addr(receiver.addr), timeout=5)
    send_msg(sock, header)
    return sock, recv_msg(sock)


def request(transfer_id: str) -> dict[str, object]:
    return {"op": "reserve", "transfer_id": transfer_id, "nbytes": len(RECORD), "num_tokens": 8, "tokens_hash": 0,
            "layout": LAYOUT, "ts": time.time()}  # fmt: skip


def test_an_unsigned_or_forged_reservation_gets_no_room(receiver: KVReceiver) -> None:
    for header in (request("unsigned"), request("forged") | {"mac": sign("not-the-secret", request("forged"))}):
        sock, answer = reserve(receiver, header)
        sock.close()
        assert answer["ok"] is False and "unauthenticated" in str(answer["reason"])
    stale = request("stale") | {"ts": time.time() - 600}
    sock, answer = reserve(receiver, stale | {"mac": sign(SECRET, stale)})
    sock.close()
    assert answer["ok"] is False and "time stamp" in str(answer["reason"])
    assert receiver.buffer.stats().num_reservations == 0


def test_a_replayed_push_is_refused(receiver: KVReceiver) -> None:
    header = request("once")
    header["mac"] = sign(SECRET, header)
    sock, answer = reserve(receiver, header)
    assert answer["ok"] is True
    sock.sendall(RECORD)
    mac = payload_mac(SECRET, str(header["mac"]))
    mac.update(RECORD)
    send_msg(sock, {"mac": mac.hexdigest()})
    assert recv_msg(sock)["ok"] is True
    sock.close()
    assert receiver.buffer.claim("once") is not None
    receiver.buffer.release("once")
    replay, answer = reserve(receiver, header)  # the same signed bytes, seconds later
    replay.close()
    assert answer["ok"] is False and "replays" in str(answer["reason"])
    assert receiver.buffer.peek("once") is None


def test_kv_of_another_model_is_refused_before_any_copy() -> None:
    """Same layout, another model: the decode worker does not load it (the record names its model)."""
    buffer, tokens = PDBuffer(1 << 20), list(range(8))
    for model in ("model-a", "model-b"):
        record = serde.encode(torch.ones(2, 2, 8, 1, 8), 8, LAYOUT, model_id=model)
        room = buffer.reserve(f"xfer-{model}", len(record))
        assert room is not None
        room[:] = record
        assert buffer.commit(f"xfer-{model}", 8, hash_tokens(tokens), LAYOUT)
    receiver = PDReceiverConnector(buffer, LAYOUT, "model-a")

    def request(transfer_id: str) -> Request:
        params = SamplingParams(max_tokens=1, kv_transfer=KVTransferParams(transfer_id, first_token_id=1))
        return Request("r", [*tokens, 9], params, 0.0)

    assert receiver.num_external_tokens(request("xfer-model-a"), 0) == 8  # its own model's: taken
    assert receiver.num_external_tokens(request("xfer-model-b"), 0) == 0
    assert buffer.peek("xfer-model-b") is None  # dropped, its room freed


def test_a_signed_push_that_found_the_buffer_full_retries_and_arrives() -> None:
    receiver = KVReceiver(PDBuffer(len(RECORD)), LAYOUT, secret=SECRET)  # room for one record
    receiver.start()
    try:
        assert push(receiver.addr, "first", RECORD, 8, 0, LAYOUT, deadline_s=2, secret=SECRET).ok
        threading.Timer(0.2, lambda: receiver.buffer.release("first")).start()  # claimed by its decode request
        second = push(receiver.addr, "second", RECORD, 8, 0, LAYOUT, deadline_s=5, secret=SECRET)
        assert second.ok, second.reason  # refused "full" at first, then taken: each attempt signed afresh
        assert receiver.buffer.peek("second") is not None
    finally:
        receiver.close()

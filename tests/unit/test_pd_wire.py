"""The PD wire's messages: each round-trips through its wire form, and anything malformed a peer could send is a
``WireError`` (the one exception the receiver expects from a peer's bytes), never a KeyError or TypeError."""

from __future__ import annotations

from typing import Any

import pytest

from splitserve.auth import sign, verified
from splitserve.pd.wire import Reply, Reserve, Trailer, WireError


def test_each_message_round_trips() -> None:
    reserve = Reserve("t-1", 1024, 16, 7, "bfloat16/30/3/64/16", ts=1.5, mac="ab")
    assert Reserve.from_wire(reserve.as_wire()) == reserve
    assert Reply.from_wire(Reply(True).as_wire()) == Reply(True)
    assert Reply.from_wire(Reply(False, "full").as_wire()) == Reply(False, "full")
    assert Trailer.from_wire(Trailer("cd").as_wire()) == Trailer("cd")


def test_a_signed_request_verifies_as_sent_and_not_once_changed() -> None:
    stamped = Reserve("t-1", 1024, 16, 7, "layout", ts=100.0)
    message = stamped.as_wire() | {"mac": sign("secret", stamped.as_wire())}
    assert verified("secret", message) and Reserve.from_wire(message).mac == message["mac"]
    assert not verified("secret", message | {"nbytes": 1 << 30})


@pytest.mark.parametrize(
    "message",
    [
        {},
        {"op": "steal", "transfer_id": "t", "nbytes": 1, "num_tokens": 1, "tokens_hash": 0, "layout": "x"},
        {"transfer_id": 5, "nbytes": 1, "num_tokens": 1, "tokens_hash": 0, "layout": "x"},
        {"transfer_id": "t", "nbytes": "1", "num_tokens": 1, "tokens_hash": 0, "layout": "x"},
        {"transfer_id": "t", "nbytes": True, "num_tokens": 1, "tokens_hash": 0, "layout": "x"},
        {"transfer_id": "t", "nbytes": 1, "num_tokens": 1, "tokens_hash": 0},
    ],
)
def test_a_malformed_request_is_a_wire_error(message: dict[str, Any]) -> None:
    with pytest.raises(WireError):
        Reserve.from_wire(message)


@pytest.mark.parametrize("message", [{}, {"ok": "yes"}, {"ok": None}])
def test_a_malformed_reply_is_a_wire_error(message: dict[str, Any]) -> None:
    with pytest.raises(WireError):
        Reply.from_wire(message)


def test_a_refusal_without_a_reason_says_refused_and_a_trailer_needs_its_mac() -> None:
    assert Reply.from_wire({"ok": False}) == Reply(False, "refused")
    with pytest.raises(WireError):
        Trailer.from_wire({"mac": 3})

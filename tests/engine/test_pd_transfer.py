"""Disaggregated prefill/decode between two engines (tiny float32 model) over a real loopback KV receiver:
the KV that arrives is bit-identical to what prefill computed, and decode's greedy output equals a colocated
engine's, also when the push fails, the buffer is too small, or the KV belongs to another prompt."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import logging
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from splitserve.auth import sign
from splitserve.config import CacheConfig, EngineConfig, ModelConfig
from splitserve.engine.connector import KVConnectorBase
from splitserve.engine.engine import LLMEngine, kv_cache_layout
from splitserve.engine.sampling_params import SamplingParams
from splitserve.kvcache import serde
from splitserve.model.decoder import DecoderForCausalLM
from splitserve.model.kernels import native
from splitserve.pd import receiver as receiver_module
from splitserve.pd.buffer import PDBuffer
from splitserve.pd.receiver import KVReceiver, PDReceiverConnector
from splitserve.pd.sender import PDSenderConnector, push
from splitserve.pd.wire import parse_addr, payload_mac, recv_msg, send_msg
from splitserve.protocol.kv_transfer import KVTransferParams, KVTransferResult
from tests.support.engine import random_prompts, run_to_completion, tokens_of
from tests.support.faults import FaultProxy
from tests.support.quant import quantize_model
from tests.support.waiting import wait_until

BLOCK = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
PROMPT = random_prompts(1, 150, 150, seed=11)["r0"]
_ids = itertools.count()


def engine_with(model: DecoderForCausalLM, connector: KVConnectorBase | None) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model="test", max_model_len=1024),
        cache=CacheConfig(block_size=BLOCK, num_gpu_blocks_override=128),
    )
    return LLMEngine(config, model, None, "test", torch.device("cpu"), [connector] if connector else [])


@pytest.fixture(scope="module")
def layout(tiny_model: DecoderForCausalLM) -> str:
    return kv_cache_layout(tiny_model, BLOCK)


@pytest.fixture
def decode_side(tiny_model: DecoderForCausalLM, layout: str) -> Iterator[tuple[LLMEngine, KVReceiver]]:
    buffer = PDBuffer(64 << 20)
    receiver = KVReceiver(buffer, layout)
    receiver.start()
    yield engine_with(tiny_model, PDReceiverConnector(buffer, layout)), receiver
    receiver.close()


@pytest.fixture(scope="module")
def colocated_tokens(tiny_model: DecoderForCausalLM) -> list[int]:
    return tokens_of(run_to_completion(engine_with(tiny_model, None), {"c": PROMPT}, GREEDY)["c"])


def prefill(
    model: DecoderForCausalLM, layout: str, addr: str, transfer_id: str, **push_options: float
) -> tuple[int, KVTransferResult, LLMEngine]:
    """Run the prefill side (max_tokens 1, push to ``addr``); returns its first token and the push result."""
    engine = engine_with(model, PDSenderConnector(layout, **push_options))
    params = dataclasses.replace(GREEDY, max_tokens=1, kv_transfer=KVTransferParams(transfer_id, addr))
    outputs = run_to_completion(engine, {"p": PROMPT}, params)["p"]
    result = outputs[-1].kv_transfer_result.result(timeout=30)
    return outputs[0].new_token_ids[0], result, engine


def decode(engine: LLMEngine, transfer_id: str, first_token: int, prompt: list[int] = PROMPT) -> list[int]:
    params = dataclasses.replace(GREEDY, kv_transfer=KVTransferParams(transfer_id, first_token_id=first_token))
    rid = f"d{next(_ids)}"
    return tokens_of(run_to_completion(engine, {rid: prompt}, params)[rid])


def test_transferred_kv_is_bit_identical_and_decode_matches_colocated(
    tiny_model: DecoderForCausalLM,
    layout: str,
    decode_side: tuple[LLMEngine, KVReceiver],
    colocated_tokens: list[int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    decoder, receiver = decode_side
    first, result, prefiller = prefill(tiny_model, layout, receiver.addr, "t-1")
    assert result.ok and result.num_tokens == len(PROMPT) and first == colocated_tokens[0]
    entry = receiver.buffer.peek("t-1")
    assert entry is not None
    arrived = serde.decode(entry.record, layout)
    ids = prefiller.kv.block_ids("p") or [b.block_id for b in prefiller.pool.blocks]  # the request has finished
    slots = torch.tensor([ids[p // BLOCK] * BLOCK + p % BLOCK for p in range(len(PROMPT))])
    computed = prefiller.runner.kv_cache.index_select(2, slots)
    assert torch.equal(arrived, computed)
    with caplog.at_level(logging.INFO, logger="splitserve.pd.receiver"):
        assert decode(decoder, "t-1", first) == colocated_tokens
    retrieved = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Retrieved")]
    assert retrieved and retrieved[0].startswith(f"Retrieved {len(PROMPT) - 1} out of {len(PROMPT) - 1} required")
    assert decoder.get_stats().prefix_cache_hits == 0 and receiver.buffer.stats().used_bytes == 0


def test_n_sequences_load_one_push_once_and_each_draws_what_it_draws_colocated(tiny_model: DecoderForCausalLM) -> None:
    """A request for n sequences on the decode side (no forced first token: each draws its own): the first loads
    the pushed prompt, the others wait one step and start from it in the prefix cache; every sequence's tokens
    and logprobs are the colocated ones, to the bit (a quantized model, whose every path computes the same bits;
    each engine its own copy, as the model holds the cache it is bound to)."""
    kernels = native()
    assert kernels is not None
    model = quantize_model(tiny_model, kernels, 3)  # Q4_1
    layout = kv_cache_layout(model, BLOCK)
    buffer = PDBuffer(64 << 20)
    receiver = KVReceiver(buffer, layout)
    receiver.start()
    try:
        decoder = engine_with(copy.deepcopy(model), PDReceiverConnector(buffer, layout))
        _, result, _ = prefill(copy.deepcopy(model), layout, receiver.addr, "t-n")
        assert result.ok
        sampled = SamplingParams(max_tokens=12, temperature=0.9, logprobs=2)
        colocated = engine_with(copy.deepcopy(model), None)
        transfer = KVTransferParams("t-n")
        for i in range(3):
            colocated.add_request(f"s{i}", PROMPT, dataclasses.replace(sampled, seed=5 + i))
            decoder.add_request(f"s{i}", PROMPT, dataclasses.replace(sampled, seed=5 + i, kv_transfer=transfer))
        expected, got = _drain(colocated), _drain(decoder)
    finally:
        receiver.close()
    assert got == expected and len({tuple(t for t, _ in seq) for seq in got.values()}) == 3
    stats = decoder.get_stats()
    assert stats.cached_tokens_by_source == {"engine": 2 * (len(PROMPT) - 1), "pd": len(PROMPT) - 1}
    assert decoder.iteration_tokens.total == 1 + 2 * 1 + 3 * 11  # the last prompt token of each, then decodes


def _drain(engine: LLMEngine) -> dict[str, list[tuple[int, float]]]:
    """Step until done: each request's (token, logprob) pairs."""
    drawn: dict[str, list[tuple[int, float]]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            drawn.setdefault(out.request_id, []).extend((e.token_id, e.logprob) for e in out.new_logprobs or ())
    return drawn


def test_a_failed_push_means_decode_recomputes_the_same_output(
    tiny_model: DecoderForCausalLM,
    layout: str,
    decode_side: tuple[LLMEngine, KVReceiver],
    colocated_tokens: list[int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    decoder, _ = decode_side
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        dead_addr = f"127.0.0.1:{unused.getsockname()[1]}"
    first, result, _ = prefill(tiny_model, layout, dead_addr, "t-2", deadline_s=0.2)
    assert not result.ok and "gave up" in result.reason
    with caplog.at_level(logging.INFO, logger="splitserve.pd.receiver"):
        assert decode(decoder, "t-2", first) == colocated_tokens
    assert any(r.getMessage().startswith("Retrieved 0 out of") for r in caplog.records)


def test_a_transfer_gone_before_its_copy_is_computed_instead(
    tiny_model: DecoderForCausalLM,
    layout: str,
    decode_side: tuple[LLMEngine, KVReceiver],
    colocated_tokens: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Offered, then gone when admission claims it (expired in between): the load comes up empty, the engine
    rolls the request back and computes the prompt, and nothing counts as loaded."""
    decoder, receiver = decode_side
    first, result, _ = prefill(tiny_model, layout, receiver.addr, "t-8")
    assert result.ok
    monkeypatch.setattr(receiver.buffer, "claim", lambda transfer_id: None)
    assert decode(decoder, "t-8", first) == colocated_tokens
    stats = decoder.get_stats()
    assert (stats.external_prefix_cache_queries, stats.external_prefix_cache_hits) == (len(PROMPT), 0)
    assert stats.cached_tokens_by_source == {"engine": 0}


def test_a_full_buffer_is_retried_then_given_up_without_a_hang(layout: str, caplog: pytest.LogCaptureFixture) -> None:
    record = serde.encode(torch.zeros(2, 2, 32, 1, 8), 32, layout)
    receiver = KVReceiver(PDBuffer(len(record) + 100), layout)
    receiver.start()
    try:
        assert receiver.buffer.reserve("another-transfer", 200) is not None  # being filled: the rest is too small
        with caplog.at_level(logging.INFO, logger="splitserve.pd.receiver"):
            result = push(receiver.addr, "t-3", record, 32, 0, layout, deadline_s=0.3)
        assert not result.ok and "stayed full" in result.reason
        assert sum("Failed to allocate memory object, retrying..." in r.getMessage() for r in caplog.records) >= 2
        receiver.buffer.abort("another-transfer")
        assert receiver.buffer.stats().used_bytes == 0
        began = time.monotonic()
        result = push(receiver.addr, "t-3b", record + bytes(200), 32, 0, layout, deadline_s=5)
        assert not result.ok and "never fit" in result.reason and time.monotonic() - began < 1  # not retried
    finally:
        receiver.close()


def test_kv_of_another_prompt_or_layout_is_refused(
    tiny_model: DecoderForCausalLM,
    layout: str,
    decode_side: tuple[LLMEngine, KVReceiver],
    colocated_tokens: list[int],
) -> None:
    decoder, receiver = decode_side
    first, result, _ = prefill(tiny_model, layout, receiver.addr, "t-4")
    assert result.ok
    other = [(t + 1) % 50 for t in PROMPT]
    decode(decoder, "t-4", first, prompt=other)  # the KV is for PROMPT: refused, dropped, recomputed
    assert receiver.buffer.peek("t-4") is None and receiver.buffer.stats().used_bytes == 0
    record = serde.encode(torch.zeros(2, 2, 4, 1, 8), 4, "float32-L2-H1-D8-B16")
    assert "layout" in push(receiver.addr, "t-5", record, 4, 0, "float32-L2-H1-D8-B16", deadline_s=0.2).reason


def test_unclaimed_transfers_expire_and_filling_ones_are_never_handed_out_twice() -> None:
    now = [0.0]
    buffer = PDBuffer(100, entry_ttl_s=10, clock=lambda: now[0])
    assert buffer.reserve("a", 60) is not None and buffer.reserve("b", 60) is None
    buffer.release("a")  # its request ended while the bytes still arrive: the room stays taken
    now[0] = 100.0
    assert buffer.reserve("b", 60) is None
    assert not buffer.commit("a", 1, 0, "x")  # the filling thread finds it abandoned and frees it
    assert buffer.reserve("b", 60) is not None and buffer.commit("b", 1, 0, "x")
    now[0] = 111.0  # never claimed
    assert buffer.reserve("c", 60) is not None and buffer.stats().num_expired == 1


def test_a_corrupted_push_is_refused_and_frees_its_room(layout: str) -> None:
    receiver = KVReceiver(PDBuffer(1 << 20), layout)
    receiver.start()
    try:
        record = bytearray(serde.encode(torch.ones(2, 2, 8, 1, 8), 8, layout))
        record[-1] ^= 0xFF  # the last payload byte
        result = push(receiver.addr, "t-6", bytes(record), 8, 0, layout, deadline_s=0.5)
        assert not result.ok and "invalid record" in result.reason
        assert receiver.buffer.peek("t-6") is None and receiver.buffer.stats().used_bytes == 0
    finally:
        receiver.close()


def _open_transfer(receiver: KVReceiver, transfer_id: str, record: bytes, layout: str) -> socket.socket:
    """Ask ``receiver`` for room for ``record`` as a sender would, and leave the connection open."""
    sock = socket.create_connection(parse_addr(receiver.addr), timeout=5)
    header = {"transfer_id": transfer_id, "nbytes": len(record), "num_tokens": 8, "tokens_hash": 0, "layout": layout}
    send_msg(sock, header)
    return sock


def test_no_peer_can_hold_the_receiver(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trickling sender misses its deadline, a peer's open reservations are capped, and so are connections."""
    record = serde.encode(torch.ones(2, 2, 8, 1, 8), 8, layout)
    receiver = KVReceiver(PDBuffer(len(record) * 3), layout)
    receiver.transfer_deadline_s = 0.5
    monkeypatch.setattr(receiver_module, "REQUEST_TIMEOUT_S", 0.5)
    receiver.start()
    try:
        trickle = _open_transfer(receiver, "slow", record, layout)
        assert recv_msg(trickle)["ok"]
        with contextlib.suppress(OSError):  # the receiver hangs up on it
            for i in range(10):  # a byte every 0.1 s: never idle long, but never done
                trickle.sendall(record[i : i + 1])
                time.sleep(0.1)
        wait_until(lambda: receiver.buffer.stats().used_bytes == 0, timeout_s=25)  # dropped, its room freed
        trickle.close()
        # beside its first transfer, a peer may fill at most half the buffer: the second is refused ("full")
        first = _open_transfer(receiver, "a", record, layout)
        assert recv_msg(first)["ok"]
        second = _open_transfer(receiver, "b", record, layout)
        assert recv_msg(second) == {"ok": False, "reason": "full"}
        first.close()
        second.close()
        receiver.max_peer_connections = 1
        wait_until(lambda: not receiver._connections, timeout_s=25)  # (its threads run niced: slow on a busy CPU)
        silent = socket.create_connection(parse_addr(receiver.addr), timeout=5)  # sends no request at all
        assert silent.recv(1) == b""  # dropped after REQUEST_TIMEOUT_S (0.5 s here)
        silent.close()
        wait_until(lambda: not receiver._connections, timeout_s=25)
        idle = socket.create_connection(parse_addr(receiver.addr), timeout=5)
        wait_until(lambda: sum(receiver._connections.values()) == 1, timeout_s=25)
        refused = socket.create_connection(parse_addr(receiver.addr), timeout=5)
        assert refused.recv(1) == b""  # closed at once
        idle.close()
        refused.close()
        wait_until(lambda: not receiver._connections, timeout_s=25)
        assert push(receiver.addr, "t-7", record, 8, 0, layout, deadline_s=2).ok  # an honest push still works
    finally:
        receiver.close()


def test_a_push_through_a_faulty_network_arrives_whole_or_not_at_all(layout: str) -> None:
    """The fault proxy between prefill and decode: bytes in tiny slices arrive bit-identical; a connection
    reset mid-push fails the push (decode then computes the prompt) and frees the receiver's room."""
    receiver = KVReceiver(PDBuffer(8 << 20), layout)
    receiver.start()
    proxy = FaultProxy(receiver.port)
    try:
        kv = torch.arange(2 * 2 * 64 * 1 * 8, dtype=torch.float32).reshape(2, 2, 64, 1, 8)
        record = serde.encode(kv, 64, layout)
        proxy.slice_bytes = 7
        assert push(f"127.0.0.1:{proxy.port}", "sliced", record, 64, 0, layout, deadline_s=5).ok
        entry = receiver.buffer.claim("sliced")
        assert entry is not None and torch.equal(serde.decode(entry.record, layout), kv)
        receiver.buffer.release("sliced")
        big = serde.encode(torch.ones(2, 2, 2048, 1, 8), 2048, layout)  # 256 KiB or more, at 256 KiB/s
        proxy.slice_bytes, proxy.bytes_per_s = 1 << 12, float(1 << 18)

        def cut() -> None:  # mid-push, for good: retries find the network down too
            proxy.refuse = True
            proxy.reset()

        threading.Timer(0.3, cut).start()
        result = push(f"127.0.0.1:{proxy.port}", "cut", big, 2048, 0, layout, deadline_s=0.5)
        assert not result.ok
        wait_until(lambda: receiver.buffer.stats().used_bytes == 0, timeout_s=10)
        assert receiver.buffer.peek("cut") is None
    finally:
        proxy.close()
        receiver.close()


def test_with_a_cluster_secret_only_signed_pushes_get_room(layout: str, caplog: pytest.LogCaptureFixture) -> None:
    receiver = KVReceiver(PDBuffer(1 << 20), layout, secret="cluster-secret")
    receiver.start()
    try:
        record = serde.encode(torch.ones(2, 2, 8, 1, 8), 8, layout)
        signed = push(receiver.addr, "signed", record, 8, 0, layout, deadline_s=1, secret="cluster-secret")
        assert signed.ok and receiver.buffer.peek("signed") is not None
        with caplog.at_level(logging.WARNING, logger="splitserve.pd.receiver"):
            for secret in (None, "another-secret"):
                refused = push(receiver.addr, f"t-{secret}", record, 8, 0, layout, deadline_s=0.2, secret=secret)
                assert not refused.ok and "unauthenticated" in refused.reason
        assert receiver.buffer.stats().num_reservations == 0  # an unauthenticated peer never got room
        # a signed request whose payload was swapped on the way (its trailer MACs the other payload), and a
        # trailer made up without the secret
        for forged_mac in ("mac-of-another-payload", "0" * 64):
            sock = socket.create_connection(parse_addr(receiver.addr), timeout=5)
            header = {"op": "reserve", "transfer_id": f"swapped-{forged_mac[:4]}", "nbytes": len(record),
                      "num_tokens": 8, "tokens_hash": 0, "layout": layout, "ts": time.time()}  # fmt: skip
            header["mac"] = sign("cluster-secret", header)
            send_msg(sock, header)
            assert recv_msg(sock)["ok"]
            sock.sendall(record)
            if forged_mac == "mac-of-another-payload":
                other = payload_mac("cluster-secret", header["mac"])
                other.update(b"x" * len(record))
                forged_mac = other.hexdigest()
            send_msg(sock, {"mac": forged_mac})
            answer = recv_msg(sock)
            assert not answer["ok"] and "not the one the push signed" in answer["reason"]
            sock.close()
        assert receiver.buffer.stats().used_bytes == len(record)  # the signed push's entry only
    finally:
        receiver.close()

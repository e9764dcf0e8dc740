"""vLLM's KV event format: our decoder reads what vLLM 0.32 published (a recorded fixture) as vLLM's own decoder
does, our encoder writes the same bytes, both layouts round-trip, and a worker's publisher (``--kv-events-config``)
sends batches that a plain ZMQ SUB socket decodes, with replay."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import msgpack
import pytest
import zmq

from splitserve.config import KVEventsConfig, ServerConfig
from splitserve.protocol.kv_events import Tier
from splitserve.protocol.vllm_events import (
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventLayout,
    cache_salt_of,
    decode_batch,
    decode_frames,
    encode_batch,
    has_foreign_keys,
)
from splitserve.worker.kv_events import KVEventLog
from splitserve.worker.vllm_publisher import VLLMEventPublisher

RECORDED = json.loads((Path(__file__).parents[1] / "data" / "vllm_0_32_kv_events.json").read_text())


OPTIONAL_FIELDS = ("extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality")


def frames_of(hex_frames: list[str]) -> list[bytes]:
    return [bytes.fromhex(f) for f in hex_frames]


def as_vllm_builtins(batch: EventBatch) -> list[Any]:
    """``batch`` as ``msgspec.to_builtins`` writes vLLM's ``KVEventBatch`` (the fixture's ``expected``)."""
    events = []
    for event in batch.events:
        fields = {k: getattr(event, k) for k in event.__dataclass_fields__}
        for name in OPTIONAL_FIELDS:
            if fields.get(name, 0) is None:
                del fields[name]  # nil optional fields are left out
        events.append({"type": type(event).__name__, **fields})
    return [batch.ts, events, batch.data_parallel_rank]


class TestRecordedVLLMBatches:
    def test_they_decode_as_vllms_own_decoder_reads_them(self) -> None:
        assert RECORDED["vllm_version"].startswith("0.32")
        for seq, (hex_frames, expected) in enumerate(zip(RECORDED["live"], RECORDED["expected"], strict=True)):
            topic, number, payload = decode_frames(frames_of(hex_frames))
            assert (topic, number) == (RECORDED["topic"], seq)
            assert as_vllm_builtins(decode_batch(payload)) == expected
        batches = [decode_batch(bytes.fromhex(hex_frames[2])) for hex_frames in RECORDED["live"]]
        kinds = [type(e).__name__ for batch in batches for e in batch.events]
        assert kinds == ["BlockStored"] * 3 + ["BlockRemoved"] * 6 + ["AllBlocksCleared"]

    def test_our_encoder_writes_the_bytes_vllm_wrote(self) -> None:
        for hex_frames in RECORDED["live"]:
            payload = bytes.fromhex(hex_frames[2])
            assert encode_batch(decode_batch(payload)) == payload

    def test_the_salted_prompt_carries_its_salt_and_the_second_its_parent(self) -> None:
        a, b, c = (decode_batch(bytes.fromhex(f[2])).events[0] for f in RECORDED["live"][:3])
        assert isinstance(a, BlockStored) and isinstance(b, BlockStored) and isinstance(c, BlockStored)
        assert b.parent_block_hash == a.block_hashes[0] and b.token_ids == RECORDED["requests"][1]["token_ids"][4:]
        assert cache_salt_of(c) == "tenant-1" and cache_salt_of(a) is None
        assert not any(has_foreign_keys(e) for e in (a, b, c))

    def test_the_replay_answer_has_every_batch_from_the_start_then_the_end_marker(self) -> None:
        replay = RECORDED["replay"]
        assert all(frames[0] == "" for frames in replay)  # the DEALER's empty delimiter
        numbers = [decode_frames(frames_of(frames[1:]))[1] for frames in replay]
        assert numbers == [1, 2, 3, 4, REPLAY_END_SEQ]
        assert replay[0][1:] == RECORDED["live"][1]


class TestCodec:
    EVENTS: ClassVar[list[Any]] = [
        BlockStored([1, 2**64 - 1], None, [5, 6, 7, 8], 2, extra_keys=[["salt"], None], group_idx=0),
        BlockStored([b"\x01" * 32], b"\x02" * 32, [9, 10], 2, lora_id=3, medium="CPU", lora_name="ad"),
        BlockRemoved([7, b"\x03" * 32], None),
        AllBlocksCleared(),
    ]

    @pytest.mark.parametrize("layout", list(EventLayout))
    def test_batches_round_trip(self, layout: EventLayout) -> None:
        for rank in (None, 2):
            batch = EventBatch(12.5, list(self.EVENTS), rank)
            assert decode_batch(encode_batch(batch, layout)) == batch

    def test_the_layouts_are_vllms(self) -> None:
        stored = BlockStored([1], None, [5, 6], 2)
        body = msgpack.unpackb(encode_batch(EventBatch(1.0, [stored, AllBlocksCleared()], 0)))
        assert body == [1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                               "token_ids": [5, 6], "block_size": 2, "lora_id": None, "medium": "GPU",
                               "lora_name": None}, {"type": "AllBlocksCleared"}], 0]  # fmt: skip
        body = msgpack.unpackb(encode_batch(EventBatch(1.0, [stored]), EventLayout.ARRAY))
        assert body == [1.0, [["BlockStored", [1], None, [5, 6], 2, None, "GPU", None]]]

    def test_an_older_vllms_array_events_decode(self) -> None:
        # vLLM before 0.29 (positional, without medium, lora_name and later fields)
        payload = msgpack.packb([3.0, [["BlockStored", [11, 12], 10, [1, 2, 3, 4], 2, None], ["BlockRemoved", [11]]]])
        events = decode_batch(payload).events
        assert events == [BlockStored([11, 12], 10, [1, 2, 3, 4], 2, None), BlockRemoved([11])]

    def test_unknown_event_types_and_fields_are_skipped(self) -> None:
        future = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2],
                  "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None,
                  "locality": "LOCAL", "ownership": "tier-2"}  # fmt: skip
        payload = msgpack.packb([1.0, [{"type": "BlockPromoted", "x": 1}, future]])
        assert decode_batch(payload).events == [BlockStored([1], None, [1, 2], 2, locality="LOCAL")]

    @pytest.mark.parametrize(
        ("body", "message"),
        [
            ({"ts": 1}, "an array"),
            ([1.0, [{"block_hashes": [1]}]], r"events\[0\]: an event's type"),
            ([1.0, [{"type": "BlockRemoved"}]], "lacks block_hashes"),
            ([1.0, [{"type": "BlockRemoved", "block_hashes": [-1]}]], "unsigned 64-bit"),
            ([1.0, [["BlockStored", [1], None, "tokens", 2]]], "token_ids"),
            ([1.0, [], "rank"], "data_parallel_rank"),
        ],
    )
    def test_invalid_batches_are_refused_with_the_reason(self, body: Any, message: str) -> None:
        with pytest.raises(ValueError, match=message):
            decode_batch(msgpack.packb(body))
        with pytest.raises(ValueError, match="not msgpack"):
            decode_batch(b"\xc1")

    def test_what_a_token_only_consumer_cannot_name(self) -> None:
        assert has_foreign_keys(BlockStored([1], None, [1], 1, lora_name="adapter"))
        assert has_foreign_keys(BlockStored([1], None, [1], 1, extra_keys=[[["mm", 0]]]))
        assert has_foreign_keys(BlockStored([1], 9, [1], 1, extra_keys=[["salt"]]))  # a salt past the first block
        assert not has_foreign_keys(BlockStored([1, 2], None, [1, 2], 1, extra_keys=[["salt"], None]))


class TestKVEventsConfig:
    def test_vllms_flag_parses(self) -> None:
        text = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"}'
        config = KVEventsConfig.from_json(text)
        assert config.is_enabled and config.endpoint == "tcp://*:5557" and config.topic == "kv"
        assert not KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}').is_enabled

    @pytest.mark.parametrize(
        ("text", "message"),
        [
            ("[1]", "JSON object"),
            ("{", "JSON object"),
            ('{"enable_kv_cache_events": "yes"}', "must be a bool"),
            ('{"endpnt": "tcp://*:1"}', "unknown keys endpnt"),
            ('{"publisher": "kafka"}', "zmq or null"),
            ('{"endpoint": "5557"}', "ZMQ address"),
            ('{"buffer_steps": 0}', "positive"),
        ],
    )
    def test_mistakes_are_named(self, text: str, message: str) -> None:
        with pytest.raises(ValueError, match=message):
            KVEventsConfig.from_json(text)

    def test_the_server_config_validates_it(self) -> None:
        with pytest.raises(ValueError, match="publisher"):
            ServerConfig(kv_events_config=KVEventsConfig(publisher="kafka")).validate()


@pytest.fixture
def publisher() -> Iterator[VLLMEventPublisher]:
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://127.0.0.1:0",
                            topic="kv@w")  # fmt: skip
    publisher = VLLMEventPublisher(config, block_size=2, context=zmq.Context.instance())
    yield publisher
    publisher.close()


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def test_a_worker_publishes_vllm_events_that_a_plain_sub_socket_decodes(publisher: VLLMEventPublisher) -> None:
    log = KVEventLog("w", "http://w")
    log.add_listener(publisher)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port_of(publisher.endpoint)}")
    time.sleep(0.3)  # a SUB socket misses what is published before it joined
    publisher.start()
    log.blocks_cached(None, [11, 12], [1, 2, 3, 4], "tenant")  # the engine cached a salted prompt's two blocks
    log.stored(Tier.ENGINE, [11, 12])  # (the hashes, as the log records them: not republished)
    log.stored(Tier.L1, [12])  # not vLLM's
    log.removed(Tier.ENGINE, [12])
    received = []
    while sum(len(events) for _, events in received) < 3:
        assert sub.poll(5000), f"only {received} arrived"
        topic, seq, payload = decode_frames(sub.recv_multipart())
        assert topic == "kv@w"
        received.append((seq, decode_batch(payload).events))
    events = [e for _, batch in received for e in batch]
    assert events == [
        AllBlocksCleared(),  # a new publisher: consumers forget what this address held
        BlockStored([11, 12], None, [1, 2, 3, 4], 2, extra_keys=[["tenant"], None]),
        BlockRemoved([12], "GPU"),
    ]
    assert [seq for seq, _ in received] == list(range(len(received)))
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port_of(publisher.replay_endpoint or '')}")
    dealer.send_multipart([b"", (1).to_bytes(8, "big")])
    replayed = []
    while True:
        assert dealer.poll(5000)
        _, seq, payload = decode_frames(dealer.recv_multipart()[1:])
        if seq == REPLAY_END_SEQ:
            break
        replayed.append((seq, decode_batch(payload).events))
    assert replayed == received[1:]
    sub.close(0)
    dealer.close(0)


def test_a_full_queue_drops_events_and_then_clears_consumers() -> None:
    small = VLLMEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", max_queue_size=2), 2)
    for block_hash in (1, 2, 3):  # the sender thread is not running: the third does not fit
        small.blocks_cached(None, [block_hash], [block_hash, 0], None)
    assert small._take(0) == [AllBlocksCleared()]  # what is queued predates the loss: only a clear goes out
    small.blocks_cached(None, [4], [4, 0], None)
    assert small._take(0) == [BlockStored([4], None, [4, 0], 2)]
    small.close()


def test_a_publisher_reachable_from_other_machines_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    def warnings_for(endpoint: str) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="splitserve.worker.vllm_publisher"):
            VLLMEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint), 2).close()
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("SECURITY")]

    assert warnings_for("tcp://127.0.0.1:0") == []
    wildcard = warnings_for("tcp://*:0")
    assert len(wildcard) == 1 and "tcp://0.0.0.0:" in wildcard[0] and "token ids" in wildcard[0]

"""vLLM workers behind the router: it subscribes to their ZMQ KV events (vLLM's format), indexes them by the
token ids they carry, routes kvaware by them, next to splitserve workers, and copes with missed batches.

The fake vLLM worker here is an HTTP app answering as vLLM does (``/version``, ``/kv_event_sources``,
completions) with real ZMQ sockets: an XPUB (a PUB that also tells the test when the router has subscribed)
and a ROUTER replay socket, serving vLLM's replay protocol. It publishes the batches the tests give it: the
ones recorded from vLLM 0.32 (``tests/data/vllm_0_32_kv_events.json``) or made with our encoder."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from splitserve.config import BackendKind, RoutingStrategy
from splitserve.keys import hash_blocks, salt_root
from splitserve.protocol.kv_events import EventKind, Tier
from splitserve.protocol.vllm_events import (
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    encode_batch,
    encode_frames,
)
from splitserve.router import vllm_events as router_vllm
from splitserve.router.app import Router
from splitserve.router.vllm_events import VLLMBlockKeys, VLLMSource
from tests.support.router import EventfulWorker, completion, start_router
from tests.support.waiting import wait_until

RECORDED = json.loads((Path(__file__).parents[1] / "data" / "vllm_0_32_kv_events.json").read_text())
RECORDED_PAYLOADS = [bytes.fromhex(frames[2]) for frames in RECORDED["live"]]
TOKENS = {r["request_id"]: r["token_ids"] for r in RECORDED["requests"]}  # a, b (a's first block), c (salted)
BS = 4  # the recording's block size; the routers here use it too


def vllm_hash(parent: int | None, tokens: list[int]) -> int:
    """An opaque block hash, as vLLM's (sha256) is to the router."""
    digest = hashlib.sha256(repr((parent, tokens)).encode()).digest()
    return int.from_bytes(digest[:8], "big")


def stored(tokens: list[int], parent: int | None = None, block_size: int = BS) -> tuple[BlockStored, list[int]]:
    """A BlockStored for ``tokens`` (whole blocks) chained to ``parent``, and its vLLM hashes."""
    hashes: list[int] = []
    for i in range(0, len(tokens), block_size):
        hashes.append(vllm_hash(hashes[-1] if hashes else parent, tokens[i : i + block_size]))
    return BlockStored(hashes, parent, tokens, block_size), hashes


def batch(*events: Any) -> bytes:
    return encode_batch(EventBatch(1.0, list(events), 0))


class FakeVLLM:
    """A vLLM worker as the router sees it (see the module's doc)."""

    def __init__(self, stack: ExitStack, *, replay: bool = True, name_sources: bool = True) -> None:
        from tests.support.fake_engine import ServerThread

        self.context = zmq.Context()
        stack.callback(self.context.destroy, 0)
        self.pub = self.context.socket(zmq.XPUB)
        self.pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.history: list[tuple[int, bytes]] = []
        self.replay_port: int | None = None
        if replay:
            replay_socket = self.context.socket(zmq.ROUTER)
            self.replay_port = replay_socket.bind_to_random_port("tcp://127.0.0.1")
            self._stop = threading.Event()
            thread = threading.Thread(target=self._serve_replays, args=(replay_socket,), daemon=True)
            thread.start()
            stack.callback(thread.join, 2)
            stack.callback(self._stop.set)
        self.num_requests = 0
        self.name_sources = name_sources
        routes = [
            Route("/version", lambda _: JSONResponse({"version": "0.32.0"})),
            Route("/kv_event_sources", self._sources),
            Route("/health", lambda _: Response(status_code=200)),
            Route("/v1/completions", self._completion, methods=["POST"]),
        ]
        self.url = stack.enter_context(ServerThread(Starlette(routes=routes))).url

    def wait_subscribed(self) -> None:
        """Until a subscriber's subscription reached the socket (then nothing published is lost on it)."""
        assert self.pub.poll(10_000), "the router did not subscribe"
        assert self.pub.recv() == b"\x01"

    def publish(self, seq: int, payload: bytes, *, live: bool = True) -> None:
        """Keep the batch for replay; send it to subscribers unless ``live`` is off (a batch they missed)."""
        self.history.append((seq, payload))
        if live:
            self.pub.send_multipart(encode_frames("", seq, payload))

    def _serve_replays(self, sock: zmq.Socket) -> None:
        while not self._stop.is_set():
            if not sock.poll(50):
                continue
            identity, _, start = sock.recv_multipart()
            for seq, payload in list(self.history):
                if seq >= int.from_bytes(start, "big"):
                    sock.send_multipart([identity, b"", *encode_frames("", seq, payload)])
            sock.send_multipart([identity, b"", b"", REPLAY_END_SEQ.to_bytes(8, "big", signed=True), b""])
        sock.close(0)

    async def _sources(self, _: Request) -> Response:
        if not self.name_sources:
            return JSONResponse({})
        replay = f"tcp://*:{self.replay_port}" if self.replay_port else None
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.pub_port}",
                  "replay_endpoint": replay, "buffer_steps": 10000, "hwm": 100000, "topic": ""}  # fmt: skip
        return JSONResponse({"0": config})

    async def _completion(self, request: Request) -> Response:
        self.num_requests += 1
        body = await request.json()
        return JSONResponse({"id": "cmpl-1", "object": "text_completion", "model": body.get("model"),
                             "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}]})  # fmt: skip


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def kvaware_router(stack: ExitStack, urls: list[str], **options: Any) -> tuple[Router, httpx.Client]:
    return start_router(stack, urls, routing_strategy=RoutingStrategy.KVAWARE, block_size=BS, **options)


def engine_tokens(router: Router, worker_url: str, tokens: list[int], salt: str | None = None) -> int:
    return router.kv_index.match(hash_blocks(tokens, BS, salt_root(salt)), worker_url).engine


def test_the_router_indexes_recorded_vllm_events_by_their_token_ids(stack: ExitStack) -> None:
    vllm = FakeVLLM(stack)
    router, _ = kvaware_router(stack, [vllm.url])  # auto: /version says vLLM; /kv_event_sources where
    vllm.wait_subscribed()
    assert router.events is not None and router.events.kinds[vllm.url] == BackendKind.VLLM
    for seq, payload in enumerate(RECORDED_PAYLOADS[:3]):  # a, then b (on a's first block), then c (salted)
        vllm.publish(seq, payload)
    wait_until(lambda: engine_tokens(router, vllm.url, TOKENS["c"], "tenant-1") == 8, timeout_s=5)
    assert engine_tokens(router, vllm.url, TOKENS["a"]) == 8
    assert engine_tokens(router, vllm.url, TOKENS["b"]) == 12  # its parent's key came from a's event
    assert engine_tokens(router, vllm.url, TOKENS["c"], "other-tenant") == 0
    vllm.publish(3, RECORDED_PAYLOADS[3])  # every block evicted
    wait_until(lambda: engine_tokens(router, vllm.url, TOKENS["b"]) == 0, timeout_s=5)
    assert engine_tokens(router, vllm.url, TOKENS["c"], "tenant-1") == 0
    assert router.pool.get(vllm.url).worker_id == vllm.url.split("://")[1]  # type: ignore[union-attr]


def test_kvaware_routes_over_vllm_workers_by_their_events(stack: ExitStack) -> None:
    workers = [FakeVLLM(stack), FakeVLLM(stack)]
    router, client = kvaware_router(stack, [w.url for w in workers], backend_kind=BackendKind.VLLM)
    for worker in workers:
        worker.wait_subscribed()
    prompt = list(range(100, 140))  # 10 blocks
    event, _ = stored(prompt)
    workers[1].publish(0, batch(event))
    wait_until(lambda: engine_tokens(router, workers[1].url, prompt) == 40, timeout_s=5)
    for _ in range(3):
        assert completion(client, prompt=[*prompt, 7]).status_code == 200
    assert [w.num_requests for w in workers] == [0, 3]
    workers[1].publish(1, batch(AllBlocksCleared()))  # its prefix cache was reset
    wait_until(lambda: engine_tokens(router, workers[1].url, prompt) == 0, timeout_s=5)


def test_a_mixed_fleet_routes_each_prompt_to_the_worker_holding_it(stack: ExitStack) -> None:
    vllm, splitserve = FakeVLLM(stack), EventfulWorker(stack, "s")
    router, client = kvaware_router(stack, [vllm.url, splitserve.url])  # --backend-kind auto
    vllm.wait_subscribed()
    wait_until(lambda: router.kv_index.is_registered(splitserve.url), timeout_s=10)
    assert router.events is not None
    assert router.events.kinds == {vllm.url: BackendKind.VLLM, splitserve.url: BackendKind.SPLITSERVE}
    on_vllm, on_splitserve = list(range(41, 81)), list(range(1, 41))  # ids the fake tokenizer knows
    vllm.publish(0, batch(stored(on_vllm)[0]))
    splitserve.log.stored(Tier.ENGINE, hash_blocks(on_splitserve, BS))
    wait_until(lambda: engine_tokens(router, vllm.url, on_vllm) == 40, timeout_s=5)
    wait_until(lambda: engine_tokens(router, splitserve.url, on_splitserve) == 40, timeout_s=5)
    for _ in range(2):
        assert completion(client, prompt=[*on_vllm, 1]).status_code == 200
        assert completion(client, prompt=[*on_splitserve, 1]).status_code == 200
    assert (vllm.num_requests, splitserve.num_requests) == (2, 2)


def test_a_gap_is_filled_from_the_replay_socket(stack: ExitStack) -> None:
    vllm = FakeVLLM(stack)
    router, _ = kvaware_router(stack, [vllm.url], backend_kind=BackendKind.VLLM)
    vllm.wait_subscribed()
    first, hashes = stored(list(range(10, 18)))
    second, _ = stored(list(range(18, 26)), parent=hashes[-1])  # continues the first
    vllm.publish(0, batch(first))
    vllm.publish(1, batch(second), live=False)  # the router misses it...
    vllm.publish(2, batch(BlockRemoved([hashes[0]])))  # ...sees the gap at 2, and asks for 1
    chain = list(range(10, 26))
    wait_until(lambda: router.events.followers[vllm.url].last_seq == 2, timeout_s=5)  # type: ignore[union-attr]
    follower = router.events.followers[vllm.url]  # type: ignore[union-attr]
    assert follower.num_resets == 0
    held = router.kv_index.match(hash_blocks(chain, BS), vllm.url)
    assert held.engine == 0  # block 0 was removed: nothing matches from the start...
    keys = hash_blocks(chain, BS)
    assert router.kv_index.match(keys[1:], vllm.url).engine == 12  # ...but blocks 1-3 are held, from 1 and 2


def test_a_gap_without_replay_drops_what_the_router_knew(stack: ExitStack) -> None:
    vllm = FakeVLLM(stack, replay=False)
    router, _ = kvaware_router(stack, [vllm.url], backend_kind=BackendKind.VLLM)
    vllm.wait_subscribed()
    early, late = list(range(10, 18)), list(range(50, 58))
    vllm.publish(0, batch(stored(early)[0]))
    wait_until(lambda: engine_tokens(router, vllm.url, early) == 8, timeout_s=5)
    vllm.publish(1, batch(BlockRemoved([vllm_hash(None, early[:BS])])), live=False)  # missed: early[0] evicted
    vllm.publish(2, batch(stored(late)[0]))
    wait_until(lambda: engine_tokens(router, vllm.url, late) == 8, timeout_s=5)
    assert engine_tokens(router, vllm.url, early) == 0  # unknown after the gap: dropped, not guessed
    assert router.events.followers[vllm.url].num_resets == 1  # type: ignore[union-attr]


def test_the_router_catches_up_on_history_when_it_connects(stack: ExitStack) -> None:
    vllm = FakeVLLM(stack)
    prompt = list(range(60, 76))
    event, hashes = stored(prompt)
    vllm.publish(0, batch(event), live=False)  # before the router existed
    vllm.publish(1, batch(BlockRemoved([hashes[-1]])), live=False)
    router, _ = kvaware_router(stack, [vllm.url], backend_kind=BackendKind.VLLM)
    wait_until(lambda: engine_tokens(router, vllm.url, prompt) == 12, timeout_s=5)  # no live batch needed


def test_a_restarted_publisher_starts_the_worker_afresh(stack: ExitStack) -> None:
    vllm = FakeVLLM(stack, replay=False)
    router, _ = kvaware_router(stack, [vllm.url], backend_kind=BackendKind.VLLM)
    vllm.wait_subscribed()
    old, new = list(range(10, 18)), list(range(80, 88))
    vllm.publish(0, batch(stored(old)[0]))
    vllm.publish(1, batch(stored(list(range(30, 34)))[0]))
    wait_until(lambda: engine_tokens(router, vllm.url, old) == 8, timeout_s=5)
    vllm.publish(0, batch(stored(new)[0]))  # numbering from 0 again: a new process, an empty cache
    wait_until(lambda: engine_tokens(router, vllm.url, new) == 8, timeout_s=5)
    assert engine_tokens(router, vllm.url, old) == 0


def test_an_unreachable_publisher_gets_one_warning(
    stack: ExitStack, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(router_vllm, "SILENT_AFTER_S", 0.2)
    vllm = FakeVLLM(stack, name_sources=False)  # vLLM without --kv-events-config: nothing at 5557+
    with caplog.at_level(logging.WARNING, logger="splitserve.router"):
        kvaware_router(stack, [vllm.url], backend_kind=BackendKind.VLLM, vllm_kv_events_port="+1")
        wait_until(lambda: "no KV events from vLLM worker" in caplog.text, timeout_s=5)
        time.sleep(1.5)  # more checks of the connection, no more warnings
    assert caplog.text.count("no KV events from vLLM worker") == 1
    assert f"tcp://127.0.0.1:{int(vllm.url.rsplit(':', 1)[1]) + 1}" in caplog.text


class TestBlockKeys:
    """vLLM's opaque hashes -> the router's keys, as ``kvaware`` needs them."""

    def test_vllm_blocks_split_into_router_blocks(self) -> None:
        keys = VLLMBlockKeys(block_size=4, max_blocks=100)
        tokens = list(range(16))
        event, hashes = stored(tokens, block_size=8)
        assert keys.translate(event) == [(Tier.ENGINE, EventKind.STORED, hash_blocks(tokens, 4))]
        removed = keys.translate(BlockRemoved([hashes[1]]))  # vLLM's second block: the router's third and fourth
        assert removed == [(Tier.ENGINE, EventKind.REMOVED, hash_blocks(tokens, 4)[2:])]

    def test_blocks_the_router_cannot_name_are_not_indexed(self, caplog: pytest.LogCaptureFixture) -> None:
        keys = VLLMBlockKeys(block_size=4, max_blocks=100)
        orphan, _ = stored(list(range(8)), parent=12345)  # its parent was never seen
        lora = BlockStored([1], None, [1, 2, 3, 4], 4, lora_name="adapter")
        image = BlockStored([2], None, [1, 2, 3, 4], 4, extra_keys=[[["mm-hash", 0]]])
        with caplog.at_level(logging.WARNING, logger="splitserve.router"):
            odd = BlockStored([3], None, [1, 2, 3, 4, 5, 6], 6)  # 6-token blocks do not split into 4s
            assert [keys.translate(e) for e in (orphan, lora, image, odd, odd)] == [[]] * 5
        assert keys.num_unindexed == 6 and caplog.text.count("do not split") == 1

    def test_offloaded_blocks_count_as_the_workers_l1(self) -> None:
        keys = VLLMBlockKeys(block_size=4, max_blocks=100)
        event = BlockStored([9], None, [5, 6, 7, 8], 4, medium="CPU")
        assert keys.translate(event) == [(Tier.L1, EventKind.STORED, hash_blocks([5, 6, 7, 8], 4))]

    def test_a_connectors_records_are_named_by_their_last_block_and_remote_ones_are_the_shared_l2(self) -> None:
        # splitserve's connector: a record of 8 tokens (two router blocks) after a GPU block, in L1 and in L2
        keys = VLLMBlockKeys(block_size=4, max_blocks=100)
        gpu, gpu_hashes = stored([1, 2, 3, 4])
        keys.translate(gpu)
        chained = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4)
        l1 = BlockStored([77], gpu_hashes[0], list(range(5, 13)), 8, medium="CPU", locality="LOCAL")
        assert keys.translate(l1) == [(Tier.L1, EventKind.STORED, [chained[-1]])]
        l2 = BlockStored([77], gpu_hashes[0], list(range(5, 13)), 8, medium="STORAGE", locality="REMOTE")
        assert keys.translate(l2) == [(Tier.L2, EventKind.STORED, [chained[-1]])]
        assert keys.translate(BlockRemoved([77], medium="CPU")) == [(Tier.L1, EventKind.REMOVED, [chained[-1]])]
        assert keys.translate(BlockRemoved(gpu_hashes)) == [(Tier.ENGINE, EventKind.REMOVED, chained[:1])]

    def test_the_map_is_bounded(self) -> None:
        keys = VLLMBlockKeys(block_size=4, max_blocks=2)
        first, hashes = stored(list(range(12)))  # three blocks, two remembered
        keys.translate(first)
        assert keys.translate(BlockRemoved([hashes[0]])) == []
        assert keys.translate(BlockRemoved([hashes[2]])) != []


def test_event_endpoints_follow_the_flags_then_the_worker() -> None:
    sources = {"0": {"publisher": "zmq", "endpoint": "tcp://*:6001", "replay_endpoint": "tcp://*:6002"}}
    assert VLLMSource().endpoints("http://10.0.0.5:8000", sources) == ("tcp://10.0.0.5:6001", "tcp://10.0.0.5:6002")
    assert VLLMSource().endpoints("http://10.0.0.5:8000", {}) == ("tcp://10.0.0.5:5557", None)
    flags = VLLMSource(events_port="+1000", replay_port="7000")
    assert flags.endpoints("http://w:8000", sources) == ("tcp://w:9000", "tcp://w:7000")
    assert VLLMSource().endpoints("http://[::1]:8000", None) == ("tcp://[::1]:5557", None)

"""A splitserve engine's KV events in vLLM's format (``--kv-events-config``): the tiny model's engine caches and
evicts blocks, the worker's publisher sends them over ZMQ, and what a consumer reads back names the same
blocks, with the tokens a router needs to rebuild its keys."""

from __future__ import annotations

import torch
import zmq

from splitserve.config import CacheConfig, EngineConfig, KVEventsConfig, ModelConfig, SchedulerConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams
from splitserve.keys import hash_blocks, salt_root
from splitserve.model.decoder import DecoderForCausalLM
from splitserve.protocol.vllm_events import (
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    decode_frames,
)
from splitserve.router.vllm_events import VLLMBlockKeys
from splitserve.worker.kv_events import KVEventLog
from splitserve.worker.vllm_publisher import VLLMEventPublisher
from tests.support.engine import run_to_completion
from tests.support.waiting import wait_until

BLOCK_SIZE = 8


def replayed_events(endpoint: str) -> list[object]:
    """Every event the publisher still keeps, fetched as a consumer does: a replay request from batch 0."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    events: list[object] = []
    while True:
        assert dealer.poll(5000), "no answer from the replay socket"
        _, seq, payload = decode_frames(dealer.recv_multipart()[1:])
        if seq == REPLAY_END_SEQ:
            dealer.close(0)
            return events
        events += decode_batch(payload).events


def test_an_engines_cached_and_evicted_blocks_go_out_in_vllms_format(tiny_model: DecoderForCausalLM) -> None:
    log = KVEventLog("w", "http://w")
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://127.0.0.1:0")
    publisher = VLLMEventPublisher(config, BLOCK_SIZE)
    log.add_listener(publisher)
    publisher.start()
    engine_config = EngineConfig(
        model=ModelConfig(model="test", max_model_len=128),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=16),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128),
    )
    engine = LLMEngine(engine_config, tiny_model, None, "test", torch.device("cpu"), events=log)
    prompt = list(range(10, 51))  # 5 full blocks and a token
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    run_to_completion(engine, {"first": prompt}, greedy)
    run_to_completion(engine, {"salted": prompt[:16]}, SamplingParams(max_tokens=1, temperature=0, cache_salt="t"))
    run_to_completion(engine, {"fill": list(range(100, 226))}, greedy)  # needs every block: evicts the rest
    events: list[object] = []

    def all_sent() -> bool:  # the sender thread has sent (and kept) the last eviction too
        events[:] = replayed_events(publisher.replay_endpoint or "")
        return hash_blocks(prompt, BLOCK_SIZE)[0] in {
            h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes
        }

    wait_until(all_sent, timeout_s=5, interval_s=0.05)
    publisher.close()
    assert events[0] == AllBlocksCleared()
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored[0] == BlockStored(hash_blocks(prompt, BLOCK_SIZE), None, prompt[:40], BLOCK_SIZE)  # one step
    salted = next(e for e in stored if e.extra_keys == [["t"], None])
    assert salted.block_hashes == hash_blocks(prompt[:16], BLOCK_SIZE, salt_root("t"))
    removed = {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert set(hash_blocks(prompt, BLOCK_SIZE)) <= removed  # evicted by the last request

    keys = VLLMBlockKeys(BLOCK_SIZE, 1000)  # a router rebuilds the same keys from the tokens
    rebuilt = [k for e in stored for _, _, ks in keys.translate(e) for k in ks]
    assert set(hash_blocks(prompt, BLOCK_SIZE)[:5]) <= set(rebuilt)
    assert set(salted.block_hashes) <= set(rebuilt)

"""``--verify-sample-rate``: a sample of the requests that reused KV is recomputed cold, when nothing else
waits, and compared token by token; a deliberately corrupted L2 record is caught, counted and logged, and the
client's answer never waits for the check."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from splitserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from splitserve.engine.connector import KVConnectorBase
from splitserve.engine.engine import LLMEngine, kv_cache_layout
from splitserve.engine.sampling_params import SamplingParams
from splitserve.kvcache import serde
from splitserve.kvcache.connector import KVConnector
from splitserve.kvcache.disk import DiskTier
from splitserve.metrics import WorkerMetrics, sum_samples
from splitserve.model.decoder import DecoderForCausalLM
from splitserve.model.kernels import native
from tests.support.engine import random_prompts, run_to_completion, tokens_of
from tests.support.kv_store import CHUNK, MODEL_ID, make_store, record_keys
from tests.support.quant import quantize_model

BLOCK = 16
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
PROMPT = random_prompts(1, 150, 150, seed=11)["r0"]


@pytest.fixture(scope="module")
def model(tiny_model: DecoderForCausalLM) -> DecoderForCausalLM:
    """The tiny model with Q4_1 blocks: every step in the native forward step, as a GGUF model runs."""
    kernels = native()
    assert kernels is not None
    return quantize_model(tiny_model, kernels, 3)


def make_engine(
    model: DecoderForCausalLM, rate: float, connectors: tuple[KVConnectorBase, ...] = (), max_num_seqs: int = 8
) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model="test", max_model_len=1024),
        cache=CacheConfig(block_size=BLOCK, num_gpu_blocks_override=256),
        scheduler=SchedulerConfig(max_num_seqs, 1024, True, verify_sample_rate=rate),
    )
    return LLMEngine(config, model, None, "test", torch.device("cpu"), connectors)


def test_a_cache_hit_is_recomputed_cold_and_agrees(model: DecoderForCausalLM) -> None:
    engine = make_engine(model, rate=1.0)
    cold = run_to_completion(engine, {"cold": PROMPT}, GREEDY)["cold"]
    assert engine.get_stats().exactness_checks == {}  # computed everything itself: nothing to check
    warm = run_to_completion(engine, {"warm": PROMPT}, GREEDY)  # the shadow runs after it, in the same loop
    assert list(warm) == ["warm"] and warm["warm"][0].num_cached_tokens == len(PROMPT) - 1
    assert tokens_of(warm["warm"]) == tokens_of(cold)
    stats = engine.get_stats()
    assert stats.exactness_checks == {"prefix_cache": 1} and stats.exactness_mismatches == {}
    assert engine.pool.num_free_blocks == engine.pool.num_blocks  # the shadow left nothing behind
    assert stats.num_prompt_tokens == 2 * len(PROMPT)  # its tokens are no client's
    assert stats.num_generation_tokens == 2 * GREEDY.max_tokens


def test_a_seeded_answer_whose_stops_were_held_off_agrees_with_its_shadow(model: DecoderForCausalLM) -> None:
    """Below ``min_tokens`` EOS and the stop token ids cannot be drawn: the shadow holds them off as the original
    did, so every draw samples from the same distribution (a flat one here, where one token's share moves it)."""
    stops = tuple(range(10, 60))
    sampled = SamplingParams(max_tokens=40, min_tokens=30, temperature=3.0, seed=5, stop_token_ids=stops)
    engine = make_engine(model, rate=1.0)
    run_to_completion(engine, {"cold": PROMPT}, sampled)
    for i in range(4):
        run_to_completion(engine, {f"warm-{i}": PROMPT}, dataclasses.replace(sampled, seed=i))
    stats = engine.get_stats()
    assert stats.exactness_checks == {"prefix_cache": 4} and stats.exactness_mismatches == {}


def test_the_shadow_waits_while_a_client_request_waits(model: DecoderForCausalLM) -> None:
    engine = make_engine(model, rate=1.0, max_num_seqs=1)
    run_to_completion(engine, {"cold": PROMPT}, GREEDY)
    engine.add_request("warm", PROMPT, GREEDY)
    while "warm" in engine.requests:
        engine.step()
    assert len(engine.scheduler.shadows) == 1  # queued as "warm" finished
    engine.add_request("client", random_prompts(1, 40, 40, seed=12)["r0"], GREEDY)  # nothing of it cached
    while "client" in engine.requests:  # the client's request goes first, and the shadow waits for room
        engine.step()
        assert not any(r.is_shadow for r in engine.scheduler.running)
    assert len(engine.scheduler.shadows) == 1
    engine.step()  # nothing waits: the shadow starts
    assert [r.is_shadow for r in engine.scheduler.running] == [True]
    engine.add_request("another", random_prompts(1, 30, 30, seed=13)["r0"], GREEDY)
    engine.step()  # a client arrived: the shadow gives its seat back
    assert [r.request_id for r in engine.scheduler.running] == ["another"] and len(engine.scheduler.shadows) == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats().exactness_checks == {"prefix_cache": 1}


def test_no_sample_no_check(model: DecoderForCausalLM) -> None:
    engine = make_engine(model, rate=0.0)
    run_to_completion(engine, {"cold": PROMPT}, GREEDY)
    run_to_completion(engine, {"warm": PROMPT}, GREEDY)
    assert engine.verifier is None and engine.get_stats().exactness_checks == {}


def test_a_resumed_stream_is_replayed_from_the_original_prompt(model: DecoderForCausalLM) -> None:
    """What the router's migration sends: the prompt and the tokens generated so far, and the prompt's length."""
    engine = make_engine(model, rate=1.0)
    cold = tokens_of(run_to_completion(make_engine(model, rate=0.0), {"cold": PROMPT}, GREEDY)["cold"])
    rest = dataclasses.replace(GREEDY, max_tokens=GREEDY.max_tokens - 15, resumed_prompt_tokens=len(PROMPT))
    resumed = tokens_of(run_to_completion(engine, {"resumed": PROMPT + cold[:15]}, rest)["resumed"])
    assert cold[:15] + resumed == cold
    assert engine.get_stats().exactness_checks == {"migration": 1}
    assert engine.get_stats().exactness_mismatches == {}


def test_a_corrupted_l2_record_is_caught_counted_and_logged(
    model: DecoderForCausalLM, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Worker A stores the prompt's records; one is then rewritten with other values and a valid checksum (what
    a bug in a KV path would leave): worker B serves from it, a wrong answer, and its check says so."""
    layout = kv_cache_layout(model, BLOCK)
    writer = KVConnector(make_store(layout, DiskTier(tmp_path, 1 << 30)), MODEL_ID, layout, chunk_size=CHUNK)
    engine_a = make_engine(model, rate=0.0, connectors=(writer,))
    cold = tokens_of(run_to_completion(engine_a, {"a": PROMPT}, GREEDY)["a"])
    assert writer.store.flush(timeout_s=10)
    engine_a.close()

    disk = DiskTier(tmp_path, 1 << 30)
    key = record_keys(layout, PROMPT)[2]  # the third chunk: its layers' values scaled
    (record,) = disk.get_many([key])
    assert record is not None
    kv = serde.decode(record, layout).clone()
    kv[:, 1] *= 1.5
    signer = serde.RecordSigner.for_secret(None, MODEL_ID, layout)
    disk.put(key, signer.encode(kv, kv.shape[2], key))
    disk.close()

    reader = KVConnector(make_store(layout, DiskTier(tmp_path, 1 << 30), l1=False), MODEL_ID, layout, chunk_size=CHUNK)
    engine_b = make_engine(model, rate=1.0, connectors=(reader,))
    with caplog.at_level(logging.ERROR, logger="splitserve.engine.verifier"):
        served = run_to_completion(engine_b, {"b": PROMPT}, GREEDY)["b"]
    assert dict(served[0].cached_tokens_by_source)["l2"] > 0
    assert tokens_of(served) != cold  # the corrupted KV changed the answer...
    stats = engine_b.get_stats()
    assert stats.exactness_checks == {"l2": 1} and stats.exactness_mismatches == {"l2": 1}  # ...and it was caught
    (message,) = [r.getMessage() for r in caplog.records]
    first = next(i for i, (a, b) in enumerate(zip(tokens_of(served), cold, strict=True)) if a != b)
    assert f"request b (path l2) differs from its cold recompute at output position {first}" in message
    metrics = WorkerMetrics("test")
    metrics.set_engine_stats(stats)
    text = metrics.render().decode()
    assert sum_samples(text, "splitserve:exactness_mismatches_total", path="l2") == 1
    assert sum_samples(text, "splitserve:exactness_checks_total", path="pd") == 0  # every path is listed
    engine_b.close()

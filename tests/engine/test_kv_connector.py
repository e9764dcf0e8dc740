"""The engine with a KV connector over L1 (memory) and L2 (a disk directory): another engine ("another worker",
same weights) answers a long prompt from L2 with the cold run's greedy output and bit-identical KV; bad
records are misses; the decode role saves nothing unless asked; a stuck L2 never blocks the engine."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import quote

import pytest
import torch

from splitserve.config import CacheConfig, EngineConfig, KVTierConfig, L2Backend, ModelConfig, Role, SchedulerConfig
from splitserve.engine.connector import KVLoad, LoadedTokens
from splitserve.engine.engine import LLMEngine, kv_cache_layout
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.sampling_params import SamplingParams
from splitserve.keys import hash_blocks, hash_of_key, kv_layout
from splitserve.kvcache import serde
from splitserve.kvcache.connector import KVConnector, build_connector
from splitserve.kvcache.cpu import CPUTier
from splitserve.kvcache.disk import DiskTier
from splitserve.kvcache.store import TieredStore
from splitserve.metrics import WorkerMetrics, sum_samples
from splitserve.model.decoder import DecoderForCausalLM
from splitserve.protocol.kv_events import Tier
from tests.support.engine import build_engine, random_prompts, run_to_completion, tokens_of
from tests.support.kv_store import BLOCK, CHUNK, MODEL_ID, chunk_keys, make_store, record_keys

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
PROMPT = random_prompts(1, 200, 200, seed=7)["r0"]  # 6 whole chunks loadable: (200 - 1) // 32


@pytest.fixture(scope="module")
def layout(tiny_model: DecoderForCausalLM) -> str:
    return kv_cache_layout(tiny_model, BLOCK)


@pytest.fixture(scope="module")
def cold_tokens(tiny_model: DecoderForCausalLM) -> list[int]:
    return tokens_of(run_to_completion(build_engine(tiny_model), {"r": PROMPT}, GREEDY)["r"])


def make_engine(
    model: DecoderForCausalLM, connector: KVConnector, max_num_batched_tokens: int = 1024, num_blocks: int = 256
) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model="test", max_model_len=min(1024, num_blocks * BLOCK)),
        cache=CacheConfig(block_size=BLOCK, num_gpu_blocks_override=num_blocks),
        scheduler=SchedulerConfig(64, max_num_batched_tokens, True),
    )
    return LLMEngine(config, model, None, "test", torch.device("cpu"), [connector])


def first_worker_stores(
    model: DecoderForCausalLM, layout: str, l2_dir: Path, cold: list[int], prompt: list[int] = PROMPT
) -> int:
    """Worker A: computes ``prompt``, saves its records to L1 and the disk L2, and flushes; returns the records."""
    connector = KVConnector(make_store(layout, DiskTier(l2_dir, 1 << 30)), MODEL_ID, layout, chunk_size=CHUNK)
    engine_a = make_engine(model, connector)
    assert tokens_of(run_to_completion(engine_a, {"a": prompt}, GREEDY)["a"]) == cold
    assert connector.store.flush(timeout_s=10)
    engine_a.close()
    return connector.stats().num_saved_chunks


def loaded_slots(engine: LLMEngine, request_id: str, num_tokens: int) -> torch.Tensor:
    """The request's KV as held in the engine's paged cache: [layers, 2, num_tokens, heads, dim]."""
    ids = engine.kv.block_ids(request_id)
    slots = torch.tensor([ids[p // BLOCK] * BLOCK + p % BLOCK for p in range(num_tokens)])
    return engine.runner.kv_cache.index_select(2, slots)


def step_until_admitted(engine: LLMEngine, request_id: str) -> list[RequestOutput]:
    """Step until the request is admitted: its L2 records are read on the connector's prefetch thread first."""
    outputs: list[RequestOutput] = []
    for _ in range(5000):
        outputs.extend(engine.step())
        if engine.requests[request_id].num_cached_tokens >= 0:
            return outputs
    raise AssertionError(f"{request_id} was never admitted")


def stored_kv(l2_dir: Path, layout: str, keys: list[str]) -> torch.Tensor:
    records = [(l2_dir / (quote(k, safe="") + ".kv")).read_bytes() for k in keys]
    return torch.cat([serde.decode(r, layout) for r in records], dim=2)


def test_another_worker_answers_from_l2_with_identical_output_and_kv(
    tiny_model: DecoderForCausalLM, layout: str, cold_tokens: list[int], tmp_path: Path
) -> None:
    first_worker_stores(tiny_model, layout, tmp_path, cold_tokens)
    connector = KVConnector(make_store(layout, DiskTier(tmp_path, 1 << 30)), MODEL_ID, layout, chunk_size=CHUNK)
    engine_b = make_engine(tiny_model, connector, max_num_batched_tokens=64)  # the rest is computed in chunks
    engine_b.add_request("b", PROMPT, GREEDY)
    outputs = step_until_admitted(engine_b, "b")  # admission loads 6 chunks (192 tokens), computes the last 8
    num_loaded = 6 * CHUNK
    assert engine_b.requests["b"].cached_tokens_by_source == (("engine", 0), ("l2", num_loaded))
    expected_kv = stored_kv(tmp_path, layout, chunk_keys(layout, PROMPT)[:6])
    assert torch.equal(loaded_slots(engine_b, "b", num_loaded), expected_kv)  # bit-identical to what A stored

    while engine_b.has_unfinished_requests():
        outputs.extend(engine_b.step())
    assert tokens_of(outputs) == cold_tokens
    assert outputs[-1].num_cached_tokens == num_loaded
    kv = engine_b.get_stats().kv_cache
    assert kv is not None and (kv.num_hit_tokens, kv.num_hit_tokens_l2, kv.num_lookup_hits) == (192, 192, 192)
    assert kv.num_lookup_tokens == len(PROMPT) and kv.tiers["disk"].num_hits == 6
    assert kv.num_saved_chunks == 0  # everything it could save came from the cache

    # the chunks were promoted into B's L1: with the engine's own prefix cache emptied, L1 serves them
    engine_b.pool.reset_prefix_cache()
    again = run_to_completion(engine_b, {"b2": PROMPT}, GREEDY)["b2"]
    assert tokens_of(again) == cold_tokens and again[-1].num_cached_tokens == num_loaded
    assert engine_b.get_stats().kv_cache.num_hit_tokens_l1 == num_loaded  # type: ignore[union-attr]
    engine_b.close()


def test_engine_prefix_then_tiers_resume_mid_chunk(
    tiny_model: DecoderForCausalLM, layout: str, cold_tokens: list[int], tmp_path: Path
) -> None:
    """The engine's own cache holds 48 tokens (mid-chunk); the tiers supply the rest of chunk 1 onwards."""
    first_worker_stores(tiny_model, layout, tmp_path, cold_tokens)
    connector = KVConnector(make_store(layout, DiskTier(tmp_path, 1 << 30)), MODEL_ID, layout, chunk_size=CHUNK)
    engine_b = make_engine(tiny_model, connector)
    engine_b.connectors = ()  # compute a 49-token prefix without the tiers, so the engine caches 3 blocks
    engine_b.scheduler.connectors = ()
    run_to_completion(engine_b, {"short": PROMPT[:49]}, SamplingParams(max_tokens=1))
    engine_b.connectors = engine_b.scheduler.connectors = (connector,)
    out = run_to_completion(engine_b, {"b": PROMPT}, GREEDY)["b"]
    assert tokens_of(out) == cold_tokens and out[-1].num_cached_tokens == 6 * CHUNK
    kv = connector.stats()
    assert (kv.num_lookup_tokens, kv.num_hit_tokens_l2) == (len(PROMPT) - 48, 6 * CHUNK - 48)
    assert (kv.num_vllm_hit_tokens, kv.num_requested_tokens) == (48, 6 * CHUNK - 48)  # LMCache's counters
    stats = engine_b.get_stats()  # vLLM's: the engine's 48 tokens are its prefix cache's, the rest external
    assert (stats.prefix_cache_hits, stats.external_prefix_cache_queries) == (48, len(PROMPT) - 48)
    assert stats.external_prefix_cache_hits == 6 * CHUNK - 48
    assert stats.cached_tokens_by_source == {"engine": 48, "l2": 6 * CHUNK - 48}
    engine_b.close()


@pytest.mark.parametrize(
    ("num_tokens", "num_records"),
    [
        (245, 8),  # 7 chunks + a 1-block tail [224, 240); 5 tokens past the last full block
        (240, 8),  # the tail's last block holds the final token: loaded up to it, which is computed
        (256, 8),  # 8 whole chunks, no tail; the last chunk is loaded up to the final token
        (207, 6),  # 6 whole chunks and no full block after them
    ],
)
def test_another_worker_computes_less_than_a_block_of_any_prompt(
    tiny_model: DecoderForCausalLM, layout: str, tmp_path: Path, num_tokens: int, num_records: int
) -> None:
    prompt = random_prompts(1, num_tokens, num_tokens, seed=num_tokens)["r0"]
    cold = tokens_of(run_to_completion(build_engine(tiny_model), {"r": prompt}, GREEDY)["r"])
    assert first_worker_stores(tiny_model, layout, tmp_path, cold, prompt) == num_records
    connector = KVConnector(make_store(layout, DiskTier(tmp_path, 1 << 30)), MODEL_ID, layout, chunk_size=CHUNK)
    engine_b = make_engine(tiny_model, connector)
    engine_b.add_request("b", prompt, GREEDY)
    out = step_until_admitted(engine_b, "b")  # loads every full block but never the final token; computes the rest
    num_loaded = min(num_tokens // BLOCK * BLOCK, num_tokens - 1)
    expected_kv = stored_kv(tmp_path, layout, record_keys(layout, prompt))[:, :, :num_loaded]
    assert torch.equal(loaded_slots(engine_b, "b", num_loaded), expected_kv)
    while engine_b.has_unfinished_requests():
        out.extend(engine_b.step())
    assert tokens_of(out) == cold
    assert out[-1].num_cached_tokens == num_loaded and num_tokens - num_loaded < BLOCK
    assert connector.stats().num_hit_tokens_l2 == num_loaded
    assert connector.stats().num_saved_chunks == 0  # every record it could save came from L2

    engine_b.pool.reset_prefix_cache()  # now B's L1 (promoted records) serves the whole run, tail included
    again = run_to_completion(engine_b, {"b2": prompt}, GREEDY)["b2"]
    assert tokens_of(again) == cold and connector.stats().num_hit_tokens_l1 == num_loaded
    engine_b.close()


def test_a_longer_prompt_loads_the_tail_of_a_shorter_one(
    tiny_model: DecoderForCausalLM, layout: str, tmp_path: Path
) -> None:
    """A follow-up turn: its chunk 7 was never stored whole, but the first turn's tail [224, 240) was."""
    first_turn = random_prompts(1, 245, 245, seed=245)["r0"]
    follow_up = first_turn + random_prompts(1, 40, 40, seed=1)["r0"]
    cold_first, cold = (
        tokens_of(run_to_completion(build_engine(tiny_model), {"r": p}, GREEDY)["r"]) for p in (first_turn, follow_up)
    )
    first_worker_stores(tiny_model, layout, tmp_path, cold_first, first_turn)
    connector = KVConnector(make_store(layout, DiskTier(tmp_path, 1 << 30)), MODEL_ID, layout, chunk_size=CHUNK)
    out = run_to_completion(make_engine(tiny_model, connector), {"b": follow_up}, GREEDY)["b"]
    assert tokens_of(out) == cold and out[-1].num_cached_tokens == 240
    assert connector.stats().num_saved_chunks == 2  # chunk 7 whole (its tail was loaded) and chunk 8's tail


@pytest.mark.parametrize("fault", ["bit_flip_in_l2", "foreign_layout_in_l2", "bit_flip_in_l1"])
def test_a_bad_record_is_a_miss_with_identical_output(
    tiny_model: DecoderForCausalLM, layout: str, cold_tokens: list[int], tmp_path: Path, fault: str
) -> None:
    first_worker_stores(tiny_model, layout, tmp_path, cold_tokens)
    keys = chunk_keys(layout, PROMPT)
    bad_path = tmp_path / (quote(keys[2], safe="") + ".kv")
    record = bytearray(bad_path.read_bytes())
    if fault == "foreign_layout_in_l2":
        kv = serde.decode(bytes(record), layout)
        record = bytearray(serde.encode(kv.to(torch.bfloat16), CHUNK, kv_layout("bfloat16", 2, 2, 16, BLOCK)))
    else:
        record[-1] ^= 0x01
    if fault != "bit_flip_in_l1":
        bad_path.write_bytes(bytes(record))
    store = make_store(layout, DiskTier(tmp_path, 1 << 30))  # B's disk index is built from the directory
    if fault == "bit_flip_in_l1":  # L1 is trusted by the store; the connector's own decode must catch it
        for k in keys[:2]:
            store.l1.put(k, (tmp_path / (quote(k, safe="") + ".kv")).read_bytes())
        store.l1.put(keys[2], bytes(record))
    connector = KVConnector(store, MODEL_ID, layout, chunk_size=CHUNK)
    engine_b = make_engine(tiny_model, connector)
    out = run_to_completion(engine_b, {"b": PROMPT}, GREEDY)["b"]
    assert tokens_of(out) == cold_tokens
    assert out[-1].num_cached_tokens == 2 * CHUNK  # chunks 0 and 1; recomputed from chunk 2 on
    assert connector.stats().num_invalid_records == 1
    engine_b.close()


def l1_holding(tmp_path: Path, layout: str) -> TieredStore:
    """An L1-only store holding the records a first worker wrote to ``tmp_path``: answered at once, no prefetch."""
    store = make_store(layout, None)
    for key in chunk_keys(layout, PROMPT):
        store.l1.put(key, (tmp_path / (quote(key, safe="") + ".kv")).read_bytes())
    return store


def test_a_load_that_comes_up_short_is_rolled_back_and_computed(
    tiny_model: DecoderForCausalLM, layout: str, cold_tokens: list[int], tmp_path: Path
) -> None:
    """The copy into the KV cache fails at the third chunk (a tensor copy error): the runner leaves the request
    out of that step's pass, the engine rolls it back to the two chunks really loaded and computes the rest.
    The request admitted beside it runs on, and the counts take only what was loaded."""
    first_worker_stores(tiny_model, layout, tmp_path, cold_tokens)
    connector = KVConnector(l1_holding(tmp_path, layout), MODEL_ID, layout, chunk_size=CHUNK)
    write, num_writes = connector._write_slots, [0]

    def third_write_fails(block_ids: list[int], start: int, end: int, kv: torch.Tensor) -> None:
        num_writes[0] += 1
        if num_writes[0] == 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        write(block_ids, start, end, kv)

    connector._write_slots = third_write_fails  # type: ignore[method-assign]
    other = random_prompts(1, 30, 30, seed=5)["r0"]
    other_cold = tokens_of(run_to_completion(build_engine(tiny_model), {"o": other}, GREEDY)["o"])
    engine = make_engine(tiny_model, connector)
    engine.add_request("b", PROMPT, GREEDY)
    engine.add_request("o", other, GREEDY)
    outputs = engine.step()  # admits both: "b" loading 6 chunks, of which 2 arrive
    assert [o.request_id for o in outputs] == ["o"]  # "b" sampled nothing on a context half missing
    assert (engine.requests["b"].num_computed_tokens, engine.requests["b"].num_output_tokens) == (2 * CHUNK, 0)
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    got = {rid: [o for o in outputs if o.request_id == rid] for rid in ("b", "o")}
    assert tokens_of(got["b"]) == cold_tokens and tokens_of(got["o"]) == other_cold
    assert got["b"][-1].num_cached_tokens == 2 * CHUNK
    assert got["b"][-1].cached_tokens_by_source == (("engine", 0), ("l1", 2 * CHUNK))
    stats = engine.get_stats()
    assert stats.external_prefix_cache_hits == 2 * CHUNK and stats.cached_tokens_by_source == {"engine": 0, "l1": 64}
    kv = stats.kv_cache
    assert kv is not None and (kv.num_requested_tokens, kv.num_hit_tokens, kv.num_invalid_records) == (192, 64, 1)
    engine.close()


class BrokenLoads(KVConnector):
    """A connector whose runner-side copy has a bug."""

    def load_kv(self, load: KVLoad) -> LoadedTokens:
        raise RuntimeError("a bug in a connector")


def test_a_load_that_raises_is_computed_instead(
    tiny_model: DecoderForCausalLM,
    layout: str,
    cold_tokens: list[int],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    first_worker_stores(tiny_model, layout, tmp_path, cold_tokens)
    engine = make_engine(tiny_model, BrokenLoads(l1_holding(tmp_path, layout), MODEL_ID, layout, chunk_size=CHUNK))
    with caplog.at_level(logging.ERROR, logger="splitserve.engine"):
        out = run_to_completion(engine, {"b": PROMPT}, GREEDY)["b"]
    assert tokens_of(out) == cold_tokens and out[-1].num_cached_tokens == 0
    assert engine.get_stats().external_prefix_cache_hits == 0
    assert any("KV load of b from BrokenLoads failed" in r.getMessage() for r in caplog.records)
    engine.close()


def test_the_decode_role_saves_nothing_unless_asked(tiny_model: DecoderForCausalLM, layout: str) -> None:
    prompt = random_prompts(1, 40, 40, seed=3)["r0"]  # 2 prompt chunks of 16; 40 + 9 computed tokens: 3 chunks
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

    def num_stored(role: Role, save_decode_cache: bool) -> int:
        config = KVTierConfig(l1_cache=True, kv_chunk_size=BLOCK, save_decode_cache=save_decode_cache)
        connector = build_connector(config, MODEL_ID, layout, role)
        run_to_completion(make_engine(tiny_model, connector), {"r": prompt}, params)
        return connector.store.l1.stats().num_puts

    assert num_stored(Role.DECODE, save_decode_cache=False) == 0
    assert num_stored(Role.DECODE, save_decode_cache=True) == 3
    assert num_stored(Role.COLOCATED, save_decode_cache=False) == 2
    assert num_stored(Role.PREFILL, save_decode_cache=True) == 3


def test_shared_prefixes_under_preemption_match_an_engine_without_tiers(
    tiny_model: DecoderForCausalLM, layout: str
) -> None:
    """Few KV blocks and an engine prefix cache emptied after every step: admissions load from L1."""
    shared = list(random_prompts(2, 96, 96, seed=11).values())
    suffixes = random_prompts(8, 20, 70, seed=12)
    prompts = {rid: shared[i % 2] + suffix for i, (rid, suffix) in enumerate(suffixes.items())}
    params = SamplingParams(max_tokens=16, temperature=0.0)
    expected = run_to_completion(build_engine(tiny_model), prompts, params)
    connector = KVConnector(make_store(layout, None), MODEL_ID, layout, chunk_size=CHUNK)
    engine = make_engine(tiny_model, connector, max_num_batched_tokens=96, num_blocks=24)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
        engine.pool.reset_prefix_cache()
    assert got == {r: tokens_of(o) for r, o in expected.items()}
    assert engine.scheduler.num_preemptions > 0 and connector.stats().num_hit_tokens_l1 > 0


class StuckTier(CPUTier):
    """An L2 whose writes hang until released (a Redis that stopped answering)."""

    def __init__(self) -> None:
        super().__init__(max_bytes=1 << 30, name="stuck")
        self.release = threading.Event()

    def put(self, key: str, value: bytes) -> None:
        self.release.wait(timeout=30)
        super().put(key, value)


def test_a_full_store_queue_never_blocks_the_engine(
    tiny_model: DecoderForCausalLM, layout: str, cold_tokens: list[int]
) -> None:
    l2 = StuckTier()
    record_bytes = len(serde.encode(torch.zeros(2, 2, CHUNK, 2, 16), CHUNK, layout))
    connector = KVConnector(make_store(layout, l2, max_pending=2 * record_bytes), MODEL_ID, layout, chunk_size=CHUNK)
    engine = make_engine(tiny_model, connector)
    started = time.monotonic()
    assert tokens_of(run_to_completion(engine, {"r": PROMPT}, GREEDY)["r"]) == cold_tokens
    assert time.monotonic() - started < 10  # the writer is stuck on the first chunk; nobody waits for it
    stats = engine.get_stats().kv_cache
    assert stats is not None and stats.num_saved_chunks == 6 and stats.num_queue_drops >= 3
    metrics = WorkerMetrics("m")
    metrics.set_engine_stats(engine.get_stats())
    text = metrics.render().decode()
    assert f'splitserve:kv_store_queue_drops_total{{model_name="m"}} {float(stats.num_queue_drops)}' in text
    assert f'lmcache:num_stored_tokens_total{{model_name="m"}} {6.0 * CHUNK}' in text  # handed over, if dropped
    l2.release.set()
    engine.close()


def test_worker_metrics_expose_the_kv_cache_names(
    tiny_model: DecoderForCausalLM, layout: str, cold_tokens: list[int], tmp_path: Path
) -> None:
    first_worker_stores(tiny_model, layout, tmp_path, cold_tokens)
    connector = KVConnector(make_store(layout, DiskTier(tmp_path, 1 << 30)), MODEL_ID, layout, chunk_size=CHUNK)
    engine = make_engine(tiny_model, connector)
    run_to_completion(engine, {"b": PROMPT}, GREEDY)
    metrics = WorkerMetrics("m")
    metrics.set_engine_stats(engine.get_stats())
    text = metrics.render().decode()
    for line in (  # LMCache's names and meanings: one lookup of the 200 tokens, one retrieve of the 192 found
        'lmcache:num_lookup_requests_total{model_name="m"} 1.0',
        f'lmcache:num_lookup_tokens_total{{model_name="m"}} {float(len(PROMPT))}',
        'lmcache:num_lookup_hits_total{model_name="m"} 192.0',
        'lmcache:lookup_0_hit_requests_total{model_name="m"} 0.0',
        'lmcache:num_retrieve_requests_total{model_name="m"} 1.0',
        'lmcache:num_requested_tokens_total{model_name="m"} 192.0',
        'lmcache:num_hit_tokens_total{model_name="m"} 192.0',
        'lmcache:num_vllm_hit_tokens_total{model_name="m"} 0.0',  # a fresh engine's prefix cache held none of it
        f'lmcache:num_prompt_tokens_total{{model_name="m"}} {float(len(PROMPT))}',
        'lmcache:request_cache_hit_rate_bucket{le="0.9",model_name="m"} 0.0',  # 192 / 200 = 0.96
        'lmcache:request_cache_hit_rate_bucket{le="1.0",model_name="m"} 1.0',
        'lmcache:retrieve_speed_count{model_name="m"} 1.0',
        f'vllm:external_prefix_cache_queries_total{{engine="0",model_name="m"}} {float(len(PROMPT))}',
        'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 192.0',
        'vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="disk"} 192.0',
        'vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="device"} 0.0',
        'splitserve:kv_tier_hits_total{model_name="m",tier="disk"} 6.0',
        'splitserve:kv_tier_misses_total{model_name="m",tier="cpu"} 6.0',
        'splitserve:kv_tier_errors_total{model_name="m",tier="disk"} 0.0',
        'splitserve:kv_store_queue_drops_total{model_name="m"} 0.0',
    ):
        assert line in text, line
    assert 'splitserve:kv_tier_bytes_stored{model_name="m",tier="cpu"}' in text
    assert 'splitserve:kv_tier_bytes_stored{model_name="m",tier="disk"}' in text
    assert 'lmcache:local_cache_usage{model_name="m"}' in text and 'lmcache:local_storage_usage{model_name="m"}' in text
    engine.close()


def test_tier_config_is_validated() -> None:
    with pytest.raises(ValueError, match="needs --l2-url"):
        KVTierConfig(l2_backend=L2Backend.REDIS).validate(BLOCK)
    with pytest.raises(ValueError, match="needs --l2-path"):
        KVTierConfig(l2_backend=L2Backend.TIEREDSTORAGE).validate(BLOCK)
    with pytest.raises(ValueError, match="multiple of --block-size"):
        KVTierConfig(l1_cache=True, kv_chunk_size=40).validate(BLOCK)
    with pytest.raises(ValueError, match="only used with --l2-backend redis"):
        KVTierConfig(l2_url="redis://x:1/0").validate(BLOCK)


def test_an_unreachable_redis_at_start_is_degraded_mode(
    tiny_model: DecoderForCausalLM, layout: str, cold_tokens: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as sock:  # a port nobody listens on: connections are refused at once
        sock.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{sock.getsockname()[1]}/0"
    config = KVTierConfig(l1_cache=True, l2_backend=L2Backend.REDIS, l2_url=url, kv_chunk_size=CHUNK)
    with caplog.at_level(logging.INFO, logger="splitserve.kvcache"):
        connector = build_connector(config, MODEL_ID, layout)
    assert any("degraded mode (recompute)" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)
    assert not any("initialized successfully" in r.getMessage() for r in caplog.records)
    engine = make_engine(tiny_model, connector)
    assert tokens_of(run_to_completion(engine, {"r": PROMPT}, GREEDY)["r"]) == cold_tokens
    engine.close()
    assert connector.stats().tiers["redis"].num_errors > 0


def test_l1_only_logs_its_size(layout: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="splitserve.kvcache"):
        build_connector(KVTierConfig(l1_cache=True, l1_cache_bytes=1 << 30), MODEL_ID, layout).close()
    assert any(
        "LMCacheManager initialized successfully: L1 cpu 1.00 GiB, L2 off" in r.getMessage() for r in caplog.records
    )


class RecordingSink:
    """A ``KVEventSink`` that keeps what each tier holds."""

    def __init__(self) -> None:
        self.held: dict[Tier, set[int]] = {tier: set() for tier in Tier}

    def stored(self, tier: Tier, hashes: Iterable[int]) -> None:
        self.held[tier].update(hashes)

    def removed(self, tier: Tier, hashes: Iterable[int]) -> None:
        self.held[tier].difference_update(hashes)


def test_lookup_and_events_name_what_each_tier_holds(
    tiny_model: DecoderForCausalLM, layout: str, cold_tokens: list[int], tmp_path: Path
) -> None:
    first_worker_stores(tiny_model, layout, tmp_path, cold_tokens)  # L2 holds PROMPT's records
    sink = RecordingSink()
    store = TieredStore(CPUTier(64 << 20), DiskTier(tmp_path, 1 << 30), events=sink)
    connector = KVConnector(store, MODEL_ID, layout, chunk_size=CHUNK)
    config = EngineConfig(
        model=ModelConfig(model="test", max_model_len=1024),
        cache=CacheConfig(block_size=BLOCK, num_gpu_blocks_override=256),
    )
    engine = LLMEngine(config, tiny_model, None, "test", torch.device("cpu"), [connector], sink)
    loadable = (len(PROMPT) - 1) // BLOCK * BLOCK  # L2 holds the tail too, so every full block but the last token
    assert engine.lookup_prefix(PROMPT) == {"engine": 0, "l1": 0, "l2": loadable}

    other = random_prompts(1, 40, 40, seed=99)["r0"]
    run_to_completion(engine, {"o": other}, GREEDY)
    assert set(hash_blocks(other, BLOCK)) <= sink.held[Tier.ENGINE]  # its prompt's blocks (and generated ones)
    assert engine.lookup_prefix([*other, 1, 2, 3])["engine"] == 32  # two full blocks of the 40-token prompt

    assert tokens_of(run_to_completion(engine, {"p": PROMPT}, GREEDY)["p"]) == cold_tokens  # loads from L2
    assert engine.lookup_prefix(PROMPT)["engine"] == (len(PROMPT) - 1) // BLOCK * BLOCK
    promoted = {hash_of_key(k) for k in record_keys(layout, PROMPT)}
    assert promoted <= sink.held[Tier.L1]  # L2 hits were promoted into L1
    engine.pool.reset_prefix_cache()
    assert not sink.held[Tier.ENGINE]
    assert engine.lookup_prefix(PROMPT) == {"engine": 0, "l1": loadable, "l2": 0}
    engine.close()


def test_a_request_waiting_for_its_l2_records_is_deferred(
    tiny_model: DecoderForCausalLM, layout: str, cold_tokens: list[int], tmp_path: Path
) -> None:
    """vllm:num_requests_waiting_by_reason: while the prefetch thread reads its records, the request is deferred."""
    first_worker_stores(tiny_model, layout, tmp_path, cold_tokens)
    connector = KVConnector(make_store(layout, DiskTier(tmp_path, 1 << 30)), MODEL_ID, layout, chunk_size=CHUNK)
    release, read = threading.Event(), connector.store.get_prefix

    def slow(keys: list[str]) -> list[bytes]:
        release.wait(timeout=30)
        return read(keys)

    connector.store.get_prefix = slow  # type: ignore[method-assign]
    engine = make_engine(tiny_model, connector)
    engine.add_request("b", PROMPT, GREEDY)
    engine.step()
    metrics = WorkerMetrics("m")
    metrics.set_engine_stats(engine.get_stats())
    text = metrics.render().decode()
    by_reason = "vllm:num_requests_waiting_by_reason"
    assert sum_samples(text, by_reason, reason="deferred") == 1 and sum_samples(text, by_reason, reason="capacity") == 0
    release.set()
    step_until_admitted(engine, "b")
    assert engine.get_stats().num_waiting_deferred == 0
    engine.close()


def test_a_prefetch_that_fails_is_a_miss_and_the_engine_lives(
    tiny_model: DecoderForCausalLM, layout: str, cold_tokens: list[int], tmp_path: Path
) -> None:
    first_worker_stores(tiny_model, layout, tmp_path, cold_tokens)
    connector = KVConnector(make_store(layout, DiskTier(tmp_path, 1 << 30)), MODEL_ID, layout, chunk_size=CHUNK)

    def broken(keys: object) -> list[bytes]:
        raise RuntimeError("an L2 bug")

    connector.store.get_prefix = broken  # type: ignore[method-assign]
    engine_b = make_engine(tiny_model, connector)
    outputs = run_to_completion(engine_b, {"b": PROMPT}, GREEDY)["b"]
    assert tokens_of(outputs) == cold_tokens and outputs[-1].num_cached_tokens == 0

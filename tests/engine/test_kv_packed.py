"""The packed KV caches (``--kv-cache-dtype int8`` and ``fp8``, ``model/kv_format.py``): the native and PyTorch
quantizers write the same bytes; attention over a packed cache is, bit for bit, attention over a bfloat16 cache
holding the same values; its records and PD pushes move those bytes unchanged between engines of the format, and
are misses for an engine of another. The same tokens on every path with it: ``test_batch_invariance.py``
(kernels, tiny model) and ``test_exactness.py`` (the real model)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from splitserve.config import CacheConfig, EngineConfig, KVCacheDtype, ModelConfig, SchedulerConfig
from splitserve.engine.connector import KVConnectorBase
from splitserve.engine.engine import LLMEngine, kv_bytes_per_token, kv_cache_layout
from splitserve.engine.sampling_params import SamplingParams
from splitserve.kvcache import serde
from splitserve.kvcache.connector import KVConnector
from splitserve.kvcache.disk import DiskTier
from splitserve.model import kv_format
from splitserve.model.decoder import DecoderForCausalLM
from splitserve.model.kernels import NativeKernels, native
from splitserve.pd.buffer import PDBuffer
from splitserve.pd.receiver import KVReceiver, PDReceiverConnector
from splitserve.pd.sender import PDSenderConnector
from splitserve.protocol.kv_transfer import KVTransferParams
from tests.support.engine import random_prompts, run_to_completion, tokens_of
from tests.support.kv_store import BLOCK, CHUNK, MODEL_ID, chunk_keys, make_store
from tests.support.quant import quantize_model

PACKED = {KVCacheDtype.INT8: torch.int8, KVCacheDtype.FP8: torch.uint8}
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPT = random_prompts(1, 150, 150, seed=21)["r0"]


def awkward_rows() -> torch.Tensor:
    """Rows of every magnitude, and the edge cases: zeros, inf, NaN, subnormals, ties at the rounding step."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(600, 3, 64, generator=gen) * torch.logspace(-40, 33, 600)[:, None, None]
    x[:, 1, 16:32] *= 1000  # an outlier group: the row's other groups keep their own scale
    x[1] = 0.0
    x[2, 0, 5], x[2, 1, 7], x[2, 2, 9] = float("inf"), float("-inf"), float("nan")
    x[3] = 1e-42  # subnormal
    x[4, 0] = torch.cat([torch.tensor([126.5]), torch.arange(15) + 0.5]).repeat(4)  # int8, scale 1: ties to even
    x[4, 1] = (torch.arange(64) % 16 - 8) * 8.0  # amax 64: int8 scale 1 (64 <= 127), values exact
    x[4, 2] = 127.0  # max |x| = 127 exactly: int8 scale 1
    # fp8, scale 1 (amax 448): 17 and 19 halfway between E4M3 neighbours (16 | 18, 18 | 20), 2.25 * 2^-9 and
    # 0.5 * 2^-9 between subnormals, 7.5 * 2^-9 between the last subnormal and 2^-6
    x[5, 0, :8] = torch.tensor([448.0, 17.0, 19.0, -17.0, 2.5 * 2**-9, 0.5 * 2**-9, 7.5 * 2**-9, 1.0])
    return x


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8], ids=["int8", "fp8"])
def test_the_native_and_pytorch_quantizers_write_the_same_bytes(kernels: NativeKernels, dtype: torch.dtype) -> None:
    """On every build this CPU runs: each has its own vector code for the codes."""
    x = awkward_rows()
    rows = kernels.quantize_kv(x.contiguous(), dtype)
    assert rows is not None and rows.shape == (600, 3, 68) and rows.dtype == dtype
    assert torch.equal(rows, kv_format.quantize_rows(x, dtype))
    assert torch.equal(
        kv_format.quantize_rows(x.bfloat16(), dtype), kv_format.quantize_rows(x.bfloat16().float(), dtype)
    )


def test_an_int8_group_is_within_half_a_step_and_exactly_a_bfloat16() -> None:
    x = awkward_rows()[6:]
    rows = kv_format.quantize_rows(x)
    values = kv_format.dequantize_rows(rows, torch.float32)
    groups, got = x.unflatten(-1, (4, 16)), values.unflatten(-1, (4, 16))
    scale = torch.ldexp(torch.ones(()), rows[..., 64:].float())[..., None]  # a power of two per group of 16
    amax = groups.abs().amax(-1, keepdim=True)
    assert torch.all(scale >= 2.0**-126) and torch.all((got - groups).abs() <= scale / 2)
    assert torch.all(amax <= 127 * scale) and torch.all((amax > 63.5 * scale) | (scale == 2.0**-126))  # the least
    assert torch.equal(values.bfloat16().float(), values)
    assert rows[..., :64].abs().max() <= 127
    exponents = rows[:, 1, 64:].long()  # head 1's outlier group has its own scale; the others keep theirs
    assert torch.all((exponents[:, 1] - exponents[:, 0] >= 8) | (exponents[:, 0] == -126))
    edge = kv_format.dequantize_rows(kv_format.quantize_rows(awkward_rows()[:5]), torch.float32)
    assert torch.all(edge[1] == 0) and torch.isfinite(edge).all()
    assert edge[2, 0, 5] > 0 and edge[2, 1, 7] < 0 and edge[2, 2, 9] == 0  # inf saturates, NaN is zero
    assert torch.equal(edge[4, 0], awkward_rows()[4, 0].round())  # 126.5 -> 126, 0.5 -> 0, 1.5 -> 2, 2.5 -> 2
    assert torch.equal(edge[4, 1], awkward_rows()[4, 1]) and torch.equal(edge[4, 2], torch.full((64,), 127.0))


def test_an_fp8_group_is_e4m3_times_its_least_scale_and_exactly_a_bfloat16() -> None:
    x = awkward_rows()[6:]
    rows = kv_format.quantize_rows(x, torch.uint8)
    values = kv_format.dequantize_rows(rows, torch.float32)
    groups, got = x.unflatten(-1, (4, 16)), values.unflatten(-1, (4, 16))
    scale = torch.ldexp(torch.ones(()), rows[..., 64:].view(torch.int8).float())[..., None]
    amax = groups.abs().amax(-1, keepdim=True)
    assert torch.all(scale >= 2.0**-117) and torch.all(amax <= 448 * scale)
    assert torch.all((amax > 224 * scale) | (scale == 2.0**-117))  # the least such power of two
    normal = groups.abs() >= 2**-6 * scale  # E4M3's normal range: 3 mantissa bits, half a step at most 2^-4
    assert torch.all(((got - groups).abs() <= 2**-4 * groups.abs()) | ~normal)
    assert torch.all(((got - groups).abs() <= 2**-10 * scale) | normal)  # subnormals: half of 2^-9
    assert torch.equal(values.bfloat16().float(), values)
    edge = kv_format.dequantize_rows(kv_format.quantize_rows(awkward_rows()[:6], torch.uint8), torch.float32)
    assert torch.all(edge[1] == 0) and torch.isfinite(edge).all()
    assert edge[2, 0, 5] > 0 and edge[2, 1, 7] < 0 and edge[2, 2, 9] == 0  # inf saturates, NaN is zero
    expected = [448.0, 16.0, 20.0, -16.0, 2 * 2**-9, 0.0, 8 * 2**-9, 1.0]  # ties to the even E4M3 neighbour
    assert edge[5, 0, :8].tolist() == expected


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8], ids=["int8", "fp8"])
def test_attention_over_packed_rows_is_attention_over_the_same_values_in_bfloat16(
    kernels: NativeKernels, dtype: torch.dtype
) -> None:
    """Decode rows (split mode) and a prefill chunk (tiles) alike, on every build this CPU runs. Each group's
    values span six decades, so that fp8 rows hold subnormal codes and zeros beside normal ones."""
    gen = torch.Generator().manual_seed(11)
    slots, heads, kv_heads, head_dim = 1024, 9, 3, 64
    spread = torch.logspace(-6, 0, 16).repeat(head_dim // 16)
    k = kv_format.quantize_rows(torch.randn(slots, kv_heads, head_dim, generator=gen) * 3 * spread, dtype)
    v = kv_format.quantize_rows(torch.randn(slots, kv_heads, head_dim, generator=gen) * spread, dtype)
    kb, vb = kv_format.dequantize_rows(k, torch.bfloat16), kv_format.dequantize_rows(v, torch.bfloat16)
    table = torch.randperm(slots // BLOCK, generator=gen)[None].contiguous()
    q = torch.randn(700, heads, head_dim, generator=gen).bfloat16()
    lens = torch.arange(1, 701)
    scale = head_dim**-0.5
    chunk = kernels.paged_attention(q, k, v, table, lens, BLOCK, scale, torch.zeros(700, dtype=torch.long))
    same = kernels.paged_attention(q, kb, vb, table, lens, BLOCK, scale, torch.zeros(700, dtype=torch.long))
    assert chunk is not None and same is not None and torch.equal(chunk, same)
    rows = torch.tensor([0, 15, 255, 256, 699])
    decode = kernels.paged_attention(q[rows], k, v, table.expand(5, -1).contiguous(), lens[rows], BLOCK, scale)
    assert decode is not None and torch.equal(decode, chunk[rows])
    assert kernels.paged_attention(q.float(), k, v, table, lens, BLOCK, scale) is None  # packed: bfloat16 q only


@pytest.fixture(scope="module")
def model(tiny_model: DecoderForCausalLM) -> DecoderForCausalLM:
    """The tiny model on the GGUF's Q4_1 blocks: every step in the native forward step."""
    kernels = native()
    assert kernels is not None
    return quantize_model(tiny_model, kernels, 3)


def engine_with(model: DecoderForCausalLM, dtype: KVCacheDtype, connector: KVConnectorBase | None = None) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model="test", max_model_len=1024),
        cache=CacheConfig(block_size=BLOCK, num_gpu_blocks_override=128, kv_cache_dtype=dtype),
        scheduler=SchedulerConfig(64, 64, True),  # the prompt in chunks of 64
    )
    engine = LLMEngine(config, model, None, "test", torch.device("cpu"), [connector] if connector else [])
    assert engine.runner.model.runs_forward_step
    return engine


def slots_of(engine: LLMEngine, request_id: str, num_tokens: int) -> torch.Tensor:
    ids = engine.kv.block_ids(request_id) or [b.block_id for b in engine.pool.blocks]
    slots = torch.tensor([ids[p // BLOCK] * BLOCK + p % BLOCK for p in range(num_tokens)])
    return engine.runner.kv_cache.index_select(2, slots)


def test_a_packed_cache_takes_about_half_the_bytes_and_names_its_format(model: DecoderForCausalLM) -> None:
    cfg = model.config
    row = cfg.head_dim + cfg.head_dim // 16
    for name in ("int8", "fp8", "fp8_e4m3"):
        assert kv_bytes_per_token(model, name) == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * row
    assert kv_bytes_per_token(model, "auto") == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    layouts = {kv_cache_layout(model, BLOCK, name) for name in ("auto", "int8", "fp8", "fp8_e4m3")}
    assert {layout.split("-")[0] for layout in layouts} == {"float32", "int8", "fp8_e4m3"}  # fp8 is fp8_e4m3
    for name, dtype in PACKED.items():
        engine = engine_with(model, name)
        assert engine.runner.kv_cache.shape[-1] == row and engine.runner.kv_cache.dtype == dtype


@pytest.mark.parametrize("name", list(PACKED))
def test_a_packed_record_moves_between_engines_of_its_format_and_is_a_miss_for_another(
    model: DecoderForCausalLM, tmp_path: Path, name: KVCacheDtype
) -> None:
    layout = kv_cache_layout(model, BLOCK, name)
    cold = tokens_of(run_to_completion(engine_with(model, name), {"c": PROMPT}, GREEDY)["c"])
    connector = KVConnector(make_store(layout, DiskTier(tmp_path, 1 << 30)), MODEL_ID, layout, chunk_size=CHUNK)
    first = engine_with(model, name, connector)
    assert tokens_of(run_to_completion(first, {"a": PROMPT}, GREEDY)["a"]) == cold
    assert connector.store.flush(timeout_s=10) and connector.stats().num_saved_chunks == 5  # 4 chunks, a tail
    first.close()
    keys = chunk_keys(layout, PROMPT)[:4]
    record = (tmp_path / next(p.name for p in tmp_path.iterdir() if p.suffix == ".kv")).read_bytes()
    assert serde.read_header(record).dtype == PACKED[name]

    # another worker of the format: loads the chunks and the tail (144 tokens), bit for bit, and answers as cold
    reader = KVConnector(make_store(layout, DiskTier(tmp_path, 1 << 30)), MODEL_ID, layout, chunk_size=CHUNK)
    second = engine_with(model, name, reader)
    outputs = run_to_completion(second, {"b": PROMPT}, GREEDY)["b"]
    assert tokens_of(outputs) == cold and outputs[-1].num_cached_tokens == 144
    stored = torch.cat([serde.decode(store_record(tmp_path, key), layout) for key in keys], dim=2)
    assert torch.equal(slots_of(second, "b", 4 * CHUNK), stored)

    # a worker of another format asks for other keys (its layout): nothing of these records is read
    for other_name in (KVCacheDtype.AUTO, *(n for n in PACKED if n != name)):
        other = kv_cache_layout(model, BLOCK, other_name)
        assert not set(chunk_keys(other, PROMPT)) & set(chunk_keys(layout, PROMPT))
        with pytest.raises(serde.RecordError):
            serde.decode(record, other)


def store_record(directory: Path, key: str) -> bytes:
    from urllib.parse import quote

    return (directory / (quote(key, safe="") + ".kv")).read_bytes()


@pytest.mark.parametrize("name", list(PACKED))
def test_a_packed_push_arrives_bit_identical_and_decode_answers_as_colocated(
    model: DecoderForCausalLM, name: KVCacheDtype
) -> None:
    layout = kv_cache_layout(model, BLOCK, name)
    colocated = tokens_of(run_to_completion(engine_with(model, name), {"c": PROMPT}, GREEDY)["c"])
    buffer = PDBuffer(64 << 20)
    receiver = KVReceiver(buffer, layout)
    receiver.start()
    try:
        prefiller = engine_with(model, name, PDSenderConnector(layout))
        params = dataclasses.replace(GREEDY, max_tokens=1, kv_transfer=KVTransferParams("t-8", receiver.addr))
        outputs = run_to_completion(prefiller, {"p": PROMPT}, params)["p"]
        result = outputs[-1].kv_transfer_result.result(timeout=30)
        assert result.ok and result.num_tokens == len(PROMPT)
        entry = buffer.peek("t-8")
        assert entry is not None
        header = serde.read_header(entry.record)  # packed rows of head_dim + head_dim / 16 bytes, not float32 ones
        assert header.dtype == PACKED[name] and header.payload_nbytes == math.prod((2, 2, len(PROMPT), 2, 16 + 1))
        assert torch.equal(serde.decode(entry.record, layout), slots_of(prefiller, "p", len(PROMPT)))
        decoder = engine_with(model, name, PDReceiverConnector(buffer, layout))
        first = outputs[0].new_token_ids[0]
        params = dataclasses.replace(GREEDY, kv_transfer=KVTransferParams("t-8", first_token_id=first))
        assert tokens_of(run_to_completion(decoder, {"d": PROMPT}, params)["d"]) == colocated
    finally:
        receiver.close()


@pytest.mark.parametrize("name", list(PACKED))
def test_the_module_path_stores_and_reads_packed_rows_too(tiny_model: DecoderForCausalLM, name: KVCacheDtype) -> None:
    """A float model without quantized blocks (PyTorch's matmuls and attention over the widened rows): it runs, from
    the prefix cache too, and its cache holds rows of the format."""
    engine = engine_with_model_path(tiny_model, name)
    assert not engine.runner.model.runs_forward_step
    outputs = run_to_completion(engine, {"a": PROMPT}, GREEDY)["a"]
    again = run_to_completion(engine, {"b": PROMPT}, GREEDY)["b"]
    assert len(tokens_of(outputs)) == GREEDY.max_tokens and again[0].num_cached_tokens == len(PROMPT) - 1
    values = kv_format.dequantize_rows(slots_of(engine, "b", len(PROMPT)), torch.float32)
    assert torch.equal(values.bfloat16().float(), values) and values.abs().sum() > 0  # rows the format holds


def engine_with_model_path(model: DecoderForCausalLM, name: KVCacheDtype) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model="test", max_model_len=1024),
        cache=CacheConfig(block_size=BLOCK, num_gpu_blocks_override=128, kv_cache_dtype=name),
    )
    return LLMEngine(config, model, None, "test", torch.device("cpu"))

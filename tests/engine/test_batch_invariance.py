"""Batch invariance of every kernel build this CPU runs (the portable scalar one always; NEON under qemu in
``test_quant_kernels.py``): a row's result is the same bits whatever rows run beside it, however they are
grouped and however many threads run them. That is what makes a token's K/V and logits the same on every path
(``csrc/forward_step.c``)."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from splitserve.config import KVCacheDtype
from splitserve.engine.sampling_params import SamplingParams
from splitserve.model import kv_format
from splitserve.model.decoder import DecoderForCausalLM
from splitserve.model.kernels import QUANT_TYPES, NativeKernels
from tests.support.engine import build_engine, run_to_completion, tokens_of
from tests.support.quant import SUPER_BLOCK_TYPES, gguf_rows, model_for, quantize_model

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield request.param
    finally:
        torch.set_num_threads(before)


def _sequence(
    length: int, dtype: torch.dtype, heads: int = HEADS, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A cache holding one sequence of ``length`` tokens in shuffled blocks, and a query for each position (a
    packed cache, int8 or uint8 for fp8: its rows, kv_format.py's, and bfloat16 queries)."""
    gen = torch.Generator().manual_seed(length)
    num_blocks = -(-length // BLOCK) + 3
    k = torch.randn(num_blocks * BLOCK, kv_heads, head_dim, generator=gen).mul_(2)
    v = torch.randn(num_blocks * BLOCK, kv_heads, head_dim, generator=gen)
    table = torch.randperm(num_blocks, generator=gen)[None, : -(-length // BLOCK)].contiguous()
    q = torch.randn(length, heads, head_dim, generator=gen)
    if dtype in kv_format.PACKED:
        return kv_format.quantize_rows(k, dtype), kv_format.quantize_rows(v, dtype), table, q.bfloat16()
    return k.to(dtype), v.to(dtype), table, q.to(dtype)


# SmolLM2's heads; Llama-3.2-1B's (a group of 4 over 8 KV heads); a group of 16, a whole amx tile for one row's
# heads; a group of 4 over head_dim 96 (the value pass's plain loop); a group of 7 over 128 (Qwen2.5's)
SHAPES = [(HEADS, KV_HEADS, HEAD_DIM), (32, 8, 64), (16, 1, 64), (8, 2, 96), (14, 2, 128)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.uint8])
def test_an_attention_row_is_the_same_over_blocks_of_8_and_of_16(
    kernels: NativeKernels, threads: int, dtype: torch.dtype
) -> None:
    """The block size only addresses the cache (the amx build's decode rows read K in place from blocks of 16
    and copy it from smaller ones): decode rows and a prefill chunk give the same bits over either."""
    length = 300
    k, v, _, q = _sequence(length, dtype)
    scale = HEAD_DIM**-0.5
    lens = torch.arange(1, length + 1)
    positions = torch.tensor([0, 7, 8, 15, 16, 31, 32, 150, 299])
    outs = []
    for block in (16, 8):
        table = torch.arange(-(-length // block))[None]  # slot = position
        chunk = kernels.paged_attention(q, k, v, table, lens, block, scale, torch.zeros(length, dtype=torch.long))
        rows = kernels.paged_attention(q[positions], k, v, table.expand(len(positions), -1).contiguous(),
                                       lens[positions], block, scale)  # fmt: skip
        assert chunk is not None and rows is not None and torch.equal(rows, chunk[positions])
        outs.append(chunk)
    assert torch.equal(outs[0], outs[1])


# every shape in float32 and bfloat16; the packed rows (widened to bfloat16 per partition, the same code after that)
# in SmolLM2's shape, and int8 in head size 96's too (six exponent groups)
DTYPE_SHAPES = [
    *((dtype, shape) for dtype in (torch.float32, torch.bfloat16) for shape in SHAPES),
    (torch.int8, SHAPES[0]),
    (torch.int8, SHAPES[3]),
    (torch.uint8, SHAPES[0]),
]


@pytest.mark.parametrize(
    ("dtype", "shape"),
    DTYPE_SHAPES,
    ids=[f"{str(t).removeprefix('torch.')}-{h}x{kv}x{d}" for t, (h, kv, d) in DTYPE_SHAPES],
)
def test_an_attention_row_is_the_same_alone_in_a_chunk_and_beside_other_sequences(
    kernels: NativeKernels, threads: int, dtype: torch.dtype, shape: tuple[int, int, int]
) -> None:
    """A prefill chunk's tiles (on AVX-512, their rows as the vector lanes), chunks beside a decode row and rows
    alone (split mode) give each row the same bits."""
    length = 700  # three partitions, the last a partial one
    k, v, table, q = _sequence(length, dtype, *shape)
    scale = shape[2] ** -0.5
    lens = torch.arange(1, length + 1)
    # the whole prompt as one prefill chunk (tiles of queries)
    whole = kernels.paged_attention(q, k, v, table, lens, BLOCK, scale, torch.zeros(length, dtype=torch.long))
    assert whole is not None
    # chunks of 37 queries, each beside a decode row of another sequence (its table: the same blocks reversed);
    # chunks of 5 too, whose rows and query heads share a tile where the build packs a short chunk's heads
    # into one (the amx build's tiles of 16 lanes); and of 150, too few rows for full tiles on every thread
    tables = torch.cat([table, table.flip(1)]).contiguous()
    sizes = [(start, 37) for start in range(0, length, 37)] + [(start, 5) for start in (0, 30, 250, 695)]
    for start, size in [*sizes, (0, 150), (550, 150)]:
        rows = torch.arange(start, min(start + size, length))
        batch_q = torch.cat([q[rows], q[:1]])
        batch_lens = torch.cat([lens[rows], torch.tensor([length])])
        row_seq = torch.cat([torch.zeros(len(rows), dtype=torch.long), torch.ones(1, dtype=torch.long)])
        out = kernels.paged_attention(batch_q, k, v, tables, batch_lens, BLOCK, scale, row_seq)
        assert out is not None
        assert torch.equal(out[: len(rows)], whole[rows]), f"chunk at {start}"
    # two prefill chunks of different sequences in one call (the second reads the same blocks in reverse)
    other = kernels.paged_attention(q[300:340], k, v, table.flip(1).contiguous(), lens[300:340], BLOCK, scale,
                                    torch.zeros(40, dtype=torch.long))  # fmt: skip
    pair = kernels.paged_attention(torch.cat([q[100:137], q[300:340]]), k, v, tables,
                                   torch.cat([lens[100:137], lens[300:340]]), BLOCK, scale,
                                   torch.cat([torch.zeros(37), torch.ones(40)]).long())  # fmt: skip
    assert other is not None and pair is not None
    assert torch.equal(pair[:37], whole[100:137]) and torch.equal(pair[37:], other)
    # a decode step of many sequences (here views of one at different lengths), more than the threads
    positions = torch.tensor([0, 15, 16, 255, 256, 257, 511, 699])
    step = kernels.paged_attention(q[positions], k, v, table.expand(len(positions), -1).contiguous(),
                                   lens[positions], BLOCK, scale)  # fmt: skip
    assert step is not None and torch.equal(step, whole[positions])
    # rows alone, as decodes: the first and last of a block, of a partition, the very first and last
    for position in (0, 15, 16, 255, 256, 257, 511, 699):
        alone = kernels.paged_attention(q[position : position + 1], k, v, table, lens[position : position + 1],
                                        BLOCK, scale)  # fmt: skip
        assert alone is not None and torch.equal(alone[0], whole[position]), position


@functools.cache
def _windowed_reference(length: int, dtype: torch.dtype, window: int, softcap: float | None) -> torch.Tensor:
    """What ``_sequence(length, dtype)``'s queries should get in float64: each over its last ``window`` keys, the
    scaled scores soft-capped when ``softcap`` is given."""
    k, v, table, q = _sequence(length, dtype)
    slots = (table[0][:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:length]
    keys, values = (kv_format.dequantize_rows(c, torch.float64) if dtype in kv_format.PACKED else c.double()
                    for c in (k, v))  # fmt: skip
    group = HEADS // KV_HEADS
    keys, values = (c[slots].repeat_interleave(group, dim=1).transpose(0, 1) for c in (keys, values))  # [H, L, D]
    scores = torch.einsum("lhd,hmd->hlm", q.double(), keys) * HEAD_DIM**-0.5
    if softcap is not None:
        scores = (scores / softcap).tanh() * softcap
    position = torch.arange(length)
    seen = (position[None, :] <= position[:, None]) & (position[None, :] > position[:, None] - window)
    return torch.einsum("hlm,hmd->lhd", scores.masked_fill(~seen, float("-inf")).softmax(-1), values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize(("window", "softcap"), [(300, None), (300, 1.5)], ids=["window", "window-softcap"])
def test_a_sliding_window_row_attends_to_its_window_alone_the_same_on_every_path(
    kernels: NativeKernels, threads: int, dtype: torch.dtype, window: int, softcap: float | None
) -> None:
    """With a window of 300 over 700 positions, windows start before position 0, inside a partition and on a
    partition's first key (position 555: 256 .. 555); each row matches a float64 softmax over its window (its scores
    soft-capped, as Gemma 2's), and gives the same bits in a whole chunk (tiles), in chunks beside another
    sequence's row, and alone (split)."""
    length = 700
    k, v, table, q = _sequence(length, dtype)
    scale = HEAD_DIM**-0.5
    lens = torch.arange(1, length + 1)
    zeros = torch.zeros(length, dtype=torch.long)
    capped = {"window": window, "softcap": softcap}
    whole = kernels.paged_attention(q, k, v, table, lens, BLOCK, scale, zeros, **capped)
    assert whole is not None
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (whole.double() - _windowed_reference(length, dtype, window, softcap)).abs().max().item() < tolerance
    tables = torch.cat([table, table.flip(1)]).contiguous()
    for start, size in [(0, 37), (250, 37), (530, 37), (550, 150)]:
        rows = torch.arange(start, min(start + size, length))
        out = kernels.paged_attention(torch.cat([q[rows], q[:1]]), k, v, tables,
                                      torch.cat([lens[rows], torch.tensor([length])]), BLOCK, scale,
                                      torch.cat([zeros[: len(rows)], torch.ones(1, dtype=torch.long)]),
                                      **capped)  # fmt: skip
        assert out is not None and torch.equal(out[: len(rows)], whole[rows]), f"chunk at {start}"
    for at in (0, 298, 299, 300, 511, 554, 555, 556, 699):
        alone = kernels.paged_attention(q[at : at + 1], k, v, table, lens[at : at + 1], BLOCK, scale, **capped)
        assert alone is not None and torch.equal(alone[0], whole[at]), at
    # a window as long as the context is no window: the same bits
    full = kernels.paged_attention(q, k, v, table, lens, BLOCK, scale, zeros, window=length, softcap=softcap)
    plain = kernels.paged_attention(q, k, v, table, lens, BLOCK, scale, zeros, softcap=softcap)
    assert full is not None and plain is not None and torch.equal(full, plain)


@pytest.mark.parametrize("wtype", sorted(QUANT_TYPES))
def test_a_quantized_matmul_row_is_the_same_at_any_row_count(kernels: NativeKernels, threads: int, wtype: int) -> None:
    """1 to 4 rows take the integer kernels' row tiles; 5 and more the AMX tiles (``amx``) or the 512-bit VNNI
    tiles (``avx512``; Q6_K keeps the row tiles); 72 weight rows end in half a 16-row tile."""
    rng = np.random.default_rng(wtype)
    k = 512 if wtype in SUPER_BLOCK_TYPES else 128
    rows = gguf_rows(rng.normal(0, 0.3, (72, k)), wtype)
    packed = kernels.pack(rows.rows, wtype, k)
    x = torch.from_numpy(rng.normal(0, 1, (37, k)).astype(np.float32))
    whole = kernels.quant_matmul(x, packed)
    assert whole is not None
    for count in (1, 2, 4, 5, 16, 17):
        for start in (0, 37 - count):
            part = kernels.quant_matmul(x[start : start + count], packed)
            assert part is not None and torch.equal(part, whole[start : start + count]), (count, start)


def test_dot_rows_is_the_same_at_any_row_count(kernels: NativeKernels, threads: int) -> None:
    gen = torch.Generator().manual_seed(5)
    x, weight = torch.randn(9, 576, generator=gen), torch.randn(300, 576, generator=gen)
    picks = torch.randint(0, 300, (9, 32), generator=gen)
    whole = kernels.dot_rows(x, weight, picks)
    assert whole is not None
    torch.testing.assert_close(whole, torch.einsum("nd,nkd->nk", x, weight[picks]), rtol=1e-5, atol=1e-4)
    for i in range(9):
        alone = kernels.dot_rows(x[i : i + 1], weight, picks[i : i + 1].contiguous())
        assert alone is not None and torch.equal(alone[0], whole[i]), i


@pytest.mark.parametrize(("wtype", "kv_cache_dtype"), [(3, "auto"), ("Q4_K_M", "auto"), (3, "int8"), (3, "fp8")])
def test_the_forward_step_gives_each_token_the_same_logits_on_every_path(
    tiny_model: DecoderForCausalLM, k_sized_model: DecoderForCausalLM, kernels: NativeKernels, threads: int,
    wtype: int | str, kv_cache_dtype: KVCacheDtype,
) -> None:  # fmt: skip
    """A tiny quantized model through whole engines: one prompt's tokens and logits alone, chunked by 7, beside
    other requests, and from the prefix cache, to the bit (Q4_1; and Q4_K_M's mix of Q4_K and Q6_K, with a mixed
    fused q/k/v; and Q4_1 over an int8 and an fp8 KV cache)."""
    base, formats = model_for(wtype, tiny_model, k_sized_model)
    model = quantize_model(base, kernels, formats)
    prompt = [int(t) for t in torch.randint(1, 500, (83,), generator=torch.Generator().manual_seed(9))]
    others = {f"o{i}": [int(t) for t in torch.randint(1, 500, (20 + 9 * i,))] for i in range(4)}
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    def run(
        engine_kwargs: dict[str, int], batch: dict[str, list[int]], repeat: bool = False
    ) -> tuple[list[int], list[torch.Tensor]]:
        logits: list[torch.Tensor] = []
        engine = build_engine(model, kv_cache_dtype=kv_cache_dtype, **engine_kwargs)
        expected = {"int8": torch.int8, "fp8": torch.uint8}.get(kv_cache_dtype, torch.float32)
        assert engine.runner.kv_cache.dtype == expected
        compute = model.compute_logits
        model.compute_logits = lambda hidden: logits.append(compute(hidden)) or logits[-1]  # type: ignore[method-assign]
        try:
            if repeat:
                run_to_completion(engine, {"first": prompt}, params)
                logits.clear()
            outputs = run_to_completion(engine, {"p": prompt, **batch}, params)
        finally:
            del model.compute_logits
        if repeat:  # everything but the last prompt token came from the cache
            assert outputs["p"][0].num_cached_tokens == len(prompt) - 1
        return tokens_of(outputs["p"]), logits

    alone_tokens, alone_logits = run({}, {})
    for label, kwargs, batch, repeat in (
        ("chunks of 7", {"max_num_batched_tokens": 7, "step_time_target": 0}, {}, False),
        ("beside others", {}, others, False),
        ("from the prefix cache", {}, {}, True),
    ):
        tokens, logits = run(kwargs, batch, repeat)
        assert tokens == alone_tokens, label
        if not batch:  # one request: the same logits step by step (with others, each step has more rows)
            assert len(logits) == len(alone_logits) and all(
                torch.equal(a, b) for a, b in zip(logits, alone_logits, strict=True)
            ), label

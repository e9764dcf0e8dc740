"""The native CPU kernels (decode and prefill attention, add + RMSNorm, SiLU x up, rotary) against PyTorch."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import splitserve.engine.model_runner as model_runner
import splitserve.model.attention as attention
import splitserve.model.decoder as decoder
import splitserve.model.kernels as kernels_module
from splitserve.engine.sampling_params import SamplingParams
from splitserve.model.attention import DecodeBatch, PrefillChunk, ScoreRule
from splitserve.model.decoder import DecoderForCausalLM
from splitserve.model.kernel_build import CpuInfo, detect_cpu, select_level
from splitserve.model.kernels import NativeKernels, kernels_for, native
from tests.support.engine import build_engine, run_to_completion

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def _cache(num_blocks: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks * BLOCK, KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention of q [Q, H, D] over k/v [C, Hkv, D] in float64, causal from the end."""
    num_q, num_ctx, group = q.shape[0], k.shape[0], HEADS // KV_HEADS
    k = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, C, D]
    v = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) / math.sqrt(HEAD_DIM)  # [H, Q, C]
    future = torch.ones(num_q, num_ctx, dtype=torch.bool).triu_(num_ctx - num_q + 1)
    scores.masked_fill_(future, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)  # [Q, H, D]


def _decode_batch(lengths: list[int], num_blocks: int) -> DecodeBatch:
    """Block tables drawn at random from the cache, so sequences interleave as they do in the engine."""
    max_blocks = -(-max(lengths) // BLOCK)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1))
    table = torch.zeros(len(lengths), max_blocks, dtype=torch.long)
    used = 0
    for i, n in enumerate(lengths):
        nb = -(-n // BLOCK)
        table[i, :nb] = perm[used : used + nb]
        used += nb
    return DecodeBatch(table, torch.tensor(lengths, dtype=torch.long), BLOCK)


def _context(k_cache: torch.Tensor, decode: DecodeBatch, row: int) -> torch.Tensor:
    n = int(decode.context_lens[row])
    slots = (decode.block_tables[row][:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:n]
    return k_cache[slots]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "lengths",
    [
        [1, 15, 16, 17, 300, 2500 // 16 * 3 + 5],  # a single token, block edges, a long one
        [164],  # one stream with a short context: split into partitions of a few blocks, so both threads work
        [17],  # split into one whole block and a partial one
    ],
)
def test_decode_kernel_matches_reference_and_torch_path(
    kernels: NativeKernels, dtype: torch.dtype, lengths: list[int]
) -> None:
    k_cache, v_cache = _cache(200, dtype)
    decode = _decode_batch(lengths, 200)
    # q as the model produces it: a strided view of the fused q/k projection
    qk = torch.randn(len(lengths), HEADS + KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(2)).to(dtype)
    q = qk[:, :HEADS]
    scale = HEAD_DIM**-0.5
    out = kernels.paged_attention(q, k_cache, v_cache, decode.block_tables, decode.context_lens, BLOCK, scale)
    assert out is not None and out.dtype == dtype and out.shape == (len(lengths), HEADS, HEAD_DIM)
    torch_out = attention._decode_attention_torch(q, k_cache, v_cache, decode, ScoreRule(scale))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for row in range(len(lengths)):
        ref = _reference(q[row : row + 1], _context(k_cache, decode, row), _context(v_cache, decode, row))[0]
        assert torch.allclose(out[row].double(), ref, atol=tol), row
    assert torch.allclose(out.float(), torch_out.float(), atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pytorch_paths_take_a_sliding_window_and_a_soft_cap_as_the_kernel_does(
    kernels: NativeKernels, dtype: torch.dtype
) -> None:
    """The padded decode and the chunk's SDPA (the fallbacks, and the float model's prefill) mask the positions
    before each row's window and cap the scores, as the native kernel does."""
    k_cache, v_cache = _cache(80, dtype)
    lengths, window, cap = [5, 40, 300, 700], 37, 1.5
    decode = _decode_batch(lengths, 80)
    q = torch.randn(len(lengths), HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(3)).to(dtype)
    scale, tol = HEAD_DIM**-0.5, 1e-5 if dtype == torch.float32 else 2e-2
    for softcap in (None, cap):
        native_out = kernels.paged_attention(q, k_cache, v_cache, decode.block_tables, decode.context_lens, BLOCK,
                                             scale, window=window, softcap=softcap)  # fmt: skip
        torch_out = attention._decode_attention_torch(q, k_cache, v_cache, decode, ScoreRule(scale, window, softcap))
        assert native_out is not None and torch.allclose(native_out.float(), torch_out.float(), atol=tol)
    # a chunk of the last 50 positions of the 700-token sequence, its rows as decodes of that sequence
    row = lengths.index(700)
    slots = (decode.block_tables[row][:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:700]
    chunk_q = torch.randn(50, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(4)).to(dtype)
    table = decode.block_tables[row : row + 1].expand(50, -1).contiguous()
    for softcap in (None, cap):
        got = attention._prefill_attention(chunk_q, k_cache, v_cache, PrefillChunk(50, slots, 700),
                                           ScoreRule(scale, window, softcap))  # fmt: skip
        rows = kernels.paged_attention(chunk_q, k_cache, v_cache, table, torch.arange(651, 701), BLOCK, scale,
                                       window=window, softcap=softcap)  # fmt: skip
        assert rows is not None and torch.allclose(got.float(), rows.float(), atol=tol)


def test_decode_kernel_declines_what_it_cannot_take(kernels: NativeKernels) -> None:
    k_cache, v_cache = _cache(4, torch.float16)
    decode = _decode_batch([10], 4)
    q = torch.randn(1, HEADS, HEAD_DIM, dtype=torch.float16)
    assert kernels.paged_attention(q, k_cache, v_cache, decode.block_tables, decode.context_lens, BLOCK, 1.0) is None
    # the attention entry point then takes the PyTorch path
    out = attention._decode_attention(q, k_cache, v_cache, decode, ScoreRule(1.0))
    assert out.shape == (1, HEADS, HEAD_DIM)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_q", "num_ctx"), [(40, 40), (7, 300), (1, 33)])
def test_prefill_attention_matches_reference(dtype: torch.dtype, num_q: int, num_ctx: int) -> None:
    k_cache, v_cache = _cache(32, dtype)
    slots = torch.randperm(32 * BLOCK, generator=torch.Generator().manual_seed(3))[:num_ctx]
    q = torch.randn(num_q, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(4)).to(dtype)
    out = attention._prefill_attention(
        q, k_cache, v_cache, PrefillChunk(num_q, slots, num_ctx), ScoreRule(HEAD_DIM**-0.5)
    )
    ref = _reference(q, k_cache[slots], v_cache[slots])
    assert torch.allclose(out.double(), ref, atol=1e-5 if dtype == torch.float32 else 2e-2)


# shapes around the kernel's edges: one query, a partial block of 16 queries, keys in blocks of 32 with a
# partial last one, a whole causal chunk, a chunk over a cached prefix, the last chunk of a 2,500-token prompt
PREFILL_SHAPES = [(1, 1), (5, 5), (17, 40), (16, 33), (100, 100), (33, 1000), (300, 301), (452, 2500)]


@pytest.fixture(scope="module")
def amx_kernels() -> NativeKernels:
    """The amx build, the one with the prefill attention kernel. A CPU without AMX skips what needs it: no
    emulator (Intel SDE) can be had here, so this kernel's arithmetic is tested only on AMX machines, while
    every level is still compiled with -Werror everywhere (test_kernel_build.py)."""
    level = next((lv for lv in detect_cpu().levels if lv.name == "amx"), None)
    if level is None:
        pytest.skip("needs a CPU with AMX (amx_tile, amx_bf16, amx_int8): the prefill kernel is the amx build's")
    built = kernels_for(level)
    if built is None:
        pytest.fail("the amx kernels did not build")
    return built


def _prefill_case(num_q: int, num_ctx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    num_blocks = -(-(num_ctx + 40) // BLOCK)
    k_cache, v_cache = _cache(num_blocks, torch.bfloat16, seed=num_ctx)
    k_cache.mul_(3)  # peaked scores, so that the running max moves and the accumulators get rescaled
    gen = torch.Generator().manual_seed(num_q)
    slots = torch.randperm(num_blocks * BLOCK, generator=gen)[:num_ctx]
    qkv = torch.randn(num_q, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    return qkv[:, :HEADS], k_cache, v_cache, slots  # q: strided rows, as the model passes them


@pytest.mark.parametrize(("num_q", "num_ctx"), PREFILL_SHAPES)
def test_prefill_attention_kernel_matches_reference(amx_kernels: NativeKernels, num_q: int, num_ctx: int) -> None:
    """The AMX kernel against a float64 reference, as close to it as PyTorch's bf16 flash kernel."""
    q, k_cache, v_cache, slots = _prefill_case(num_q, num_ctx)
    out = amx_kernels.prefill_attention(q, k_cache, v_cache, slots, HEAD_DIM**-0.5)
    assert out is not None
    ref = _reference(q, k_cache[slots], v_cache[slots])
    sdpa = attention._prefill_attention(
        q, k_cache, v_cache, PrefillChunk(num_q, slots, num_ctx), ScoreRule(HEAD_DIM**-0.5)
    ) if num_q > 4 else out  # fmt: skip
    ours, theirs = (out.double() - ref).abs().max(), (sdpa.double() - ref).abs().max()
    assert ours < 3e-2 and ours <= 1.25 * theirs + 1e-3, (ours, theirs)  # as close as PyTorch's bf16 flash kernel


@pytest.mark.parametrize("level", [lv.name for lv in detect_cpu().levels if lv.name != "amx"])
def test_builds_without_amx_leave_prefill_attention_to_sdpa(level: str) -> None:
    built = kernels_for(next(lv for lv in detect_cpu().levels if lv.name == level))
    assert built is not None
    q, k_cache, v_cache, slots = _prefill_case(17, 40)
    assert built.prefill_attention(q, k_cache, v_cache, slots, HEAD_DIM**-0.5) is None


def test_prefill_attention_kernel_declines_what_it_cannot_take(kernels: NativeKernels) -> None:
    k_cache, v_cache = _cache(4, torch.bfloat16)
    slots = torch.arange(20)
    q = torch.randn(20, HEADS, HEAD_DIM).bfloat16()
    assert kernels.prefill_attention(q.float(), k_cache.float(), v_cache.float(), slots, 1.0) is None
    assert kernels.prefill_attention(q, k_cache, v_cache, slots.int(), 1.0) is None
    wide = torch.randn(64, KV_HEADS, 128).bfloat16()  # head size 128: not one this kernel takes
    assert kernels.prefill_attention(torch.randn(20, HEADS, 128).bfloat16(), wide, wide, slots, 1.0) is None


@pytest.mark.parametrize("num_rows", [1, 7, 300])
def test_silu_mul_matches_float64(kernels: NativeKernels, num_rows: int) -> None:
    gen = torch.Generator().manual_seed(num_rows)
    wide = (torch.randn(num_rows, 2 * 1536 + 40, generator=gen) * 4).bfloat16()
    gate_up = wide[:, : 2 * 1536]  # strided rows
    out = kernels.silu_mul(gate_up)
    assert out is not None and out.shape == (num_rows, 1536) and out.dtype == torch.bfloat16
    ref = F.silu(gate_up[:, :1536].double()) * gate_up[:, 1536:].double()
    assert torch.allclose(out.double(), ref, rtol=2**-8, atol=1e-6)  # one bfloat16 rounding
    odd = (torch.randn(3, 2 * 13, generator=gen) * 4).bfloat16()  # a width that is no multiple of the lanes
    ref = F.silu(odd[:, :13].double()) * odd[:, 13:].double()
    assert torch.allclose(kernels.silu_mul(odd).double(), ref, rtol=2**-8, atol=1e-6)  # type: ignore[union-attr]
    assert kernels.silu_mul(gate_up.float()) is None


def test_rotary_matches_float64_and_leaves_other_heads(kernels: NativeKernels) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(29, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    rotary = decoder.RotaryEmbedding(HEAD_DIM, 4096, 10000.0)
    cos, sin = rotary.tables(torch.randint(0, 4096, (29,), generator=gen), torch.bfloat16)
    qk = x[:, : HEADS + KV_HEADS]
    half = HEAD_DIM // 2
    rotated = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
    ref = qk.double() * cos.double() + rotated.double() * sin.double()
    out = x.clone()
    assert kernels.rotary(out[:, : HEADS + KV_HEADS], cos, sin)
    assert torch.allclose(out[:, : HEADS + KV_HEADS].double(), ref, rtol=2**-8, atol=1e-3)
    assert torch.equal(out[:, HEADS + KV_HEADS :], x[:, HEADS + KV_HEADS :])  # v untouched
    assert not kernels.rotary(qk.float(), cos.float(), sin.float())


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 16, 300])  # 300 rows take the threaded path
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_pytorch(
    kernels: NativeKernels, out_dtype: torch.dtype, num_rows: int, with_delta: bool
) -> None:
    gen = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, 576, generator=gen) * 3
    delta = torch.randn(num_rows, 576, generator=gen).to(out_dtype) if with_delta else None
    weight = torch.rand(576, generator=gen) + 0.5
    summed = x + delta.float() if delta is not None else x.clone()
    expected = F.rms_norm(summed, (576,), weight, 1e-5)
    out = kernels.add_rms_norm(x, delta, weight, 1e-5, out_dtype)
    assert out is not None and out.dtype == out_dtype
    assert torch.equal(x, summed)  # the residual add is in place and exact
    rtol = 1e-5 if out_dtype == torch.float32 else 2**-7  # one bfloat16 rounding step
    assert torch.allclose(out.float(), expected, rtol=rtol, atol=1e-6)


def test_add_rms_norm_declines_other_layouts(kernels: NativeKernels) -> None:
    x, weight = torch.randn(4, 8), torch.ones(8)
    assert kernels.add_rms_norm(x.t(), None, weight, 1e-5, torch.float32) is None  # not contiguous
    assert kernels.add_rms_norm(x, torch.randn(4, 8), weight, 1e-5, torch.bfloat16) is None  # delta dtype
    assert kernels.add_rms_norm(x.bfloat16(), None, weight, 1e-5, torch.bfloat16) is None  # stream not fp32


@pytest.fixture
def fresh_native(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """``native()`` rebuilt under this test's environment, into an empty cache directory."""
    monkeypatch.setenv("SPLITSERVE_KERNEL_CACHE", str(tmp_path))
    native.cache_clear()
    kernels_for.cache_clear()
    yield tmp_path
    native.cache_clear()
    kernels_for.cache_clear()


def test_native_kernels_can_be_switched_off(fresh_native: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_NATIVE_KERNELS", "0")
    assert native() is None


def test_a_failing_build_leaves_nothing_and_falls_back(fresh_native: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    assert native() is None
    assert list(fresh_native.iterdir()) == []


def test_a_level_that_does_not_build_falls_back_to_the_next(
    fresh_native: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An older compiler without the best level's flags (AMX needs GCC 11) still gets the level below."""
    levels = detect_cpu().levels
    if len(levels) < 2:
        pytest.skip("this CPU runs only the portable build")
    real = kernels_module.kernels_for
    monkeypatch.setattr(kernels_module, "kernels_for", lambda level: None if level == levels[-1] else real(level))
    monkeypatch.delenv("SPLITSERVE_KERNEL_ISA", raising=False)  # the best level, as a worker picks it
    loaded = native()
    assert loaded is not None and loaded.level == levels[-2]


def test_the_build_is_cached(fresh_native: Path) -> None:
    assert native() is not None
    built = list(fresh_native.iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"
    native.cache_clear()
    assert native() is not None
    assert list(fresh_native.iterdir()) == built


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_model_gives_the_same_logits_with_and_without_native_kernels(
    tiny_model: DecoderForCausalLM, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both paths through a whole engine: chunked prefill over a cached prefix, then batched decodes."""

    def run() -> list[torch.Tensor]:
        model = copy.deepcopy(tiny_model).to(dtype)
        logits: list[torch.Tensor] = []
        compute = model.compute_logits
        model.compute_logits = lambda hidden: logits.append(compute(hidden)) or logits[-1]  # type: ignore[method-assign]
        engine = build_engine(model, max_num_batched_tokens=32)  # a 70-token prompt takes three chunks
        prompts = {"a": list(range(1, 71)), "b": list(range(100, 120))}
        run_to_completion(engine, prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        return logits

    native_logits = run()
    for module in (attention, decoder, model_runner):
        monkeypatch.setattr(module, "native", lambda: None)
    torch_logits = run()
    assert len(native_logits) == len(torch_logits) > 10
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for ours, theirs in zip(native_logits, torch_logits, strict=True):
        assert torch.allclose(ours, theirs, atol=tol, rtol=tol)
        if dtype == torch.bfloat16 and not torch.equal(ours.argmax(-1), theirs.argmax(-1)):
            # The native bfloat16 kernels round once where PyTorch rounds after every op: a near-tie of this
            # random model may go the other way, and from there the two runs continue different texts.
            break


SAPPHIRE_RAPIDS = {"avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                   "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}  # fmt: skip
ZEN_4 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"}


@pytest.mark.parametrize(
    ("arch", "flags", "levels", "isa_class"),
    [
        ("x86_64", {"avx2", "fma", "f16c"}, ["scalar", "avx2"], "avx2"),
        ("x86_64", SAPPHIRE_RAPIDS, ["scalar", "avx2", "avxvnni", "avx512", "avx512bf16", "amx"], "amx"),
        ("x86_64", ZEN_4, ["scalar", "avx2", "avx512", "avx512bf16"], "avx512-bf16"),
        ("x86_64", {"sse2"}, ["scalar"], "scalar"),
        ("aarch64", {"asimd", "asimddp"}, ["scalar", "neon", "neon-dotprod"], "neon-dotprod"),
        ("riscv64", set(), ["scalar"], "scalar"),
    ],
)
def test_each_cpu_class_gets_the_builds_it_runs(arch: str, flags: set[str], levels: list[str], isa_class: str) -> None:
    cpu = CpuInfo(arch, "some CPU", frozenset(flags))
    assert [level.name for level in cpu.levels] == levels
    assert cpu.isa_class == isa_class


def test_a_build_can_be_chosen_but_not_one_the_cpu_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    avx2 = CpuInfo("x86_64", "some CPU", frozenset({"avx2", "fma", "f16c"}))
    assert select_level(avx2).name == "avx2"
    monkeypatch.setenv("SPLITSERVE_KERNEL_ISA", "scalar")
    assert select_level(avx2).name == "scalar"
    monkeypatch.setenv("SPLITSERVE_KERNEL_ISA", "avx512")
    with pytest.raises(ValueError, match="avx512"):
        select_level(avx2)

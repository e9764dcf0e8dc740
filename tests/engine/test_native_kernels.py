"""The native CPU kernels (decode attention, add + RMSNorm) against PyTorch, and prefill attention against softmax."""

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
import splitserve.model.llama as llama
from splitserve.engine.sampling_params import SamplingParams
from splitserve.model.attention import DecodeBatch, PrefillChunk
from splitserve.model.kernels import CpuInfo, NativeKernels, detect_cpu, kernels_for, native, select_level
from splitserve.model.llama import LlamaForCausalLM
from tests.engine.conftest import build_engine, run_to_completion

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


@pytest.fixture(params=[level.name for level in detect_cpu().levels])
def kernels(request: pytest.FixtureRequest) -> NativeKernels:
    """Each instruction-set build this CPU runs (the portable scalar one always)."""
    built = kernels_for(next(level for level in detect_cpu().levels if level.name == request.param))
    if built is None:
        pytest.fail("the native kernels did not build (is a C compiler with OpenMP installed?)")
    return built


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_matches_reference_and_torch_path(kernels: NativeKernels, dtype: torch.dtype) -> None:
    k_cache, v_cache = _cache(200, dtype)
    lengths = [1, 15, 16, 17, 300, 2500 // 16 * 3 + 5]  # a single token, block edges, a long one
    decode = _decode_batch(lengths, 200)
    # q as the model produces it: a strided view of the fused q/k projection
    qk = torch.randn(len(lengths), HEADS + KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(2)).to(dtype)
    q = qk[:, :HEADS]
    scale = HEAD_DIM**-0.5
    out = kernels.paged_decode_attention(q, k_cache, v_cache, decode.block_tables, decode.context_lens, BLOCK, scale)
    assert out is not None and out.dtype == dtype and out.shape == (len(lengths), HEADS, HEAD_DIM)
    torch_out = attention._decode_attention_torch(q, k_cache, v_cache, decode, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for row in range(len(lengths)):
        ref = _reference(q[row : row + 1], _context(k_cache, decode, row), _context(v_cache, decode, row))[0]
        assert torch.allclose(out[row].double(), ref, atol=tol), row
    assert torch.allclose(out.float(), torch_out.float(), atol=tol)


def test_decode_kernel_declines_what_it_cannot_take(kernels: NativeKernels) -> None:
    k_cache, v_cache = _cache(4, torch.float16)
    decode = _decode_batch([10], 4)
    q = torch.randn(1, HEADS, HEAD_DIM, dtype=torch.float16)
    assert (
        kernels.paged_decode_attention(q, k_cache, v_cache, decode.block_tables, decode.context_lens, BLOCK, 1.0)
        is None
    )
    # the attention entry point then takes the PyTorch path
    out = attention._decode_attention(q, k_cache, v_cache, decode, 1.0)
    assert out.shape == (1, HEADS, HEAD_DIM)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_q", "num_ctx"), [(40, 40), (7, 300), (1, 33)])
def test_prefill_attention_matches_reference(dtype: torch.dtype, num_q: int, num_ctx: int) -> None:
    k_cache, v_cache = _cache(32, dtype)
    slots = torch.randperm(32 * BLOCK, generator=torch.Generator().manual_seed(3))[:num_ctx]
    q = torch.randn(num_q, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(4)).to(dtype)
    out = attention._prefill_attention(q, k_cache, v_cache, PrefillChunk(num_q, slots, num_ctx), HEAD_DIM**-0.5)
    ref = _reference(q, k_cache[slots], v_cache[slots])
    assert torch.allclose(out.double(), ref, atol=1e-5 if dtype == torch.float32 else 2e-2)


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


def test_the_build_is_cached(fresh_native: Path) -> None:
    assert native() is not None
    built = list(fresh_native.iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"
    native.cache_clear()
    assert native() is not None
    assert list(fresh_native.iterdir()) == built


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_model_gives_the_same_logits_with_and_without_native_kernels(
    tiny_model: LlamaForCausalLM, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
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
    for module in (attention, llama, model_runner):
        monkeypatch.setattr(module, "native", lambda: None)
    torch_logits = run()
    assert len(native_logits) == len(torch_logits) > 10
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for ours, theirs in zip(native_logits, torch_logits, strict=True):
        assert torch.allclose(ours, theirs, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("arch", "flags", "levels", "isa_class"),
    [
        ("x86_64", {"avx2", "fma", "f16c"}, ["scalar", "avx2"], "avx2"),
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

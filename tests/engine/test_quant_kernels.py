"""The quantized matmul on every instruction-set path this CPU runs (the portable scalar one always), against a
float64 reference built from the ``gguf`` package's own quantizer and dequantizer; and the one-call decode step
against the module path it replaces.

The reference quantizes the activations exactly as the kernels do (per 32 values: d = max|x| / 127,
q = round(x * 127 / max|x|)), so the kernel and the reference differ only by float32 accumulation order.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from splitserve.engine.sampling_params import SamplingParams
from splitserve.model import attention, decoder
from splitserve.model.decoder import DecoderForCausalLM
from splitserve.model.kernel_build import ARM_LEVELS, BASE_FLAGS, IsaLevel, detect_cpu, sources
from splitserve.model.kernels import QUANT_TYPES, NativeKernels, kernels_for
from tests.support.engine import build_engine, run_to_completion
from tests.support.quant import gguf_rows, quantize_model

LEVELS = [level.name for level in detect_cpu().levels]


@pytest.fixture(scope="module", params=LEVELS)
def kernels(request: pytest.FixtureRequest) -> NativeKernels:
    level = next(lv for lv in detect_cpu().levels if lv.name == request.param)
    built = kernels_for(level)
    if built is None:
        pytest.fail(f"the {request.param} kernels did not build (is a C compiler with OpenMP installed?)")
    return built


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x [m, k] float32 rounded as the kernels round it: 8 bits per block of 32, in float64."""
    blocks = x.view(x.shape[0], -1, 32)
    top = blocks.abs().amax(dim=-1, keepdim=True)
    # a tensor divided by a tensor, as the kernels' 127.0f / top: torch computes 127.0 / top through the reciprocal,
    # one ulp away, which can move a product that lands on .5 to the other integer
    scale = torch.where(top > 0, torch.full_like(top, 127.0) / top, torch.zeros_like(top))
    q = torch.round(blocks * scale)
    return (q.double() * (top / 127.0).double()).view_as(x)


@pytest.mark.parametrize("wtype", sorted(QUANT_TYPES))
@pytest.mark.parametrize("num_rows", [1, 3, 4, 5, 17, 40])  # AMX: from 5 rows, in tiles of 16 rows
# n not a multiple of any row group: the last group is partly padding; 20 rows make an odd number of groups of 8,
# so the last AMX tile of 16 weight rows has one group
@pytest.mark.parametrize("n", [44, 20])
def test_quant_matmul_matches_a_float64_reference(kernels: NativeKernels, wtype: int, num_rows: int, n: int) -> None:
    rng = np.random.default_rng(wtype * 100 + num_rows)
    k = 288  # 9 blocks: more than the AMX path's pipeline holds (it reuses its buffers from the 5th block)
    rows = gguf_rows(rng.normal(0, 0.3, (n, k)), wtype)
    weight = torch.from_numpy(dequantize(rows.rows.numpy(), wtype)).double()
    x = torch.from_numpy(rng.normal(0, 1, (num_rows, k)).astype(np.float32))
    x[0, 5] = 40.0  # an outlier, as real activations have
    packed = kernels.pack(rows.rows, wtype, k)
    out = kernels.quant_matmul(x, packed)
    assert out is not None and out.dtype == torch.float32 and out.shape == (num_rows, n)
    expected = quantized_activations(x) @ weight.t()
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)


def test_quant_matmul_takes_bfloat16_and_strided_rows(kernels: NativeKernels) -> None:
    rng = np.random.default_rng(7)
    rows = gguf_rows(rng.normal(0, 0.3, (16, 64)), 3)
    weight = torch.from_numpy(dequantize(rows.rows.numpy(), 3)).double()
    wide = torch.from_numpy(rng.normal(0, 1, (6, 128)).astype(np.float32)).bfloat16()
    x = wide[:, 32:96]  # rows 128 elements apart
    out = kernels.quant_matmul(x, kernels.pack(rows.rows, 3, 64))
    assert out is not None and out.dtype == torch.bfloat16
    expected = quantized_activations(x.float().contiguous()) @ weight.t()
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2)  # bf16 output rounding


def test_the_native_dequantizer_agrees_with_the_gguf_package(kernels: NativeKernels) -> None:
    rng = np.random.default_rng(3)
    for wtype in QUANT_TYPES:
        rows = gguf_rows(rng.normal(0, 1, (8, 64)), wtype)
        ours = kernels.dequantize(rows.rows, wtype, 64)
        assert torch.equal(ours, torch.from_numpy(dequantize(rows.rows.numpy(), wtype)))


def test_quant_matmul_declines_what_it_cannot_take(kernels: NativeKernels) -> None:
    rows = gguf_rows(np.ones((8, 64)), 8)
    packed = kernels.pack(rows.rows, 8, 64)
    assert kernels.quant_matmul(torch.ones(2, 32), packed) is None  # wrong k
    assert kernels.quant_matmul(torch.ones(2, 64, dtype=torch.float16), packed) is None
    assert kernels.quant_matmul(torch.ones(64, 2).t(), packed) is None  # columns not contiguous
    with pytest.raises(ValueError, match="cannot pack"):
        kernels.pack(rows.rows, 12, 64)  # Q4_K: not a format the kernels take
    with pytest.raises(ValueError, match="cannot pack"):
        kernels.pack(rows.rows, 8, 48)  # k not a multiple of 32


@pytest.mark.parametrize("wtype", [2, 3])
def test_the_one_call_forward_step_matches_the_module_path(
    tiny_model: DecoderForCausalLM, kernels: NativeKernels, wtype: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole engine: quantized steps (prefill chunks and decodes) in one native call vs the same matmuls one
    module at a time, with PyTorch's attention for the prefill."""
    model = quantize_model(tiny_model, kernels, wtype)
    # the module path's norms from the same build as the weights' matmuls, as in serving (both native()): a
    # norm from another build (another vector width, another summation order) is an ulp away, enough to move
    # an activation across a rounding boundary of its 8-bit code
    monkeypatch.setattr(decoder, "native", lambda: kernels)
    monkeypatch.setattr(attention, "native", lambda: kernels)

    def run(one_call: bool) -> list[torch.Tensor]:
        monkeypatch.setenv("SPLITSERVE_FORWARD_STEP", "1" if one_call else "0")
        copy_ = copy.deepcopy(model)
        logits: list[torch.Tensor] = []
        compute = copy_.compute_logits
        copy_.compute_logits = lambda hidden: logits.append(compute(hidden)) or logits[-1]  # type: ignore[method-assign]
        engine = build_engine(copy_, max_num_batched_tokens=32)
        assert (copy_._forward_step is not None) == one_call
        prompts = {"a": list(range(1, 41)), "b": list(range(100, 120)), "c": [7]}
        run_to_completion(engine, prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
        return logits

    one_call, modules = run(True), run(False)
    assert len(one_call) == len(modules) >= 10  # a batched prefill, then decode steps of 3, 2 and 1
    for ours, theirs in zip(one_call, modules, strict=True):
        torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=2e-3)


def test_quantized_decode_stays_close_to_float(tiny_model: DecoderForCausalLM, kernels: NativeKernels) -> None:
    """8-bit activations move the logits a little, never the model: same weights, float vs quantized decode."""
    model = quantize_model(tiny_model, kernels, 8)
    float_model = copy.deepcopy(model)
    float_model._quant_head = None
    for module in float_model.modules():
        if isinstance(module, decoder.Linear):
            module.quant = module.quant_kernels = None
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got, tokens = {}, {}
    for label, m in (("quant", model), ("float", float_model)):
        logits: list[torch.Tensor] = []
        compute = m.compute_logits
        m.compute_logits = lambda hidden, c=compute, sink=logits: sink.append(c(hidden)) or sink[-1]  # type: ignore[method-assign]
        outputs = run_to_completion(build_engine(m), {"a": list(range(1, 30))}, params)["a"]
        got[label], tokens[label] = logits, [t for o in outputs for t in o.new_token_ids]
    # compared while both read the same tokens: up to the first step whose greedy choices differ
    same = next(
        (i for i, (a, b) in enumerate(zip(tokens["quant"], tokens["float"], strict=True)) if a != b),
        len(tokens["quant"]),
    )
    assert same >= 4, tokens
    for ours, theirs in zip(got["quant"][: same + 1], got["float"][: same + 1], strict=True):
        assert (ours - theirs).abs().max() < 0.05 * theirs.abs().max()


def test_a_cached_prompt_answers_as_a_cold_one(tiny_model: DecoderForCausalLM, kernels: NativeKernels) -> None:
    """The last token of a cached prompt runs alone through the same forward step as the cold prefill's 75
    rows: its first logits are the cold prefill's to the bit, and so is every token after."""
    model = quantize_model(tiny_model, kernels, 3)
    logits: list[torch.Tensor] = []
    compute = model.compute_logits
    model.compute_logits = lambda hidden: logits.append(compute(hidden)) or logits[-1]  # type: ignore[method-assign]
    engine = build_engine(model)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [int(t) for t in torch.randint(1, 200, (75,), generator=torch.Generator().manual_seed(4))]
    cold = run_to_completion(engine, {"cold": prompt}, params)["cold"]
    cold_first = logits[0]
    warm = run_to_completion(engine, {"warm": prompt}, params)["warm"]
    assert warm[0].num_cached_tokens == 74
    assert [o.new_token_ids for o in warm] == [o.new_token_ids for o in cold]
    assert torch.equal(logits[6], cold_first)


ARM_GCC, QEMU = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")


@pytest.mark.skipif(detect_cpu().is_arm, reason="on ARM the tests above run these paths natively")
@pytest.mark.skipif(ARM_GCC is None or QEMU is None, reason="needs gcc-aarch64-linux-gnu and qemu-user (make setup)")
@pytest.mark.parametrize("level", ARM_LEVELS, ids=lambda level: level.name)
def test_the_arm_paths_under_qemu(level: IsaLevel, tmp_path: Path) -> None:
    """The NEON (and dot-product) kernels, cross-built and run under qemu: tests/native/quant_check.c checks the
    quantized matmul against a reference, and a matmul row and an attention row for batch invariance."""
    flags = [flag for flag in level.cflags if flag != "-mtune=native"]
    binary = tmp_path / "quant_check"
    files = [str(Path(__file__).parents[1] / "native" / "quant_check.c"), *map(str, sources())]
    base = [flag for flag in BASE_FLAGS if flag not in ("-shared", "-fPIC")]  # the kernels' own flags
    build = [str(ARM_GCC), *base, "-static", *flags, "-o", str(binary), *files, "-lm"]
    subprocess.run(build, check=True, capture_output=True, timeout=300)
    result = subprocess.run([str(QEMU), "-cpu", "max", str(binary)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr

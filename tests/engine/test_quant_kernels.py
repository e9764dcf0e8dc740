"""The quantized matmul on every instruction-set path this CPU runs (the portable scalar one always), against a
float64 reference built from the ``gguf`` package's own quantizer and dequantizer; and the one-call decode step
against the module path it replaces.

The reference quantizes the activations exactly as the kernels do (per 32 values: d = max|x| / 127,
q = round(x * 127 / max|x|)), so the kernel and the reference differ only by float32 accumulation order.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from splitserve.engine.sampling_params import SamplingParams
from splitserve.model import attention, decoder
from splitserve.model.decoder import DecoderForCausalLM
from splitserve.model.kernel_build import ARM_LEVELS, BASE_FLAGS, IsaLevel, detect_cpu, sources
from splitserve.model.kernels import MIXED_TYPE, QUANT_TYPES, NativeKernels, kernels_for
from splitserve.model.quant import load_gguf_quantized
from splitserve.model.registry import apply_quantization, load_for_serving, load_model
from splitserve.model.source import resolve_model
from tests.support.engine import TINY, build_engine, run_to_completion, tokens_of
from tests.support.quant import SUPER_BLOCK_TYPES, gguf_rows, model_for, quantize_model

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
    # 9 blocks: more than the AMX path's pipeline holds (it reuses its buffers from the 5th block); the K-quants
    # in two super-blocks of 256
    k = 512 if wtype in SUPER_BLOCK_TYPES else 288
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
        k = 512 if wtype in SUPER_BLOCK_TYPES else 64
        rows = gguf_rows(rng.normal(0, 1, (8, k)), wtype)
        ours = kernels.dequantize(rows.rows, wtype, k)
        assert torch.equal(ours, torch.from_numpy(dequantize(rows.rows.numpy(), wtype)))


def test_quant_matmul_declines_what_it_cannot_take(kernels: NativeKernels) -> None:
    rows = gguf_rows(np.ones((8, 64)), 8)
    packed = kernels.pack(rows.rows, 8, 64)
    assert kernels.quant_matmul(torch.ones(2, 32), packed) is None  # wrong k
    assert kernels.quant_matmul(torch.ones(2, 64, dtype=torch.float16), packed) is None
    assert kernels.quant_matmul(torch.ones(64, 2).t(), packed) is None  # columns not contiguous
    with pytest.raises(ValueError, match="cannot pack"):
        kernels.pack(rows.rows, 16, 64)  # IQ2_XXS: not a format the kernels take
    with pytest.raises(ValueError, match="cannot pack"):
        kernels.pack(gguf_rows(np.ones((8, 512)), 12).rows, 12, 288)  # Q4_K: k not a multiple of 256
    with pytest.raises(ValueError, match="cannot pack"):
        kernels.pack(rows.rows, 8, 48)  # k not a multiple of 32


def test_a_mixed_weight_is_its_parts_side_by_side(kernels: NativeKernels) -> None:
    """A fused q/k/v of a Q4_K_M file (q and k in Q4_K, v in Q6_K) packs as one weight whose product is each
    part's own, to the bit, at any row count."""
    rng = np.random.default_rng(11)
    k = 512
    parts = [gguf_rows(rng.normal(0, 0.3, (n, k)), wtype) for n, wtype in ((32, 12), (16, 12), (16, 14))]
    stacked = kernels.pack_stacked([(p.rows, p.wtype) for p in parts], k)
    assert stacked.wtype == MIXED_TYPE and stacked.n == 64
    for num_rows in (1, 6, 21):
        x = torch.from_numpy(rng.normal(0, 1, (num_rows, k)).astype(np.float32))
        out = kernels.quant_matmul(x, stacked)
        alone = [kernels.quant_matmul(x, kernels.pack(p.rows, p.wtype, k)) for p in parts]
        assert out is not None and all(a is not None for a in alone)
        assert torch.equal(out, torch.cat(alone, dim=1))  # type: ignore[misc]
    same = kernels.pack_stacked([(p.rows, 12) for p in parts[:2]], k)  # one format: a plain weight
    assert same.wtype == 12 and same.n == 48


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


@pytest.mark.parametrize("wtype", [8, "Q4_K_M"])
def test_quantized_decode_stays_close_to_float(
    tiny_model: DecoderForCausalLM, k_sized_model: DecoderForCausalLM, kernels: NativeKernels, wtype: int | str
) -> None:
    """8-bit activations move the logits a little, never the model: same weights, float vs quantized decode."""
    base, formats = model_for(wtype, tiny_model, k_sized_model)
    model = quantize_model(base, kernels, formats)
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


@pytest.mark.parametrize("wtype", [3, "Q4_K_M"])
def test_a_cached_prompt_answers_as_a_cold_one(
    tiny_model: DecoderForCausalLM, k_sized_model: DecoderForCausalLM, kernels: NativeKernels, wtype: int | str
) -> None:
    """The last token of a cached prompt runs alone through the same forward step as the cold prefill's 75
    rows: its first logits are the cold prefill's to the bit, and so is every token after."""
    base, formats = model_for(wtype, tiny_model, k_sized_model)
    model = quantize_model(base, kernels, formats)
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


def test_matrices_without_native_kernels_are_named_in_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A GGUF mixing native formats with one that has no native kernel (IQ2_XXS here) loads the native matrices and
    names the others, with their format, in one warning."""
    config = dataclasses.replace(TINY, hidden_size=256, intermediate_size=512, num_attention_heads=8, head_dim=32)
    rng = np.random.default_rng(2)
    writer = gguf.GGUFWriter(str(tmp_path / "mixed.gguf"), "llama")
    q4k = gguf_rows(rng.normal(0, 0.3, (256, 256)), 12)
    writer.add_tensor("blk.0.attn_q.weight", q4k.rows.numpy(), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    for name, wtype, rows in (("attn_v", 10, 128), ("attn_output", 23, 256)):  # Q2_K and IQ4_XS: native
        blocks = gguf_rows(rng.normal(0, 0.3, (rows, 256)), wtype).rows.numpy()
        writer.add_tensor(f"blk.0.{name}.weight", blocks, raw_dtype=gguf.GGMLQuantizationType(wtype))
    iq2 = rng.integers(0, 256, (128, 66), dtype=np.uint8)  # 128 rows of one 256-weight IQ2_XXS super-block each
    writer.add_tensor("blk.0.attn_k.weight", iq2, raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
    writer.add_tensor("output_norm.weight", np.ones(256, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with caplog.at_level(logging.WARNING, logger="splitserve.model.quant"):
        weights = load_gguf_quantized(tmp_path / "mixed.gguf", config)
    names = {f"model.layers.0.self_attn.{m}.weight": t for m, t in (("q_proj", 12), ("v_proj", 10), ("o_proj", 23))}
    assert {name: rows.wtype for name, rows in weights.items()} == names
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "IQ2_XXS: blk.0.attn_k.weight (1)" in warnings[0], warnings


def test_the_quantized_matrices_hold_no_float_copy_and_answer_as_before() -> None:
    """A worker keeps only the GGUF's blocks of the matrices they run: ``load_for_serving`` never makes their float
    copy (meta tensors, so a path that would read one fails loudly), ``release_float_weights`` frees it where it
    was made; the embeddings' and the head's float rows stay, and the answers are the same bits either way."""
    source, cpu = resolve_model("smollm2"), torch.device("cpu")
    made = load_model(source, torch.float32, cpu)
    assert apply_quantization(made, source, "gguf")
    quantized = [m for m in made.modules() if isinstance(m, decoder.Linear) and m.quant is not None]
    expected = sum(m.weight.numel() * 4 for m in quantized)
    assert made.release_float_weights() == expected > 100e6  # SmolLM2's 106 M matmul weights in float32
    assert made.release_float_weights() == 0
    never, description = load_for_serving(source, torch.float32, cpu, "auto")
    assert "native kernels" in description and never.release_float_weights() == 0
    for model in (made, never):
        layer = model.layers[0]
        assert isinstance(layer, decoder.DecoderLayer) and layer.mlp.down_proj.weight.device.type == "meta"
        assert model.embed_tokens.weight.device.type == "cpu"
    x = torch.randn(3, 1536)
    down = never.layers[0].mlp.down_proj  # an input the kernels decline: run as float32, not from a float copy
    assert torch.equal(down(x.half()), down(x.half().float()).half())
    params = SamplingParams(max_tokens=48, temperature=0.0, logprobs=2)
    prompt = {"a": list(range(1, 40))}
    first = run_to_completion(build_engine(made, block_size=16), prompt, params)["a"]
    second = run_to_completion(build_engine(never, block_size=16), prompt, params)["a"]
    assert len(tokens_of(first)) == 48 and made.runs_forward_step and never.runs_forward_step
    assert tokens_of(first) == tokens_of(second)
    assert [o.new_logprobs for o in first] == [o.new_logprobs for o in second]

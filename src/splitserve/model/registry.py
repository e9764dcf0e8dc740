"""Building a ready model from a ``ModelSource`` (``splitserve.model.source``): weights, quantization, dtype.

This module is torch's side; resolving names to sources is torch-free and lives in ``splitserve.model.source``.
"""

from __future__ import annotations

import math

import torch

from splitserve.model.decoder import DecoderForCausalLM, block_matrices, return_freed_memory
from splitserve.model.gguf_file import open_gguf
from splitserve.model.int4 import int4_matmul_available, load_gguf_int4
from splitserve.model.kernels import QUANT_TYPES, native
from splitserve.model.loader import (
    GGUF_ROPE_TENSORS,
    fused_parts,
    gguf_file_config,
    gguf_fused_name,
    gguf_to_hf_name,
    load_gguf,
    load_safetensors_folder,
    text_model_name,
)
from splitserve.model.quant import load_gguf_quantized
from splitserve.model.source import ModelSource


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device) -> DecoderForCausalLM:
    """Build the model of ``source`` with its weights, in ``dtype`` on ``device``, in eval mode.

    Weights are converted to ``dtype`` while loading, so no float32 copy of the whole model is held when a
    smaller dtype is asked for. The rotary tables stay float32.
    """
    loader = load_gguf if source.kind == "gguf" else load_safetensors_folder
    config, state = loader(source.path, dtype=dtype)
    return DecoderForCausalLM.from_hf_state_dict(config, state, device).eval()


def load_footprint_bytes(source: ModelSource, dtype: torch.dtype, quantization: str = "none") -> int:
    """About the memory ``load_for_serving`` takes at its peak, on CPU: every weight in ``dtype``, except that a
    GGUF whose blocks run in the native kernels keeps those matrices as blocks only, read from the file and then
    packed (twice their bytes at the end of packing); a native head is packed beside its float rows too."""
    size = torch.empty((), dtype=dtype).element_size()
    if source.kind == "gguf":
        reader = open_gguf(source.path)
        tensors = [t for t in reader.tensors if t.name not in GGUF_ROPE_TENSORS]
        if quantization not in ("auto", "gguf") or native() is None:
            return sum(int(t.n_elements) for t in tensors) * size
        config = gguf_file_config(reader)
        parts = {t.name: fused_parts(gguf_fused_name(gguf_to_hf_name(t.name, config), config), int(t.shape[-1]), config)
                 for t in tensors}  # fmt: skip
        widths = {
            part: int(t.shape[0])
            for t in tensors
            if int(t.tensor_type) in QUANT_TYPES and len(t.shape) == 2
            for part, _, _ in parts[t.name]
        }
        blocks = block_matrices(config.num_hidden_layers, widths)
        total = 0
        for t in tensors:
            as_blocks = all(part in blocks for part, _, _ in parts[t.name])
            total += 2 * int(t.n_bytes) if as_blocks else int(t.n_elements) * size
            if t.name in ("token_embd.weight", "output.weight") and int(t.tensor_type) in QUANT_TYPES:
                total += int(t.n_bytes)  # the head's packed blocks
        return total
    from safetensors import safe_open

    elements = 0
    for file in sorted(source.path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                if text_model_name(name) is not None:  # a multimodal checkpoint's vision tower is not loaded
                    elements += math.prod(handle.get_slice(name).get_shape())
    return elements * size


def load_for_serving(
    source: ModelSource, dtype: torch.dtype, device: torch.device, quantization: str
) -> tuple[DecoderForCausalLM, str]:
    """The model as a worker serves it: ``load_model`` then ``apply_quantization`` (returning what that returns),
    except that the matrices the GGUF's blocks will run are never dequantized: their float parameters stay meta
    tensors, so loading peaks at the blocks and the rest of the model, not at a whole float model beside the
    blocks (Qwen2.5-3B's shape in Q4_K_M: 9.6 GiB before)."""
    kernels = native() if device.type == "cpu" and source.kind == "gguf" and quantization in ("auto", "gguf") else None
    if kernels is not None:
        config = gguf_file_config(open_gguf(source.path))
        blocks = load_gguf_quantized(source.path, config)
        widths = {name: rows.k for name, rows in blocks.items()}
        _, state = load_gguf(source.path, dtype=dtype, blocks_only=block_matrices(config.num_hidden_layers, widths))
        model = DecoderForCausalLM.from_hf_state_dict(config, state, device).eval()
        del state
        num_set = model.load_quantized_weights(blocks, kernels)
        del blocks  # the file's blocks, now packed
        return_freed_memory()
        if num_set:
            return model, _native_description(num_set)
    else:
        model = load_model(source, dtype, device)
    return model, apply_quantization(model, source, quantization)


def apply_quantization(model: DecoderForCausalLM, source: ModelSource, quantization: str) -> str:
    """Give ``model`` quantized weights from ``source`` per ``quantization``; returns what it got, for the log.

    - ``gguf``: the GGUF's own quantized blocks (the formats of ``kernels.QUANT_TYPES``) in every matmul through
      the native CPU kernels (8-bit activations, integer dot products); a ``ValueError`` when that cannot be (not
      a GGUF, not on CPU, no native kernels, no tensor in those formats).
    - ``int4``: PyTorch's int4 kernel for decode-sized matmuls (bfloat16 on CPU, Q4_0/Q4_1 only); a
      ``ValueError`` when that cannot be.
    - ``auto``: ``gguf`` where it can be, else ``int4`` where it can be, else nothing.
    - ``none``: nothing: every matmul runs in ``--dtype`` from the dequantized weights.
    """
    if quantization == "none":
        return ""
    if quantization in ("auto", "gguf"):
        num_set = _apply_gguf_kernels(model, source)
        if num_set:
            return _native_description(num_set)
        if quantization == "gguf":
            raise ValueError(
                f"--quantization gguf needs a GGUF with {'/'.join(QUANT_TYPES.values())} weights, a CPU device and the "
                f"native kernels (a C compiler); got a {source.kind} model on {model.embed_tokens.weight.device.type}"
            )
    num_int4 = _apply_int4(model, source)
    if quantization == "int4" and num_int4 == 0:
        raise ValueError(
            "--quantization int4 needs a GGUF with Q4_0/Q4_1 weights, --dtype bfloat16 and a CPU device; "
            f"got a {source.kind} model in {model.dtype} on {model.embed_tokens.weight.device.type}"
        )
    return f"the GGUF's 4-bit weights in {num_int4} decode-sized matmuls (PyTorch int4)" if num_int4 else ""


def _native_description(num_set: int) -> str:
    return f"the GGUF's quantized blocks in {num_set} matmuls (native kernels)"


def _apply_gguf_kernels(model: DecoderForCausalLM, source: ModelSource) -> int:
    kernels = native() if model.embed_tokens.weight.device.type == "cpu" else None
    if source.kind != "gguf" or kernels is None:
        return 0
    return model.load_quantized_weights(load_gguf_quantized(source.path, model.config), kernels)


def _apply_int4(model: DecoderForCausalLM, source: ModelSource) -> int:
    param = model.embed_tokens.weight
    usable = (
        source.kind == "gguf"
        and param.device.type == "cpu"
        and param.dtype == torch.bfloat16
        and int4_matmul_available()
    )
    return model.load_int4_weights(load_gguf_int4(source.path, model.config)) if usable else 0


_DTYPE_NAMES = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The weight and activation dtype for ``--dtype name`` on ``device``.

    ``auto``: on CUDA bfloat16 when the GPU supports it, else float16; on CPU bfloat16 when the CPU has
    native bf16 instructions (AVX-512 BF16 or AMX; ``benchmarks/dtype_matmul.py`` measures the gain), else
    float32. Raises ``ValueError`` for an unknown name.
    """
    key = name.strip().lower()
    if key == "auto":
        return _auto_dtype(device)
    if key not in _DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(_DTYPE_NAMES)}")
    dtype: torch.dtype = getattr(torch, _DTYPE_NAMES[key])
    return dtype


def _auto_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu" and cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls in hardware (AVX-512 BF16 or AMX tiles)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, probe, lambda: False)()) for probe in probes)

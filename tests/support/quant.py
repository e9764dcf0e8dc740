"""Quantized weights made with the ``gguf`` package's own quantizer (the K-quants with ``kquants``, IQ4_NL and IQ4_XS
here): GGUF
rows of a matrix, and a model whose linear layers and embeddings run as quantized blocks."""

from __future__ import annotations

import copy

import numpy as np
import torch
from gguf.quants import dequantize, quantize

from splitserve.model.decoder import DecoderForCausalLM
from splitserve.model.kernels import NativeKernels
from splitserve.model.quant import GGUFRows
from tests.support.kquants import K_TYPES, quantize_k

IQ4_NL, IQ4_XS = 20, 23
# formats in super-blocks of 256 weights: their matrices' k is a multiple of 256
SUPER_BLOCK_TYPES = (*K_TYPES, IQ4_XS)
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def quantize_iq4_nl(weight: np.ndarray) -> np.ndarray:
    """``weight`` [n, k] as IQ4_NL blocks (uint8 [n, k / 32 * 18]): per 32 weights d = the largest magnitude / 127
    (fp16) and each weight's nearest table value (the gguf package has no quantizer for it; its dequantizer reads
    these blocks as llama.cpp does)."""
    n, k = weight.shape
    blocks = weight.astype(np.float32).reshape(n, k // 32, 32)
    d = (np.abs(blocks).max(axis=-1, keepdims=True) / 127).astype(np.float16)
    scaled = blocks / np.where(d == 0, 1, d).astype(np.float32)
    codes = np.abs(scaled[..., None] - IQ4_NL_VALUES).argmin(axis=-1).astype(np.uint8)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([d.view(np.uint8), qs], axis=-1).reshape(n, k // 32 * 18)


def quantize_iq4_xs(weight: np.ndarray) -> np.ndarray:
    """``weight`` [n, k] (k a multiple of 256) as IQ4_XS blocks (uint8 [n, k / 256 * 136]): per 256 weights an fp16
    d, per 32 a 6-bit scale ls (step d (ls - 32)) from the block's largest magnitude, and each weight's nearest
    table value."""
    n, k = weight.shape
    supers = k // 256
    blocks = weight.astype(np.float32).reshape(n, supers, 8, 32)
    step = np.abs(blocks).max(axis=-1) / 127  # [n, supers, 8]
    d = (step.max(axis=-1) / 31).astype(np.float16)
    df = d.astype(np.float32)[..., None]
    ls = np.clip(np.round(np.divide(step, df, out=np.zeros_like(step), where=df > 0)), -32, 31).astype(np.int32) + 32
    dl = (df * (ls - 32))[..., None]
    scaled = np.divide(blocks, dl, out=np.zeros_like(blocks), where=dl != 0)
    codes = np.abs(scaled[..., None] - IQ4_NL_VALUES).argmin(axis=-1).astype(np.uint8)
    qs = (codes[..., :16] | (codes[..., 16:] << 4)).reshape(n, supers, 128)
    low = (ls & 0x0F).astype(np.uint8)
    scales_l = low[..., 0::2] | (low[..., 1::2] << 4)  # [n, supers, 4]
    scales_h = np.zeros((n, supers), dtype=np.uint16)
    for b in range(8):
        scales_h |= ((ls[..., b] >> 4) & 3).astype(np.uint16) << (2 * b)
    parts = [d.view(np.uint8).reshape(n, supers, 2), scales_h.view(np.uint8).reshape(n, supers, 2), scales_l, qs]
    return np.concatenate(parts, axis=-1).reshape(n, supers * 136)


def gguf_rows(weight: np.ndarray, wtype: int) -> GGUFRows:
    """``weight`` [n, k] as GGUF rows of ``wtype`` (K-quants from ``kquants``, the rest from ``gguf``'s quantizer)."""
    if wtype in K_TYPES:
        blocks = quantize_k(weight, wtype)
    elif wtype == IQ4_NL:
        blocks = quantize_iq4_nl(weight)
    elif wtype == IQ4_XS:
        blocks = quantize_iq4_xs(weight)
    else:
        blocks = quantize(weight.astype(np.float32), wtype)
    return GGUFRows(torch.from_numpy(np.ascontiguousarray(blocks)), wtype, weight.shape[1])


# The formats of a Q4_K_M file's matrices, as llama-quantize picks them: Q4_K, with more bits where they matter
# most (it gives v and down Q6_K in some layers; here in all, so that every fused q/k/v is mixed)
Q4_K_M = {"q_proj": 12, "k_proj": 12, "v_proj": 14, "o_proj": 12, "gate_proj": 12, "up_proj": 12, "down_proj": 14}


def quantize_model(
    model: DecoderForCausalLM, kernels: NativeKernels, wtype: int | dict[str, int]
) -> DecoderForCausalLM:
    """A copy of ``model`` whose weights are rounded to ``wtype`` (or per matrix: a dict from the HF projection
    name, as ``Q4_K_M``), with those blocks as its quantized weights; the head in Q8_0."""
    model = copy.deepcopy(model)
    for module, names in model._linear_sources().items():
        weight = module.weight.detach().numpy()
        sizes = [_rows_of(model, name) for name in names]
        parts, dequantized, start = [], [], 0
        for name, size in zip(names, sizes, strict=True):
            part_type = wtype if isinstance(wtype, int) else wtype[name.split(".")[-2]]
            rows = gguf_rows(weight[start : start + size], part_type)
            parts.append(rows)
            dequantized.append(torch.from_numpy(dequantize(rows.rows.numpy(), part_type)).float())
            start += size
        module.weight.data = torch.cat(dequantized)
        module.set_quantized(parts, kernels)
    head = gguf_rows(model.embed_tokens.weight.detach().numpy(), 8)
    model.embed_tokens.weight.data = torch.from_numpy(dequantize(head.rows.numpy(), 8)).float()
    assert model.load_quantized_weights({"model.embed_tokens.weight": head}, kernels) == 1
    return model


def model_for(
    wtype: int | str, tiny: DecoderForCausalLM, k_sized: DecoderForCausalLM
) -> tuple[DecoderForCausalLM, int | dict[str, int]]:
    """The model and the formats a test parameter names: a GGML type (the tiny model), or "Q4_K_M" (the model whose
    matrices are whole super-blocks wide, mixed as ``Q4_K_M``)."""
    return (k_sized, Q4_K_M) if wtype == "Q4_K_M" else (tiny, int(wtype))


def _rows_of(model: DecoderForCausalLM, name: str) -> int:
    config = model.config
    projection = name.split(".")[-2]
    if projection == "q_proj":
        return config.num_attention_heads * config.head_dim
    if projection in ("k_proj", "v_proj"):
        return config.num_key_value_heads * config.head_dim
    if projection in ("gate_proj", "up_proj"):
        return config.intermediate_size
    return config.hidden_size

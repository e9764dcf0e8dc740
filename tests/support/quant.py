"""Quantized weights made with the ``gguf`` package's own quantizer: GGUF rows of a matrix, and a model whose linear
layers and embeddings run as quantized blocks."""

from __future__ import annotations

import copy

import numpy as np
import torch
from gguf.quants import dequantize, quantize

from splitserve.model import decoder
from splitserve.model.decoder import DecoderForCausalLM
from splitserve.model.kernels import NativeKernels
from splitserve.model.quant import GGUFRows


def gguf_rows(weight: np.ndarray, wtype: int) -> GGUFRows:
    blocks = quantize(weight.astype(np.float32), wtype)
    return GGUFRows(torch.from_numpy(np.ascontiguousarray(blocks)), wtype, weight.shape[1])


def quantize_model(model: DecoderForCausalLM, kernels: NativeKernels, wtype: int) -> DecoderForCausalLM:
    """A copy of ``model`` whose weights are ``wtype``-rounded, with those blocks as its quantized weights."""
    model = copy.deepcopy(model)
    for module in model.modules():
        if isinstance(module, decoder.Linear):
            rows = gguf_rows(module.weight.detach().numpy(), wtype)
            module.weight.data = torch.from_numpy(dequantize(rows.rows.numpy(), wtype)).float()
            module.set_quantized(rows, kernels)
    head = gguf_rows(model.embed_tokens.weight.detach().numpy(), 8)
    model.embed_tokens.weight.data = torch.from_numpy(dequantize(head.rows.numpy(), 8)).float()
    assert model.load_quantized_weights({"model.embed_tokens.weight": head}, kernels) == 1
    return model

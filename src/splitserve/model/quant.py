"""Linear weights straight from a GGUF's quantized blocks, for the native quantized matmul.

A quantized GGUF already holds its linear weights in blocks of 32 weights with a scale (and a minimum or a fifth
bit: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; or 4-bit indices into a fixed table of 8-bit values: IQ4_NL), or in
super-blocks of 256 with small integer scales per block (the K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, which Q3_K_M,
Q4_K_M and Q5_K_M files mix; IQ4_XS, IQ4_NL's table with a scale per block of 32). ``load_gguf_quantized`` reads
those blocks unchanged (only the q/k rows are put back into Hugging Face's rotate-half order, as
``loader.load_gguf`` does for the float weights); ``NativeKernels.pack`` then repacks them into the kernels'
interleaved layout at load without loss (``csrc/quant_matmul.c``). Matmuls quantize their activations to 8 bits
per block and take integer dot products, as llama.cpp's ggml-cpu does.

Matrices in other formats (F16, the IQ1/IQ2/IQ3 formats, ...) are left out, with one warning naming them, and run
from the dequantized float weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from splitserve.model.config import DecoderConfig
from splitserve.model.gguf_file import open_gguf
from splitserve.model.kernels import QUANT_TYPES
from splitserve.model.loader import (
    fused_parts,
    gguf_fused_name,
    gguf_to_hf_name,
    partial_rotary_rows,
    unpermute_gguf_rows,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class GGUFRows:
    """A [n, k] weight as the GGUF stores it: each row K/32 blocks of ``wtype``."""

    rows: torch.Tensor  # [n, K/32 * block bytes] uint8
    wtype: int  # GGML type number (kernels.QUANT_TYPES)
    k: int

    @property
    def n(self) -> int:
        return int(self.rows.shape[0])


def load_gguf_quantized(path: str | Path, config: DecoderConfig) -> dict[str, GGUFRows]:
    """The matrices of a GGUF file in formats the native kernels take (``kernels.QUANT_TYPES``), HF-named, with q/k
    rows un-permuted like ``load_gguf``. Quantized matrices in other formats are named in one warning."""
    weights: dict[str, GGUFRows] = {}
    slow: dict[str, list[str]] = {}
    for tensor in open_gguf(path).tensors:
        wtype = int(tensor.tensor_type)
        if len(tensor.shape) != 2:
            continue
        k, n = (int(d) for d in tensor.shape)
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(wtype)]
        if wtype not in QUANT_TYPES or k % block:
            if block > 1:  # a quantized format (F32/F16/BF16 matrices are float by choice)
                slow.setdefault(GGMLQuantizationType(wtype).name, []).append(tensor.name)
            continue
        name = gguf_fused_name(gguf_to_hf_name(tensor.name, config), config)
        blocks = np.asarray(tensor.data).view(np.uint8).reshape(n, k // block * block_bytes)
        order = unpermute_gguf_rows(np.arange(n)[:, None], name, config)[:, 0]
        for part, start, stop in fused_parts(name, n, config):
            rows = partial_rotary_rows(order[start:stop], part, config)
            weights[part] = GGUFRows(torch.from_numpy(np.ascontiguousarray(blocks[rows])), wtype, k)
    if slow:
        listed = "; ".join(f"{fmt}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''} ({len(names)})"
                           for fmt, names in slow.items())  # fmt: skip
        logger.warning(
            "%s has matrices in formats without native kernels, which run from dequantized float weights "
            "(slower, and their matmuls are not batch-invariant): %s. Native formats: %s",
            Path(path).name, listed, ", ".join(QUANT_TYPES.values()),
        )  # fmt: skip
    return weights

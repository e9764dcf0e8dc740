"""Linear weights straight from a GGUF's quantized blocks, for the native quantized matmul.

A Q4_0/Q4_1/Q8_0 GGUF already holds its linear weights in 32-weight blocks with a scale (and, for Q4_1, a
minimum). ``load_gguf_quantized`` reads those blocks unchanged (only the q/k rows are put back into Hugging
Face's rotate-half order, as ``loader.load_gguf`` does for the float weights); ``NativeKernels.pack`` then
repacks them into the kernels' interleaved layout at load (``csrc/quant_matmul.c``). Matmuls quantize their
activations to 8 bits per block and take integer dot products, as llama.cpp's ggml-cpu does.

Tensors in other formats (F16, K-quants, ...) are left out and run from the dequantized float weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from splitserve.model.config import DecoderConfig
from splitserve.model.gguf_file import open_gguf
from splitserve.model.kernels import QUANT_TYPES
from splitserve.model.loader import gguf_to_hf_name, unpermute_gguf_rows

BLOCK = 32
_BLOCK_BYTES = {2: 18, 3: 20, 8: 34}  # GGML type -> bytes per block of 32 weights


@dataclass(slots=True)
class GGUFRows:
    """A [n, k] weight as the GGUF stores it: each row K/32 blocks of ``wtype``."""

    rows: torch.Tensor  # [n, K/32 * block bytes] uint8
    wtype: int  # GGML type number (2 Q4_0, 3 Q4_1, 8 Q8_0)
    k: int

    @property
    def n(self) -> int:
        return int(self.rows.shape[0])

    @staticmethod
    def concat(parts: list[GGUFRows]) -> GGUFRows | None:
        """The parts stacked along the output rows (fused q/k/v, gate/up); None if their formats differ."""
        if len({(p.wtype, p.k) for p in parts}) != 1:
            return None
        return GGUFRows(torch.cat([p.rows for p in parts]), parts[0].wtype, parts[0].k)


def load_gguf_quantized(path: str | Path, config: DecoderConfig) -> dict[str, GGUFRows]:
    """The Q4_0/Q4_1/Q8_0 matrices of a GGUF file, HF-named, with q/k rows un-permuted like ``load_gguf``."""
    weights: dict[str, GGUFRows] = {}
    for tensor in open_gguf(path).tensors:
        wtype = int(tensor.tensor_type)
        if wtype not in QUANT_TYPES or len(tensor.shape) != 2:
            continue
        k, n = (int(d) for d in tensor.shape)
        if k % BLOCK:
            continue
        name = gguf_to_hf_name(tensor.name)
        blocks = np.asarray(tensor.data).view(np.uint8).reshape(n, k // BLOCK * _BLOCK_BYTES[wtype])
        order = unpermute_gguf_rows(np.arange(n)[:, None], name, config)[:, 0]
        weights[name] = GGUFRows(torch.from_numpy(np.ascontiguousarray(blocks[order])), wtype, k)
    return weights

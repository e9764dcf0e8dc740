"""4-bit weights straight from a GGUF file, for matmuls with few rows (decode steps).

Decoding a few sequences is bound by reading weights, not by arithmetic; a Q4_0/Q4_1 GGUF already holds its
linear weights in 4 bits, and PyTorch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``) reads them at a
quarter of bfloat16's bytes. Both formats are exact in that kernel's form ``w = (q - 8) * scale + zero``
(groups of 32 along the input dimension): Q4_0 is ``d * (q - 8)`` (scale ``d``, zero 0) and Q4_1 is
``d * q + m`` (scale ``d``, zero ``m + 8 d``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from splitserve.model.config import DecoderConfig
from splitserve.model.gguf_file import open_gguf
from splitserve.model.loader import (
    fused_parts,
    gguf_fused_name,
    gguf_to_hf_name,
    partial_rotary_rows,
    unpermute_gguf_rows,
)

GROUP_SIZE = 32
_BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20}


@dataclass(slots=True)
class Int4Weight:
    """A [N, K] weight as 4-bit codes with one (scale, zero) pair per row and group of 32 columns."""

    codes: torch.Tensor  # [N, K] int32 in [0, 15]
    scales: torch.Tensor  # [N, K / 32] float32
    zeros: torch.Tensor  # [N, K / 32] float32

    @staticmethod
    def concat(parts: list[Int4Weight]) -> Int4Weight:
        """Stack weights along the output rows (for fused q/k/v and gate/up projections)."""
        return Int4Weight(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scales", "zeros")))

    def pack(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed codes, scales_and_zeros [K/32, N, 2] in ``dtype``) for ``_weight_int4pack_mm_for_cpu``."""
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.codes, 1)
        scales_zeros = torch.stack([self.scales.t(), self.zeros.t()], dim=-1).to(dtype).contiguous()
        return packed, scales_zeros


def load_gguf_int4(path: str | Path, config: DecoderConfig) -> dict[str, Int4Weight]:
    """The Q4_0/Q4_1 linear weights of a GGUF file, HF-named, with q/k rows un-permuted like ``load_gguf``.

    Tensors in other formats are left out (they run from the dequantized weights).
    """
    weights: dict[str, Int4Weight] = {}
    for tensor in open_gguf(path).tensors:
        block_bytes = _BLOCK_BYTES.get(tensor.tensor_type)
        if block_bytes is None or len(tensor.shape) != 2:
            continue
        name = gguf_fused_name(gguf_to_hf_name(tensor.name, config), config)
        num_cols, num_rows = (int(n) for n in tensor.shape)
        blocks = np.asarray(tensor.data).reshape(num_rows, num_cols // GROUP_SIZE, block_bytes)
        weight = _decode_blocks(blocks, tensor.tensor_type == GGMLQuantizationType.Q4_1)
        order = unpermute_gguf_rows(np.arange(num_rows)[:, None], name, config)[:, 0]
        for part, start, stop in fused_parts(name, num_rows, config):
            rows = partial_rotary_rows(order[start:stop], part, config)
            weights[part] = Int4Weight(*(t[torch.from_numpy(rows.copy())] for t in weight))
    return weights


def _decode_blocks(blocks: np.ndarray, has_min: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """blocks: [N, groups, bytes] of llama.cpp block_q4_0/block_q4_1 -> (codes, scales, zeros)."""
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    offset = 4 if has_min else 2
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if has_min else np.zeros_like(d)
    qs = blocks[..., offset : offset + GROUP_SIZE // 2]
    # byte j holds weight j in its low nibble and weight j + 16 in its high nibble
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(blocks.shape[0], -1).astype(np.int32)
    return torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m + 8.0 * d)


def int4_matmul_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")

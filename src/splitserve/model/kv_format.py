"""The KV cache's storage formats (``--kv-cache-dtype``): the model's own dtype, or int8.

The cache is one tensor ``[layers, 2, slots, kv_heads, row]`` (attention.py's layout). In the model's dtype a
row is ``head_dim`` values. In **int8** it is ``head_dim`` int8 values followed by one exponent byte per group of
16 values (``csrc/common.h``): 68 bytes per KV head row at head size 64 against 128 in bfloat16. A group's scale
is the smallest power of two (at least 2^-126) with ``max |x| <= 127 * scale``; each value is ``rint(x / scale)``,
ties to even. A stored value is then exactly a bfloat16, so attention widens a row to
bfloat16 without rounding and runs the bfloat16 arithmetic on it: an int8 cache answers as a bfloat16 cache
holding the same values would, on every path (decode rows, prefill chunks, a cache hit, a tier or a PD push,
which all move these bytes as they are).

Everything that moves KV (block copies, L1/L2 records, PD pushes) moves the tensor's rows whatever their
format; the layout string (``keys.kv_layout``: the storage dtype and the row width) differs between formats, so a
reader of another format gets a miss, never a misread record.
"""

from __future__ import annotations

import torch

INT8_GROUP = 16  # csrc/common.h SS_KV_INT8_GROUP: values per exponent byte
_MIN_EXPONENT = -126


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype for a ``--kv-cache-dtype`` value (``config.KVCacheDtype``): ``auto`` is the model's."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "int8":
        return torch.int8
    raise ValueError(f"--kv-cache-dtype must be auto or int8; got {kv_cache_dtype!r}")


def check_head_dim(dtype: torch.dtype, head_dim: int) -> None:
    """ValueError where the format cannot hold heads of ``head_dim``."""
    if dtype == torch.int8 and head_dim % INT8_GROUP:
        raise ValueError(f"--kv-cache-dtype int8 needs a head size that is a multiple of {INT8_GROUP}, not {head_dim}")


def is_int8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def row_width(dtype: torch.dtype, head_dim: int) -> int:
    """Elements of the cache's last dimension for one KV head of ``head_dim`` values."""
    return head_dim + head_dim // INT8_GROUP if dtype == torch.int8 else head_dim


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., head_dim]`` (any float dtype) to int8 rows ``[..., head_dim + head_dim / 16]``: csrc/common.h's
    ``kv_int8_store_row``, byte for byte."""
    head_dim = x.shape[-1]
    check_head_dim(torch.int8, head_dim)
    xf = x.float().reshape(*x.shape[:-1], head_dim // INT8_GROUP, INT8_GROUP)
    amax = xf.abs().nan_to_num(nan=0.0).amax(dim=-1, keepdim=True).clamp(max=3.0e38)  # NaN left out, inf capped
    _, exp = torch.frexp(amax)  # amax = m * 2^exp, m in [0.5, 1): ilogb(amax) = exp - 1
    e = exp - 7
    e = torch.where(torch.ldexp(amax, (-e).float()) > 127.0, e + 1, e)
    e = torch.where(amax > 0, e.clamp(min=_MIN_EXPONENT), torch.zeros_like(e))
    q = torch.ldexp(xf, (-e).float()).round().nan_to_num(nan=0.0).clamp(-127, 127).to(torch.int8)
    return torch.cat([q.flatten(-2), e.squeeze(-1).to(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows ``[..., head_dim + head_dim / 16]`` to ``[..., head_dim]`` values in ``dtype`` (exact in bfloat16
    and wider)."""
    head_dim = rows.shape[-1] * INT8_GROUP // (INT8_GROUP + 1)
    q = rows[..., :head_dim].float().unflatten(-1, (head_dim // INT8_GROUP, INT8_GROUP))
    scale = torch.ldexp(torch.ones((), device=rows.device), rows[..., head_dim:].float())[..., None]
    return (q * scale).flatten(-2).to(dtype)

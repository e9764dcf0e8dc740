"""The KV cache's storage formats (``--kv-cache-dtype``): the model's own dtype, int8, or fp8 (E4M3).

The cache is one tensor ``[layers, 2, slots, kv_heads, row]`` (attention.py's layout). In the model's dtype a
row is ``head_dim`` values. The two **packed** formats (``csrc/common.h``) store ``head_dim`` bytes followed by one
exponent byte per group of 16 values: 68 bytes per KV head row at head size 64 against 128 in bfloat16.

- **int8** (a ``torch.int8`` cache): a group's scale is the least power of two (at least 2^-126) with
  ``max |x| <= 127 * scale``; each value is ``rint(x / scale)``, ties to even.
- **fp8** (vLLM's name, also ``fp8_e4m3``; a ``torch.uint8`` cache holding E4M3FN bytes): the least power of two
  in [2^-117, 2^119] with ``max |x| <= 448 * scale``; each value is ``x / scale`` cast to E4M3, ties to even.
  Four significant bits against int8's up to seven, in the same bytes: int8 is the more accurate.

A stored value is then exactly a bfloat16, so attention widens a row to bfloat16 without rounding and runs the
bfloat16 arithmetic on it: a packed cache answers as a bfloat16 cache holding the same values would, on every path
(decode rows, prefill chunks, a cache hit, a tier or a PD push, which all move these bytes as they are).

Everything that moves KV (block copies, L1/L2 records, PD pushes) moves the tensor's rows whatever their
format; the layout string (``keys.kv_layout``: :func:`layout_name` and the row width) differs between formats, so
a reader of another format gets a miss, never a misread record.
"""

from __future__ import annotations

import torch

GROUP = 16  # csrc/common.h SS_KV_INT8_GROUP: values per exponent byte
PACKED = (torch.int8, torch.uint8)  # int8, fp8 (E4M3 bytes)
_INT8_MIN_EXPONENT = -126
_FP8_EXPONENTS = (-117, 119)  # csrc/common.h SS_KV_FP8_MIN_EXPONENT, SS_KV_FP8_MAX_EXPONENT
_FP8_MAX = 448.0


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype for a ``--kv-cache-dtype`` value (``config.KVCacheDtype``): ``auto`` is the model's."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "int8":
        return torch.int8
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return torch.uint8
    raise ValueError(f"--kv-cache-dtype must be auto, int8, fp8 or fp8_e4m3; got {kv_cache_dtype!r}")


def layout_name(dtype: torch.dtype) -> str:
    """The cache's format as the layout string names it: the dtype's name, fp8_e4m3 for the fp8 bytes."""
    return "fp8_e4m3" if dtype == torch.uint8 else str(dtype).removeprefix("torch.")


def check_head_dim(dtype: torch.dtype, head_dim: int) -> None:
    """ValueError where the format cannot hold heads of ``head_dim``."""
    if dtype in PACKED and head_dim % GROUP:
        raise ValueError(
            f"--kv-cache-dtype {layout_name(dtype)} needs a head size that is a multiple of {GROUP}, not {head_dim}"
        )


def is_packed(cache: torch.Tensor) -> bool:
    return cache.dtype in PACKED


def row_width(dtype: torch.dtype, head_dim: int) -> int:
    """Elements of the cache's last dimension for one KV head of ``head_dim`` values."""
    return head_dim + head_dim // GROUP if dtype in PACKED else head_dim


def quantize_rows(x: torch.Tensor, dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """``x [..., head_dim]`` (any float dtype) to packed rows ``[..., head_dim + head_dim / 16]`` of ``dtype``
    (int8, or uint8 for fp8): csrc/common.h's ``kv_int8_store_row`` / ``kv_fp8_store_row``, byte for byte."""
    head_dim = x.shape[-1]
    check_head_dim(dtype, head_dim)
    xf = x.float().reshape(*x.shape[:-1], head_dim // GROUP, GROUP)
    amax = xf.abs().nan_to_num(nan=0.0).amax(dim=-1, keepdim=True).clamp(max=3.0e38)  # NaN left out, inf capped
    _, exp = torch.frexp(amax)  # amax = m * 2^exp, m in [0.5, 1): ilogb(amax) = exp - 1
    top, least, most = (127.0, _INT8_MIN_EXPONENT, 127) if dtype == torch.int8 else (_FP8_MAX, *_FP8_EXPONENTS)
    e = exp - (7 if dtype == torch.int8 else 9)  # amax / 2^e in [64, 128) or [256, 512)
    e = torch.where(torch.ldexp(amax, (-e).float()) > top, e + 1, e)
    e = torch.where(amax > 0, e.clamp(min=least, max=most), torch.zeros_like(e))
    y = torch.ldexp(xf, (-e).float()).nan_to_num(nan=0.0)
    if dtype == torch.int8:
        q = y.round().clamp(-127, 127).to(torch.int8)
    else:
        q = y.clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([q.flatten(-2), e.squeeze(-1).to(torch.int8).view(dtype)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed rows ``[..., head_dim + head_dim / 16]`` (int8, or uint8 for fp8) to ``[..., head_dim]`` values in
    ``dtype`` (exact in bfloat16 and wider)."""
    head_dim = rows.shape[-1] * GROUP // (GROUP + 1)
    values = rows[..., :head_dim]
    q = values.float() if rows.dtype == torch.int8 else values.contiguous().view(torch.float8_e4m3fn).float()
    exponents = rows[..., head_dim:].contiguous().view(torch.int8).float()
    scale = torch.ldexp(torch.ones((), device=rows.device), exponents)[..., None]
    return (q.unflatten(-1, (head_dim // GROUP, GROUP)) * scale).flatten(-2).to(dtype)

"""Rotary position embeddings: the inverse frequencies of each scaling kind, from a Hugging Face config or a GGUF.

Every kind ends in one static table of cos and sin per position, which the model and the native forward step read:
a position's rotation never depends on the sequence's length, so a token's K is the same bits in every step that
computes it (a prefix-cache hit, a PD push or an L2 record reuses K computed for another request).

- ``default``: ``1 / theta^(2i / d)``.
- ``linear``: the default frequencies divided by ``factor`` (position interpolation).
- ``llama3`` (Llama 3.1 and later): long wavelengths divided by ``factor``, short ones kept, a smooth ramp between.
  A GGUF carries the same as ``rope_freqs``, one divisor per rotary pair (llama.cpp's converter computes them).
- ``yarn``: interpolated and extrapolated frequencies blended by a linear ramp over the rotary pairs, and cos/sin
  multiplied by an attention factor (``0.1 ln(factor) + 1`` unless given).
- ``dynamic`` (dynamic NTK): transformers recomputes the base as the sequence grows past the pretrained length,
  which would change the rotation of tokens already in the KV cache. As vLLM does, the base is fixed at what it
  would be at ``factor`` times the pretrained length. Below the pretrained length transformers' rotation is
  unscaled, so the two differ there.
- ``longrope`` (Phi-3's, once called ``su``): each pair's frequency divided by a per-pair factor, the short factors
  below the pretrained length and the long ones past it, and cos/sin multiplied by
  ``sqrt(1 + ln(factor) / ln(pretrained length))``. transformers picks one set for the whole sequence by its
  length, which would change the rotation of tokens already cached once a sequence grows past the pretrained
  length; here the set is picked per position, so a position's rotation is fixed. Within the pretrained length
  the two are the same; past it transformers' rotation of the earlier positions differs (llama.cpp picks by
  the context size it is given, vLLM by the longest sequence of the batch).

A partial rotary embedding (Phi-4-mini: ``partial_rotary_factor`` 0.75) rotates the first ``rotary_dim`` dims of each
head as a ``rotary_dim``-wide rotate-half and passes the rest through. Here every head keeps the full-width
rotate-half layout: the loaders reorder each q and k head's dims (``partial_rotary_order``) so that rotary pair
``(i, i + rotary_dim / 2)`` sits at ``(i, i + head_dim / 2)``, and the passed-through dims fill the other pairs, whose
cos is 1 and sin 0. q and k are reordered alike, so their dot products, and the model, are unchanged; only the
kernels' tables differ, and they need no second layout.

Frequencies are computed in float64 and the tables stored as float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

ROPE_KINDS = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """How the rotary frequencies are scaled; ``kind`` one of ``ROPE_KINDS``."""

    kind: str = "default"
    factor: float = 1.0
    original_max_positions: int | None = None  # the pretrained context (llama3, yarn, dynamic, longrope)
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn, longrope: cos/sin multiplier; None: from factor
    truncate: bool = True  # yarn: round the ramp's ends to whole pairs
    freq_factors: tuple[float, ...] | None = None  # a GGUF's rope_freqs: each pair's frequency divided by its factor
    short_factors: tuple[float, ...] | None = None  # longrope: each pair's divisor below the pretrained length
    long_factors: tuple[float, ...] | None = None  # longrope: and from it on

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"unsupported rope scaling {self.kind!r}; supported: {', '.join(ROPE_KINDS)}")
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be positive, got {self.factor}")
        if self.kind == "longrope" and (self.short_factors is None or self.long_factors is None):
            raise ValueError("longrope rope scaling needs short_factor and long_factor")


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """The ``[head_dim / 2]`` float64 inverse frequencies and the factor cos/sin are multiplied by."""
    scaling = scaling or RopeScaling()
    dim = head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    inv_freq = 1.0 / (theta**exponents)
    attention = 1.0
    if scaling.freq_factors is not None:
        factors = torch.tensor(scaling.freq_factors, dtype=torch.float64)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_freqs has {factors.numel()} factors for {inv_freq.numel()} rotary pairs")
        inv_freq = inv_freq / factors
    if scaling.kind == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    elif scaling.kind == "dynamic":
        original = _original(scaling)
        max_len = original * scaling.factor
        base = theta * ((scaling.factor * max_len / original) - (scaling.factor - 1)) ** (dim / (dim - 2))
        inv_freq = 1.0 / (base**exponents)
    elif scaling.kind == "yarn":
        inv_freq, attention = _yarn(theta, dim, scaling)
    elif scaling.kind == "longrope":
        inv_freq, attention = inv_freq / _pair_factors(scaling.short_factors, inv_freq), _longrope_attention(scaling)
    return inv_freq, attention


def partial_rotary_order(head_dim: int, rotary_dim: int) -> list[int]:
    """For each dim of a reordered head, the checkpoint's dim it holds: the rotary pairs' first halves, the first
    half of the passed-through dims, the rotary pairs' second halves, the rest (see the module's docstring)."""
    half, rotary_half = head_dim // 2, rotary_dim // 2
    passed, first_half = list(range(rotary_dim, head_dim)), half - rotary_half
    return [*range(rotary_half), *passed[:first_half], *range(rotary_half, rotary_dim), *passed[first_half:]]


def rotary_tables(
    head_dim: int, theta: float, scaling: RopeScaling | None, max_positions: int, rotary_dim: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, ``[max_positions, head_dim]`` float32 each, rotate-half layout (each frequency twice); with a
    ``rotary_dim`` below ``head_dim``, its frequencies in the reordered heads' rotary pairs (``partial_rotary_order``)
    and cos 1, sin 0 in the others."""
    if rotary_dim is not None and rotary_dim != head_dim:
        cos_r, sin_r = rotary_tables(rotary_dim, theta, scaling, max_positions)
        half, rotary_half = head_dim // 2, rotary_dim // 2
        cos, sin = torch.ones(max_positions, head_dim), torch.zeros(max_positions, head_dim)
        for table, part in ((cos, cos_r), (sin, sin_r)):
            table[:, :rotary_half], table[:, half : half + rotary_half] = part[:, :rotary_half], part[:, rotary_half:]
        return cos, sin
    inv_freq, attention = inverse_frequencies(head_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    if scaling is not None and scaling.kind == "longrope":  # the long factors from the pretrained length on
        original = _original(scaling)
        plain, _ = inverse_frequencies(head_dim, theta, None)
        long_freq = plain / _pair_factors(scaling.long_factors, plain)
        positions = torch.arange(original, max(max_positions, original), dtype=torch.float64)
        freqs[original:] = torch.outer(positions, long_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * attention).float(), (emb.sin() * attention).float()


def _original(scaling: RopeScaling) -> int:
    if scaling.original_max_positions is None:
        raise ValueError(f"rope scaling {scaling.kind!r} needs original_max_position_embeddings")
    return scaling.original_max_positions


def _pair_factors(factors: tuple[float, ...] | None, inv_freq: torch.Tensor) -> torch.Tensor:
    values = torch.tensor(factors or (), dtype=torch.float64)
    if values.shape != inv_freq.shape:
        raise ValueError(f"longrope has {values.numel()} factors for {inv_freq.numel()} rotary pairs")
    return values


def _longrope_attention(s: RopeScaling) -> float:
    """cos/sin's multiplier: the given one, else transformers' (and llama.cpp's converter's) from the factor."""
    if s.attention_factor is not None:
        return s.attention_factor
    return math.sqrt(1 + math.log(s.factor) / math.log(_original(s))) if s.factor > 1 else 1.0


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    original = _original(s)
    low_wavelen, high_wavelen = original / s.low_freq_factor, original / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(theta: float, dim: int, s: RopeScaling) -> tuple[torch.Tensor, float]:
    original = _original(s)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of one point
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    attention = s.attention_factor
    if attention is None:
        attention = 0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0
    return inv_freq, attention


def hf_rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` from a Hugging Face ``config.json``: ``rope_scaling`` (transformers 4) or
    ``rope_parameters`` (transformers 5). ``ValueError`` for a kind this module does not compute."""
    params: dict[str, Any] = {}
    for key in ("rope_parameters", "rope_scaling"):  # the older key, where a config has both, as transformers 5
        value = hf.get(key) or {}
        if not isinstance(value, dict):
            raise ValueError(f"{key} {value!r} is not an object")
        params.update(value)
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = str(params.get("rope_type", params.get("type", "default")))
    kind = "longrope" if kind == "su" else kind  # Phi-3's first name for it
    if kind == "default":
        return theta, None
    if kind not in ROPE_KINDS:
        raise ValueError(f"unsupported rope scaling {kind!r}; supported: {', '.join(ROPE_KINDS)}")
    original = params.get("original_max_position_embeddings")
    if kind == "longrope":  # Phi-3 keeps it beside rope_scaling, and it wins there (as in transformers)
        original = hf.get("original_max_position_embeddings", original)
    if original is None and kind in ("dynamic", "yarn", "llama3", "longrope"):
        original = hf.get("max_position_embeddings")
    factor = params.get("factor")
    if factor is None and kind in ("yarn", "longrope") and original:
        factor = float(hf["max_position_embeddings"]) / float(original)
    attention = params.get("attention_factor")
    if kind == "yarn" and attention is None and params.get("mscale") and params.get("mscale_all_dim"):
        raise ValueError("yarn rope scaling with mscale/mscale_all_dim (DeepSeek's MLA) is not supported")
    return theta, RopeScaling(
        kind=kind,
        factor=float(factor if factor is not None else 1.0),
        original_max_positions=None if original is None else int(original),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=None if attention is None else float(attention),
        truncate=bool(params.get("truncate", True)),
        short_factors=_floats(params.get("short_factor")),
        long_factors=_floats(params.get("long_factor")),
    )


def _floats(values: Any) -> tuple[float, ...] | None:
    return None if values is None else tuple(float(v) for v in values)


def gguf_rope(
    metadata: dict[str, Any],
    arch: str,
    freq_factors: tuple[float, ...] | None,
    long_short: tuple[tuple[float, ...], tuple[float, ...]] | None = None,
) -> RopeScaling | None:
    """The scaling a GGUF's ``{arch}.rope.scaling.*`` keys and ``rope_freqs`` tensor describe, as llama.cpp's
    converter writes them (longrope: its ``rope_factors_long`` and ``rope_factors_short`` tensors, ``long_short``);
    ``ValueError`` for a kind this module does not compute."""
    kind = str(metadata.get(f"{arch}.rope.scaling.type", "none"))
    key = f"{arch}.rope.scaling."
    if long_short is not None:
        pretrained = int(metadata.get(key + "original_context_length", metadata.get(f"{arch}.context_length", 0)))
        context = int(metadata.get(f"{arch}.context_length", pretrained))
        attn = metadata.get(key + "attn_factor")
        return RopeScaling(
            kind="longrope",
            factor=context / pretrained if pretrained else 1.0,
            original_max_positions=pretrained or None,
            attention_factor=None if attn is None else float(attn),
            long_factors=long_short[0],
            short_factors=long_short[1],
        )
    if kind in ("none", ""):
        return None if freq_factors is None else RopeScaling(freq_factors=freq_factors)
    if kind not in ("linear", "yarn"):
        raise ValueError(f"unsupported GGUF rope scaling {kind!r}; supported: none, linear, yarn and rope_freqs")
    original = metadata.get(key + "original_context_length")
    attention = metadata.get(key + "yarn_attn_factor", metadata.get(key + "attn_factor"))
    return RopeScaling(
        kind=kind,
        factor=float(metadata.get(key + "factor", 1.0)),
        original_max_positions=None if original is None else int(original),
        beta_fast=float(metadata.get(key + "yarn_beta_fast", 32.0)),
        beta_slow=float(metadata.get(key + "yarn_beta_slow", 1.0)),
        attention_factor=None if attention is None else float(attention),
        freq_factors=freq_factors,
    )

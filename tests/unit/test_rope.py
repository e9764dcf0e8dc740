"""Rotary scaling (``model/rope.py``): the kinds transformers does not check here (dynamic, as vLLM fixes it) and
what a GGUF's keys and ``rope_freqs`` tensor mean. The other kinds are checked against transformers' logits in
``tests/engine/test_architectures.py``."""

from __future__ import annotations

import math

import pytest
import torch

from splitserve.model.rope import RopeScaling, gguf_rope, hf_rope, inverse_frequencies, rotary_tables


def test_dynamic_ntk_fixes_the_base_at_factor_times_the_pretrained_length() -> None:
    scaling = RopeScaling(kind="dynamic", factor=4.0, original_max_positions=2048)
    inv_freq, attention = inverse_frequencies(64, 10000.0, scaling)
    base = 10000.0 * (4.0 * 4.0 - 3.0) ** (64 / 62)  # vLLM's DynamicNTKScalingRotaryEmbedding at 4 x 2048
    expected = 1.0 / base ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    torch.testing.assert_close(inv_freq, expected, rtol=1e-12, atol=0)
    assert attention == 1.0


def test_a_ggufs_rope_freqs_divide_each_pairs_frequency() -> None:
    factors = tuple(float(i + 1) for i in range(8))
    scaling = gguf_rope({"llama.rope.freq_base": 10000.0}, "llama", factors)
    inv_freq, _ = inverse_frequencies(16, 10000.0, scaling)
    plain, _ = inverse_frequencies(16, 10000.0, None)
    torch.testing.assert_close(inv_freq, plain / torch.tensor(factors, dtype=torch.float64))
    with pytest.raises(ValueError, match="rope_freqs has 8 factors for 4 rotary pairs"):
        inverse_frequencies(8, 10000.0, scaling)


def test_gguf_yarn_keys() -> None:
    meta = {
        "qwen2.rope.scaling.type": "yarn",
        "qwen2.rope.scaling.factor": 4.0,
        "qwen2.rope.scaling.original_context_length": 32768,
    }
    scaling = gguf_rope(meta, "qwen2", None)
    assert scaling == RopeScaling(kind="yarn", factor=4.0, original_max_positions=32768)
    cos, sin = rotary_tables(64, 1e6, scaling, 4)
    mscale = 0.1 * math.log(4.0) + 1.0  # cos and sin carry YaRN's attention factor
    assert cos[0, 0].item() == pytest.approx(mscale)
    assert sin[0].abs().max().item() == 0.0
    with pytest.raises(ValueError, match="unsupported GGUF rope scaling 'longrope'"):
        gguf_rope({"phi3.rope.scaling.type": "longrope"}, "phi3", None)


def test_hf_rope_reads_both_transformers_layouts() -> None:
    old = {
        "rope_theta": 5e5,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192},
    }
    new = {
        "rope_parameters": {
            "rope_theta": 5e5,
            "rope_type": "llama3",
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
        }
    }
    assert hf_rope(old) == hf_rope(new)
    theta, scaling = hf_rope(old)
    assert theta == 5e5 and scaling is not None and scaling.kind == "llama3"
    assert hf_rope({"rope_theta": 1e4}) == (1e4, None)
    assert hf_rope({"rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}}) == (1e4, None)


def test_longrope_takes_the_short_factors_below_the_pretrained_length_and_the_long_ones_from_it() -> None:
    """Phi-3's layout (``rope_scaling`` of type ``su``, ``original_max_position_embeddings`` beside it): each
    position's rotation from one set of factors, and cos/sin scaled by sqrt(1 + ln(factor) / ln(original))."""
    short, long = [1.0 + 0.1 * i for i in range(4)], [1.0 + 2.0 * i for i in range(4)]
    hf = {
        "max_position_embeddings": 64,
        "original_max_position_embeddings": 16,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "su", "short_factor": short, "long_factor": long},
    }
    theta, scaling = hf_rope(hf)
    assert scaling is not None and scaling.kind == "longrope" and scaling.original_max_positions == 16
    assert scaling.factor == 4.0
    cos, sin = rotary_tables(8, theta, scaling, 64)
    plain = 1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    mscale = math.sqrt(1 + math.log(4.0) / math.log(16))
    for position, factors in ((3, short), (15, short), (16, long), (63, long)):
        angles = position * plain / torch.tensor(factors, dtype=torch.float64)
        torch.testing.assert_close(cos[position, :4].double(), angles.cos() * mscale, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(sin[position, 4:].double(), angles.sin() * mscale, rtol=1e-6, atol=1e-7)
    # the GGUF's form: llama.cpp's converter writes both sets as tensors and the factor as attn_factor
    meta = {"phi3.context_length": 64, "phi3.rope.scaling.original_context_length": 16,
            "phi3.rope.scaling.attn_factor": mscale}  # fmt: skip
    from_gguf = gguf_rope(meta, "phi3", None, (tuple(long), tuple(short)))
    assert from_gguf is not None
    torch.testing.assert_close(rotary_tables(8, theta, from_gguf, 64)[0], cos)
    with pytest.raises(ValueError, match="longrope has 3 factors for 4 rotary pairs"):
        rotary_tables(8, theta, RopeScaling(kind="longrope", original_max_positions=16, short_factors=(1.0,) * 3,
                                            long_factors=(1.0,) * 3), 64)  # fmt: skip

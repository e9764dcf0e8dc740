"""transformers' own ``LlamaForCausalLM`` holding weights we loaded: the reference for tests and benchmarks.

Never used to serve; imports ``transformers`` (and so torch) when imported.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

from splitserve.model.config import DecoderConfig


def transformers_config(cfg: DecoderConfig, attn_implementation: str = "eager") -> transformers.LlamaConfig:
    """The ``transformers.LlamaConfig`` describing the same architecture as ``cfg``."""
    # a dict: transformers 5 reads rope_theta from kwargs but its signature no longer names it
    kwargs: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        attn_implementation=attn_implementation,
    )
    return transformers.LlamaConfig(**kwargs)


def transformers_model(
    cfg: DecoderConfig,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "eager",
) -> transformers.LlamaForCausalLM:
    """A transformers model with the HF-named ``state`` loaded (tied head re-tied), in ``dtype``, eval mode.

    ``attn_implementation``: ``eager`` for exact comparisons, ``sdpa`` (transformers' default) for speed.

    Raises ``ValueError`` if ``state`` has tensors the model does not know or lacks any but a tied head.
    """
    model = transformers.LlamaForCausalLM(transformers_config(cfg, attn_implementation))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise ValueError(f"weights do not fit transformers' Llama: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    torch.nn.Module.to(model, dtype)  # in place; transformers types its own .to() oddly
    return model.eval()

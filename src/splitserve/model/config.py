"""The architecture hyper-parameters of a decoder model (one of ``model/arch.py``'s architectures)."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.model.rope import RopeScaling


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    arch: str = "llama"  # a key of model.arch.ARCHITECTURES
    qkv_bias: bool = False  # q, k and v projections add a bias
    o_bias: bool = False  # the output projection adds a bias
    qk_norm: bool = False  # RMSNorm over each head of q and k before the rotation
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None  # each token attends to at most this many positions (itself included)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for the rotary embedding")

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes per token per element byte: multiply by the element size of the cache dtype."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim

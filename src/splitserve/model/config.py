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
    sliding_window: int | None = None  # a sliding layer's token attends to at most this many positions (itself too)
    sliding_layers: tuple[bool, ...] | None = None  # which layers slide (None: all of them, where there is a window)
    sliding_rope_theta: float | None = None  # the sliding layers' own rotary base, unscaled (Gemma 3's local layers)
    hidden_act: str = "silu"  # the MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
    sandwich_norms: bool = False  # the attention's and the MLP's outputs are RMS-normed before the residual (Gemma)
    embed_scale: float | None = None  # the token embeddings are multiplied by it (Gemma: sqrt(hidden_size))
    attention_scale: float | None = None  # the scores' scale (None: head_dim ** -0.5)
    rotary_dim: int | None = None  # the dims of each head that rotate (Phi-4-mini: 3/4 of them); None: all
    attn_softcap: float | None = None  # scores capped to c * tanh(score / c) before the softmax (Gemma 2)
    final_softcap: float | None = None  # logits capped the same way (Gemma 2)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for the rotary embedding")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_hidden_layers:
            raise ValueError(f"{len(self.sliding_layers)} sliding-layer flags for {self.num_hidden_layers} layers")
        if self.rotary_dim is not None and (self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim):
            raise ValueError(f"rotary_dim ({self.rotary_dim}) must be even and within head_dim ({self.head_dim})")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (silu, gelu_tanh)")

    def window_of(self, layer: int) -> int | None:
        """The sliding window of ``layer``, or None where it attends to the whole context."""
        if self.sliding_window is None or (self.sliding_layers is not None and not self.sliding_layers[layer]):
            return None
        return self.sliding_window

    def slides_with_own_rope(self, layer: int) -> bool:
        """Whether ``layer`` rotates with ``sliding_rope_theta`` rather than the model's rotary embedding."""
        return self.sliding_rope_theta is not None and self.window_of(layer) is not None

    @property
    def attention_scale_or_default(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes per token per element byte: multiply by the element size of the cache dtype."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim

"""The decoder architectures splitserve runs, each a small description of how it differs from Llama.

One model (``model/decoder.py``) and one native forward step (``csrc/forward_step.c``) run every architecture
here; an entry only names its checkpoints (Hugging Face ``architectures`` and ``model_type``, the GGUF's
``general.architecture``) and switches the few ops it adds:

- ``qkv_bias``: the q, k and v projections add a bias (Qwen2 always; Llama and Qwen3 where ``attention_bias``);
- ``qk_norm``: an RMSNorm over each head of q and of k before the rotation (Qwen3);
- ``gguf_permutes_qk``: llama.cpp's converter reorders each q/k head's rows for its interleaved rotation (Llama's
  GGUFs); the loader puts them back in Hugging Face's rotate-half order. Qwen's GGUFs keep rotate-half order;
- ``sliding_window_switch``: the config key that turns ``sliding_window`` on (Qwen's ``use_sliding_window``,
  off by default); without one, a ``sliding_window`` in the config is always in force (Mistral, Phi-3);
- ``fused``: the checkpoint holds q, k and v as one ``qkv_proj`` and gate and up as one ``gate_up_proj`` (Phi-3;
  its GGUF as ``attn_qkv`` and a double-height ``ffn_up``); the loaders split them into Llama's matrices;
- ``gemma``: Gemma's differences from Llama: RMSNorm weights stored as ``w - 1`` in Hugging Face checkpoints
  (llama.cpp's converter adds the 1), the attention's and the MLP's outputs RMS-normed before they join the
  residual stream (``post_attention_layernorm`` and ``post_feedforward_layernorm``; the MLP's input norm is then
  ``pre_feedforward_layernorm``), embeddings scaled by ``sqrt(hidden_size)``, GeGLU (``gelu_pytorch_tanh``);
- ``sliding_pattern``: where a checkpoint does not list its layers' kinds, every ``sliding_pattern``-th layer attends
  to the whole context and the others through the sliding window (Gemma 3: 6, as in transformers and llama.cpp);
  ``sliding_rope_theta``: the sliding layers' rotary base when the GGUF does not give one (llama.cpp's default);
- ``gguf_wide_query_layers``: the layer count of the model whose GGUF, carrying no ``query_pre_attn_scalar``,
  scales the scores by ``(hidden / heads) ** -0.5`` rather than by the head size's (llama.cpp's rule for Gemma's
  27B models).

The table follows llama.cpp's architecture list and vLLM's model registry: an architecture is data, not a copy of
the model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Architecture:
    name: str  # ours, and the GGUF's general.architecture
    hf_architectures: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    qkv_bias: bool | None = False  # None: the config's attention_bias (which also biases the output projection)
    qk_norm: bool = False
    gguf_permutes_qk: bool = False
    sliding_window_switch: str | None = None
    fused: bool = False
    gemma: bool = False
    sliding_pattern: int | None = None
    sliding_rope_theta: float | None = None
    gguf_wide_query_layers: int | None = None


ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch
    for arch in (
        Architecture(
            "llama",
            ("LlamaForCausalLM", "MistralForCausalLM"),
            ("llama", "mistral"),
            qkv_bias=None,
            gguf_permutes_qk=True,
        ),
        Architecture(
            "qwen2", ("Qwen2ForCausalLM",), ("qwen2",), qkv_bias=True, sliding_window_switch="use_sliding_window"
        ),
        Architecture(
            "qwen3",
            ("Qwen3ForCausalLM",),
            ("qwen3",),
            qkv_bias=None,
            qk_norm=True,
            sliding_window_switch="use_sliding_window",
        ),
        Architecture("phi3", ("Phi3ForCausalLM",), ("phi3",), fused=True),
        Architecture(
            "gemma2", ("Gemma2ForCausalLM",), ("gemma2",), gemma=True, sliding_pattern=2, gguf_wide_query_layers=46
        ),
        Architecture(
            "gemma3",
            ("Gemma3ForCausalLM",),
            ("gemma3_text",),
            qk_norm=True,
            gemma=True,
            sliding_pattern=6,
            sliding_rope_theta=10000.0,
            gguf_wide_query_layers=62,
        ),
    )
}


def supported() -> str:
    """The supported architectures, for error messages: ``llama (LlamaForCausalLM, ...), qwen2 (...)``."""
    return ", ".join(f"{a.name} ({', '.join(a.hf_architectures)})" for a in ARCHITECTURES.values())


def for_gguf(name: object) -> Architecture:
    """The entry for a GGUF's ``general.architecture``; ``ValueError`` naming the supported list."""
    arch = ARCHITECTURES.get(str(name))
    if arch is None:
        raise ValueError(f"unsupported GGUF architecture {name!r}; supported: {supported()}")
    return arch


def for_hf(architectures: list[str], model_type: object) -> Architecture:
    """The entry for a Hugging Face config's ``architectures`` (or, when absent, ``model_type``)."""
    for arch in ARCHITECTURES.values():
        if set(architectures) & set(arch.hf_architectures) or (not architectures and model_type in arch.hf_model_types):
            return arch
    raise ValueError(f"unsupported architecture {architectures or model_type!r}; supported: {supported()}")

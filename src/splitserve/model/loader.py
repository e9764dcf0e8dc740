"""Weight loaders: a GGUF file or a Hugging Face safetensors folder -> (``DecoderConfig``, HF-named state dict).

Both loaders return tensors named as in Hugging Face's ``LlamaForCausalLM`` (``model.embed_tokens.weight``,
``model.layers.N.self_attn.q_proj.weight``...), ready for ``DecoderForCausalLM.load_hf_state_dict``. GGUF
tensors are dequantized one at a time and cast straight to the requested dtype, so peak memory is about one
copy of the model in that dtype plus one float32 tensor.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Collection, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import dequantize

from splitserve.model import arch as architectures
from splitserve.model.config import DecoderConfig
from splitserve.model.gguf_file import array_length, open_gguf
from splitserve.model.kernels import QUANT_TYPES, native
from splitserve.model.rope import RopeScaling, gguf_rope, hf_rope, partial_rotary_order

# GGUF leaf name -> Hugging Face name, for tensors inside a block (blk.N.<leaf>.weight).
_GGUF_BLOCK_LEAVES = {
    "attn_q": "self_attn.q_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Gemma's blocks: the MLP's input norm, and the norms of the attention's and the MLP's outputs (Hugging Face's names)
_GEMMA_GGUF_LEAVES = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GGUF_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GGUF_ROPE_FREQS = "rope_freqs.weight"  # llama3-style rope scaling: one frequency divisor per rotary pair
_GGUF_LONGROPE = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's longrope divisors
GGUF_ROPE_TENSORS = (_GGUF_ROPE_FREQS, *_GGUF_LONGROPE)  # tensors of the rotary scaling, not weights


# ---------------------------------------------------------------------------------------------- GGUF


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32, blocks_only: Collection[str] = ()
) -> tuple[DecoderConfig, dict[str, torch.Tensor]]:
    """Read a llama.cpp GGUF file into a config and a dequantized, HF-named state dict.

    Every tensor type that ``gguf.quants.dequantize`` supports is accepted (F32, F16, BF16, Q4_0, Q4_1,
    Q8_0, the K-quants, ...). Where llama.cpp's converter permuted the q and k projections (Llama), their rows
    are put back from its interleaved-RoPE order into Hugging Face's rotate-half order. Tensors come back
    contiguous, on CPU, in ``dtype``; the matrices named in ``blocks_only`` (HF names: those that will run from
    the file's quantized blocks) are not dequantized but come back as meta tensors of their shape.

    Raises ``ValueError`` for an architecture ``model/arch.py`` does not list, for missing metadata, or for a
    tensor name this loader does not know; ``FileNotFoundError`` when ``path`` does not exist.
    """
    reader = open_gguf(path)
    config = gguf_file_config(reader)
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        if tensor.name in GGUF_ROPE_TENSORS:
            continue
        name = gguf_fused_name(gguf_to_hf_name(tensor.name, config), config)
        rows, *cols = (int(n) for n in reversed(tensor.shape.tolist()))
        parts = fused_parts(name, rows, config)
        if blocks_only and all(part in blocks_only for part, _, _ in parts):
            for part, start, stop in parts:
                state[part] = torch.empty((stop - start, *cols), dtype=dtype, device="meta")
            continue
        array = _dequantize(tensor)
        array = unpermute_gguf_rows(array, name, config)
        for part, start, stop in parts:
            values = torch.from_numpy(partial_rotary_rows(array[start:stop], part, config))
            state[part] = values.to(weight_dtype(part, config, dtype)).contiguous()
    return config, state


def weight_dtype(hf_name: str, config: DecoderConfig, dtype: torch.dtype) -> torch.dtype:
    """The dtype a weight loads in: ``dtype``, but float32 for Gemma's norms, whose weights are ``1 + w`` with a
    small ``w`` (bfloat16's step just above 1 is 2^-7, which would round most of ``w`` away; transformers computes
    ``1 + w`` in float32 and llama.cpp keeps the sum in F32)."""
    return torch.float32 if _is_gemma_norm(hf_name, config) else dtype


def _is_gemma_norm(hf_name: str, config: DecoderConfig) -> bool:
    """Whether ``hf_name`` is one of Gemma's RMSNorm weights (a checkpoint's ``w``, the model's ``1 + w``)."""
    return architectures.ARCHITECTURES[config.arch].gemma and hf_name.endswith("norm.weight")


def gguf_fused_name(hf_name: str, config: DecoderConfig) -> str:
    """A fused architecture's GGUF ``ffn_up`` holds gate and up (llama.cpp's SwiGLU of one double-height matrix):
    its name is then ``gate_up_proj``, as in the Hugging Face checkpoint."""
    if architectures.ARCHITECTURES[config.arch].fused and hf_name.endswith("mlp.up_proj.weight"):
        return hf_name.replace("mlp.up_proj", "mlp.gate_up_proj")
    return hf_name


def fused_parts(name: str, rows: int, config: DecoderConfig) -> list[tuple[str, int, int]]:
    """The Llama-named matrices a tensor holds, each with its rows ``[start, stop)``: a fused ``qkv_proj`` is q,
    k and v, a ``gate_up_proj`` gate then up (Phi-3); any other tensor is itself. ``ValueError`` when a fused
    tensor's rows do not add up."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    inter = config.intermediate_size
    for fused, parts in ((".self_attn.qkv_proj.", (("q_proj", q), ("k_proj", kv), ("v_proj", kv))),
                         (".mlp.gate_up_proj.", (("gate_proj", inter), ("up_proj", inter)))):  # fmt: skip
        if fused not in name:
            continue
        if rows != sum(size for _, size in parts):
            raise ValueError(f"{name}: {rows} rows, not {' + '.join(str(n) for _, n in parts)} ({fused.strip('.')})")
        out, start = [], 0
        for part, size in parts:
            out.append((name.replace(fused, f".{fused.split('.')[1]}.{part}."), start, start + size))
            start += size
        return out
    return [(name, 0, rows)]


def gguf_file_config(reader: gguf.GGUFReader) -> DecoderConfig:
    """The ``DecoderConfig`` of an open GGUF: its metadata, and what its tensors show (a separate output head,
    biases, q/k norms, llama3-style ``rope_freqs``)."""
    metadata = _gguf_scalar_metadata(reader)
    names = {t.name for t in reader.tensors}
    tensors = {t.name: t for t in reader.tensors}

    def values(name: str) -> tuple[float, ...] | None:
        return None if name not in tensors else tuple(float(f) for f in _dequantize(tensors[name]).reshape(-1))

    long_factors, short_factors = (values(name) for name in _GGUF_LONGROPE)
    long_short = None if long_factors is None or short_factors is None else (long_factors, short_factors)
    config = gguf_config(
        metadata,
        num_tokens=_gguf_token_count(reader),
        rope_freq_factors=values(_GGUF_ROPE_FREQS),
        long_short=long_short,
    )
    pattern = reader.fields.get(f"{config.arch}.attention.sliding_window_pattern")
    if config.sliding_window is not None and pattern is not None and pattern.types[0] == gguf.GGUFValueType.ARRAY:
        kinds = tuple(bool(kind) for kind in pattern.contents())  # a flag per layer
        config = replace(config, sliding_layers=None if all(kinds) else kinds)
    return replace(
        config,
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
    )


def gguf_config(
    metadata: dict[str, Any],
    num_tokens: int | None = None,
    rope_freq_factors: tuple[float, ...] | None = None,
    long_short: tuple[tuple[float, ...], tuple[float, ...]] | None = None,
) -> DecoderConfig:
    """Build a ``DecoderConfig`` from GGUF scalar metadata (keys such as ``llama.block_count``).

    ``num_tokens`` is the length of ``tokenizer.ggml.tokens``, used when ``{arch}.vocab_size`` is absent;
    ``rope_freq_factors`` the ``rope_freqs`` tensor's values, ``long_short`` longrope's (Phi-3's). Assumes tied
    embeddings and no biases; ``gguf_file_config`` corrects both from the tensor list.
    """
    spec = architectures.for_gguf(metadata.get("general.architecture"))
    arch = spec.name

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in metadata:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return metadata[f"{arch}.{key}"]

    hidden = int(need("embedding_length"))
    num_heads = int(need("attention.head_count"))
    vocab = metadata.get(f"{arch}.vocab_size", num_tokens)
    if vocab is None:
        raise ValueError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden // num_heads))  # llama.cpp's n_embd_head_k
    rotary_dim = int(metadata.get(f"{arch}.rope.dimension_count", head_dim))  # and its n_rot
    num_layers = int(need("block_count"))
    window = _optional_int(metadata.get(f"{arch}.attention.sliding_window")) or None
    sliding = None
    if window is not None and spec.sliding_pattern is not None:  # llama.cpp's set_swa_pattern, as its loader does
        pattern = metadata.get(f"{arch}.attention.sliding_window_pattern", spec.sliding_pattern)
        sliding = tuple(int(pattern) == 0 or i % int(pattern) < int(pattern) - 1 for i in range(num_layers))
        window = window if any(sliding) else None
    sliding_theta = metadata.get(f"{arch}.rope.freq_base_swa", spec.sliding_rope_theta)
    return DecoderConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(metadata.get(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rotary_dim=None if rotary_dim == head_dim else rotary_dim,
        rope_theta=_float32_value(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=_float32_value(metadata.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(metadata.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings=True,
        bos_token_id=_optional_int(metadata.get("tokenizer.ggml.bos_token_id")),
        eos_token_id=_optional_int(metadata.get("tokenizer.ggml.eos_token_id")),
        arch=arch,
        qk_norm=spec.qk_norm,
        rope_scaling=gguf_rope(metadata, arch, rope_freq_factors, long_short),
        sliding_window=window,
        sliding_layers=None if sliding is None or all(sliding) or window is None else sliding,
        sliding_rope_theta=None if sliding_theta is None else _float32_value(sliding_theta),
        attn_softcap=_soft_cap(metadata.get(f"{arch}.attn_logit_softcapping")),
        final_softcap=_soft_cap(metadata.get(f"{arch}.final_logit_softcapping")),
        **_gemma_fields(spec, hidden, num_heads, num_layers),
    )


def _gemma_fields(
    spec: architectures.Architecture, hidden: int, num_heads: int, num_layers: int, query_scalar: Any = None
) -> dict[str, Any]:
    """What a Gemma architecture sets in ``DecoderConfig``: GeGLU, the sandwich norms, embeddings times
    sqrt(hidden), and the scores' scale: ``query_pre_attn_scalar ** -0.5`` from a Hugging Face config, or where a
    GGUF does not carry it, llama.cpp's rule (``hidden / heads`` for the 27B models, else the head size)."""
    if not spec.gemma:
        return {}
    if query_scalar is None and num_layers == spec.gguf_wide_query_layers:
        query_scalar = hidden / num_heads
    return {
        "hidden_act": "gelu_tanh",
        "sandwich_norms": True,
        "embed_scale": float(hidden) ** 0.5,
        "attention_scale": None if query_scalar is None else float(query_scalar) ** -0.5,
    }


def gguf_to_hf_name(gguf_name: str, config: DecoderConfig | None = None) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (in ``config``'s architecture: Gemma
    names its norms otherwise); ``ValueError`` if unknown."""
    match = _GGUF_BLOCK_RE.fullmatch(gguf_name)
    if match is not None:
        index, leaf, kind = match.groups()
        gemma = config is not None and architectures.ARCHITECTURES[config.arch].gemma
        leaves = {**_GGUF_BLOCK_LEAVES, **_GEMMA_GGUF_LEAVES} if gemma else _GGUF_BLOCK_LEAVES
        if leaf in leaves:
            return f"model.layers.{index}.{leaves[leaf]}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    if base in _GGUF_TOP_LEVEL and kind in ("weight", "bias"):
        return f"{_GGUF_TOP_LEVEL[base]}.{kind}"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r}")


def unpermute_gguf_rows(array: np.ndarray, hf_name: str, config: DecoderConfig) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (weights and biases) where its architecture has one; other tensors
    pass through unchanged.

    llama.cpp's converter reorders each head's rows from rotate-half pairs ``(i, i + d/2)`` to interleaved
    pairs ``(2i, 2i + 1)``: ``w.reshape(n_head, 2, d/2, -1).swapaxes(1, 2)``. The inverse views the rows as
    ``[n_head, d/2, 2]`` and swaps back. q uses the attention heads, k the key/value heads.
    """
    if not architectures.ARCHITECTURES[config.arch].gguf_permutes_qk:
        return array
    if hf_name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        num_heads = config.num_attention_heads
    elif hf_name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
        num_heads = config.num_key_value_heads
    else:
        return array
    rows = array.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"{hf_name}: {rows} rows do not split into {num_heads} heads of rotary pairs")
    half = rows // num_heads // 2
    return array.reshape(num_heads, half, 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)


def partial_rotary_rows(array: np.ndarray, hf_name: str, config: DecoderConfig) -> np.ndarray:
    """The rows of a q or k projection (weight, bias) or head norm with each head's dims in ``rope.py``'s partial
    rotary order, where only ``rotary_dim`` of them rotate; anything else, and every tensor of a model whose heads
    rotate whole, unchanged."""
    rotary_dim = config.rotary_dim
    if rotary_dim is None or rotary_dim == config.head_dim:
        return array
    leaves = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "q_norm.weight", "k_norm.weight")
    if not hf_name.endswith(tuple(f"self_attn.{leaf}" for leaf in leaves)):
        return array
    head_dim = config.head_dim
    order = np.asarray(partial_rotary_order(head_dim, rotary_dim))
    rows = (np.arange(array.shape[0] // head_dim)[:, None] * head_dim + order[None, :]).reshape(-1)
    return array[rows]


def _dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
    """One GGUF tensor as a float32 array in PyTorch's [out, in] order (the reversed GGUF shape)."""
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    kernels = native() if int(tensor.tensor_type) in QUANT_TYPES and len(shape) == 2 else None
    if kernels is not None:  # the same floats, tens of times faster than gguf's numpy
        blocks = np.asarray(tensor.data).view(np.uint8).reshape(shape[0], -1)
        with contextlib.suppress(ValueError):  # a shape the kernels refuse: gguf's numpy below says why
            return kernels.dequantize(blocks, int(tensor.tensor_type), shape[1]).numpy()
    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ValueError(f"GGUF tensor {tensor.name!r}: {exc}") from exc
    if not array.flags.writeable or array.dtype != np.float32:
        # F32 tensors come back as a read-only view of the memory map: copy so torch owns the memory.
        array = np.array(array, dtype=np.float32, copy=True)
    return array.reshape(shape)


def _gguf_scalar_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Every scalar and string metadata field (arrays such as the token list are skipped)."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] != gguf.GGUFValueType.ARRAY:
            out[key] = field.contents()
    return out


def _gguf_token_count(reader: gguf.GGUFReader) -> int | None:
    field = reader.fields.get("tokenizer.ggml.tokens")
    return None if field is None else array_length(field)


def _float32_value(value: Any) -> float:
    """A GGUF float32 as the shortest decimal that rounds to it (9.999999747e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _soft_cap(value: Any) -> float | None:
    """A logit soft cap as a config or GGUF gives it (a float32 value, written as its shortest decimal); None where it
    is absent, null or 0 (none)."""
    return _float32_value(value) if value else None


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


# ---------------------------------------------------------------------------------------- safetensors


def load_safetensors_folder(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[DecoderConfig, dict[str, torch.Tensor]]:
    """Read a Hugging Face model folder (``config.json`` + one or more ``*.safetensors``).

    The architectures of ``model/arch.py`` are accepted (by ``architectures``, else ``model_type``), and the
    language model of a multimodal checkpoint of one (Gemma 3's 4B and up: ``_TEXT_MODELS``). Tensor names are kept
    as saved (a multimodal checkpoint's language model's as the text model's); a ``lm_head.weight`` is dropped when
    the config ties embeddings. Raises
    ``ValueError`` for another architecture, a missing config or no weight files.
    """
    folder = Path(path)
    hf_config = read_hf_config(folder)
    config = hf_decoder_config(hf_config)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} holds no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for saved, tensor in _iter_safetensors(files):
        name = text_model_name(saved)
        if name is None or (config.tie_word_embeddings and name == "lm_head.weight"):
            continue
        if _is_gemma_norm(name, config):  # stored as w - 1 (Gemma's RMSNorm multiplies by 1 + w)
            tensor = tensor.float() + 1
        for part, start, stop in fused_parts(name, tensor.shape[0] if tensor.dim() else 0, config):
            piece = tensor[start:stop]
            if tensor.dim() and config.rotary_dim not in (None, config.head_dim):
                piece = piece[torch.from_numpy(partial_rotary_rows(np.arange(stop - start), part, config))]
            state[part] = piece.to(weight_dtype(part, config, dtype)).contiguous()
    return config, state


def read_hf_config(folder: Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a Hugging Face folder (of a multimodal checkpoint: its language model's,
    ``text_model_config``); ``ValueError`` when absent or not an object."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{folder} is not a Hugging Face model folder: it has no config.json")
    data = json.loads(config_path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{config_path} does not hold a JSON object")
    return text_model_config(data)


# Multimodal checkpoints whose language model is one of model/arch.py's: the text-only model's class. Their weights
# name the language model under one of _TEXT_PREFIXES (transformers 4's layout and 5's); the vision tower and
# projector are left out (splitserve serves text).
_TEXT_MODELS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
_TEXT_PREFIXES = ("language_model.model.", "model.language_model.")


def text_model_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's language model config: its ``text_config`` with transformers' defaults for what it
    leaves out (the checkpoints list only what differs), named as the text-only model; any other config as it is."""
    multimodal = next((a for a in hf.get("architectures") or [] if a in _TEXT_MODELS), None)
    if multimodal is None:
        return hf
    import transformers

    text = dict(hf.get("text_config") or {})
    model_type = text.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"{multimodal}: config.json has no text_config.model_type")
    full = transformers.AutoConfig.for_model(model_type, **text).to_dict()
    tied = hf.get("tie_word_embeddings", full.get("tie_word_embeddings", True))
    eos = hf.get("eos_token_id", full.get("eos_token_id"))
    return {**full, "architectures": [_TEXT_MODELS[multimodal]], "tie_word_embeddings": tied, "eos_token_id": eos}


def text_model_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor name as the text-only model's, None for the vision parts; others as they
    are."""
    for prefix in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return "model." + name[len(prefix) :]
    if name in ("language_model.lm_head.weight", "lm_head.weight"):
        return "lm_head.weight"
    return None if name.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                                    "model.multi_modal_projector.")) else name  # fmt: skip


def hf_decoder_config(hf: dict[str, Any]) -> DecoderConfig:
    """Map a Hugging Face ``config.json`` dict to ``DecoderConfig``; ``ValueError`` for an architecture or an
    option this model does not run (naming it)."""
    spec = architectures.for_hf(list(hf.get("architectures") or []), hf.get("model_type"))
    activation = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"  # Gemma's key, then Llama's
    if activation not in _HF_ACTIVATIONS:
        raise ValueError(f"{spec.name}: hidden_act={activation!r} is not supported ({', '.join(_HF_ACTIVATIONS)})")
    if hf.get("mlp_bias", False):
        raise ValueError(f"{spec.name}: mlp_bias={hf['mlp_bias']!r} is not supported (only False)")
    num_heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // num_heads)
    params = hf.get("rope_parameters")
    params = params if isinstance(params, dict) else {}
    partial = float(hf.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0)  # transformers 4, 5
    num_layers = int(hf["num_hidden_layers"])
    eos = hf.get("eos_token_id")
    theta, rope_scaling, sliding_theta = _hf_ropes(hf, spec)
    attention_bias = bool(hf.get("attention_bias", False))
    window, sliding = _hf_sliding_layers(hf, spec, num_layers)
    gemma = _gemma_fields(spec, int(hf["hidden_size"]), num_heads, num_layers, hf.get("query_pre_attn_scalar"))
    return DecoderConfig(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rotary_dim=None if partial == 1.0 else int(head_dim * partial),
        rope_theta=theta,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=_optional_int(hf.get("bos_token_id")),
        eos_token_id=_optional_int(eos[0] if isinstance(eos, list) else eos),
        arch=spec.name,
        qkv_bias=attention_bias if spec.qkv_bias is None else spec.qkv_bias,
        o_bias=attention_bias if spec.qkv_bias is None else False,
        qk_norm=spec.qk_norm,
        rope_scaling=rope_scaling,
        sliding_window=window,
        sliding_layers=sliding,
        sliding_rope_theta=sliding_theta,
        attn_softcap=_soft_cap(hf.get("attn_logit_softcapping")),
        final_softcap=_soft_cap(hf.get("final_logit_softcapping")),
        **{**gemma, "hidden_act": _HF_ACTIVATIONS[activation]},
    )


_HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def _hf_ropes(hf: dict[str, Any], spec: architectures.Architecture) -> tuple[float, RopeScaling | None, float | None]:
    """``(rope_theta, scaling, the sliding layers' own theta or None)``: transformers 5 gives Gemma 3 one
    ``rope_parameters`` entry per layer kind; older configs the global layers' ``rope_theta``/``rope_scaling`` and
    the local layers' ``rope_local_base_freq``. The sliding layers' rotation is never scaled."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        theta, scaling = hf_rope({**hf, "rope_parameters": params["full_attention"], "rope_scaling": None})
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"{spec.name}: scaled rotary on sliding layers ({local['rope_type']}) is not supported")
        local_theta = local.get("rope_theta", spec.sliding_rope_theta)
        return theta, scaling, None if local_theta is None else float(local_theta)
    theta, scaling = hf_rope(hf)
    local_theta = hf.get("rope_local_base_freq", spec.sliding_rope_theta)
    return theta, scaling, None if local_theta is None else float(local_theta)


def _hf_sliding_layers(
    hf: dict[str, Any], spec: architectures.Architecture, num_layers: int
) -> tuple[int | None, tuple[bool, ...] | None]:
    """``(sliding_window, which layers slide)`` of a Hugging Face config, as transformers decides: the config's
    ``layer_types`` where it lists them; else Gemma's pattern (every ``sliding_window_pattern``-th layer global),
    Qwen's ``max_window_layers`` (the layers from it on slide, once ``use_sliding_window``), or every layer
    (Mistral, Phi-3). ``(None, None)`` without a window; the flags are None when every layer slides."""
    window = _optional_int(hf.get("sliding_window"))
    if window is None or (spec.sliding_window_switch is not None and not hf.get(spec.sliding_window_switch, False)):
        return None, None
    kinds = hf.get("layer_types")
    if kinds:
        sliding = tuple(kind == "sliding_attention" for kind in kinds)
    elif spec.sliding_pattern is not None:
        pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or spec.sliding_pattern)
        sliding = tuple((i + 1) % pattern != 0 for i in range(num_layers))
    elif spec.sliding_window_switch is not None:
        first = int(hf.get("max_window_layers", num_layers))
        sliding = tuple(i >= first for i in range(num_layers))
    else:
        return window, None
    if not any(sliding):
        return None, None
    return window, None if all(sliding) else sliding


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each file's tensors; a file cut short or corrupt is a ``ValueError`` naming it."""
    from safetensors import SafetensorError, safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    yield name, handle.get_tensor(name)
        except SafetensorError as exc:
            size = file.stat().st_size
            raise ValueError(
                f"{file} ({size:,} bytes) is truncated or corrupt (an incomplete download?): {exc}"
            ) from exc

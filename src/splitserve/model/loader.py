"""Weight loaders: a GGUF file or a Hugging Face safetensors folder -> (``LlamaConfig``, HF-named state dict).

Both loaders return tensors named as in Hugging Face's ``LlamaForCausalLM`` (``model.embed_tokens.weight``,
``model.layers.N.self_attn.q_proj.weight``...), ready for ``LlamaForCausalLM.load_hf_state_dict``. GGUF
tensors are dequantized one at a time and cast straight to the requested dtype, so peak memory is about one
copy of the model in that dtype plus one float32 tensor.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import dequantize

from splitserve.model.config import LlamaConfig
from splitserve.model.gguf_file import open_gguf

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)
SUPPORTED_HF_ARCHITECTURES = ("LlamaForCausalLM",)
SUPPORTED_HF_MODEL_TYPES = ("llama",)

# GGUF leaf name -> Hugging Face name, for tensors inside a block (blk.N.<leaf>.weight).
_GGUF_BLOCK_LEAVES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


# ---------------------------------------------------------------------------------------------- GGUF


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Read a llama.cpp GGUF file into a config and a dequantized, HF-named state dict.

    Every tensor type that ``gguf.quants.dequantize`` supports is accepted (F32, F16, BF16, Q4_0, Q4_1,
    Q8_0, the K-quants, ...). The q and k projections are un-permuted from llama.cpp's interleaved-RoPE row
    order back to Hugging Face's rotate-half order. Tensors come back contiguous, on CPU, in ``dtype``.

    Raises ``ValueError`` for an architecture other than ``llama``, for missing metadata, or for a tensor
    name this loader does not know; ``FileNotFoundError`` when ``path`` does not exist.
    """
    reader = open_gguf(path)
    metadata = _gguf_scalar_metadata(reader)
    config = gguf_llama_config(metadata, num_tokens=_gguf_token_count(reader))
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    config = _replace_tied(config, tied)
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = gguf_to_hf_name(tensor.name)
        array = _dequantize(tensor)
        array = unpermute_gguf_rows(array, name, config)
        state[name] = torch.from_numpy(array).to(dtype).contiguous()
    return config, state


def gguf_llama_config(metadata: dict[str, Any], num_tokens: int | None = None) -> LlamaConfig:
    """Build a ``LlamaConfig`` from GGUF scalar metadata (keys such as ``llama.block_count``).

    ``num_tokens`` is the length of ``tokenizer.ggml.tokens``, used when ``llama.vocab_size`` is absent.
    Assumes tied embeddings; ``load_gguf`` corrects that from the tensor list.
    """
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in metadata:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return metadata[f"{arch}.{key}"]

    hidden = int(need("embedding_length"))
    num_heads = int(need("attention.head_count"))
    vocab = metadata.get(f"{arch}.vocab_size", num_tokens)
    if vocab is None:
        raise ValueError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    head_dim = metadata.get(f"{arch}.attention.key_length", metadata.get(f"{arch}.rope.dimension_count"))
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(metadata.get(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(head_dim) if head_dim is not None else hidden // num_heads,
        rope_theta=_float32_value(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=_float32_value(metadata.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(metadata.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings=True,
        bos_token_id=_optional_int(metadata.get("tokenizer.ggml.bos_token_id")),
        eos_token_id=_optional_int(metadata.get("tokenizer.ggml.eos_token_id")),
    )


def gguf_to_hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; ``ValueError`` if unknown."""
    match = _GGUF_BLOCK_RE.fullmatch(gguf_name)
    if match is not None:
        index, leaf, kind = match.groups()
        if leaf in _GGUF_BLOCK_LEAVES:
            return f"model.layers.{index}.{_GGUF_BLOCK_LEAVES[leaf]}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    if base in _GGUF_TOP_LEVEL and kind in ("weight", "bias"):
        return f"{_GGUF_TOP_LEVEL[base]}.{kind}"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r} for a llama model")


def unpermute_gguf_rows(array: np.ndarray, hf_name: str, config: LlamaConfig) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation; other tensors pass through unchanged.

    llama.cpp's converter reorders each head's rows from rotate-half pairs ``(i, i + d/2)`` to interleaved
    pairs ``(2i, 2i + 1)``: ``w.reshape(n_head, 2, d/2, -1).swapaxes(1, 2)``. The inverse views the rows as
    ``[n_head, d/2, 2]`` and swaps back. q uses the attention heads, k the key/value heads.
    """
    if hf_name.endswith("self_attn.q_proj.weight"):
        num_heads = config.num_attention_heads
    elif hf_name.endswith("self_attn.k_proj.weight"):
        num_heads = config.num_key_value_heads
    else:
        return array
    rows = array.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"{hf_name}: {rows} rows do not split into {num_heads} heads of rotary pairs")
    half = rows // num_heads // 2
    return array.reshape(num_heads, half, 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)


def _dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
    """One GGUF tensor as a float32 array in PyTorch's [out, in] order (the reversed GGUF shape)."""
    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ValueError(f"GGUF tensor {tensor.name!r}: {exc}") from exc
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
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
    return None if field is None else len(field.data)


def _replace_tied(config: LlamaConfig, tied: bool) -> LlamaConfig:
    return config if config.tie_word_embeddings == tied else replace(config, tie_word_embeddings=tied)


def _float32_value(value: Any) -> float:
    """A GGUF float32 as the shortest decimal that rounds to it (9.999999747e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


# ---------------------------------------------------------------------------------------- safetensors


def load_safetensors_folder(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Read a Hugging Face model folder (``config.json`` + one or more ``*.safetensors``).

    Only Llama-family folders are accepted (``architectures`` containing ``LlamaForCausalLM`` or
    ``model_type: llama``). Tensor names are kept as saved; a ``lm_head.weight`` is dropped when the config
    ties embeddings. Raises ``ValueError`` for another architecture, a missing config or no weight files.
    """
    folder = Path(path)
    hf_config = read_hf_config(folder)
    config = hf_llama_config(hf_config)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} holds no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for name, tensor in _iter_safetensors(files):
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        state[name] = tensor.to(dtype).contiguous()
    return config, state


def read_hf_config(folder: Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a Hugging Face folder; ``ValueError`` when absent or not an object."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{folder} is not a Hugging Face model folder: it has no config.json")
    data = json.loads(config_path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{config_path} does not hold a JSON object")
    return data


def hf_llama_config(hf: dict[str, Any]) -> LlamaConfig:
    """Map a Hugging Face ``config.json`` dict to ``LlamaConfig``; ``ValueError`` for non-Llama models."""
    architectures = hf.get("architectures") or []
    if architectures:
        is_llama = bool(set(architectures) & set(SUPPORTED_HF_ARCHITECTURES))
    else:
        is_llama = hf.get("model_type") in SUPPORTED_HF_MODEL_TYPES
    if not is_llama:
        raise ValueError(
            f"unsupported architecture {architectures or hf.get('model_type')!r}; "
            f"supported: {', '.join(SUPPORTED_HF_ARCHITECTURES)}"
        )
    if hf.get("rope_scaling"):
        raise ValueError(f"rope_scaling {hf['rope_scaling']!r} is not supported")
    num_heads = int(hf["num_attention_heads"])
    eos = hf.get("eos_token_id")
    return LlamaConfig(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_hidden_layers=int(hf["num_hidden_layers"]),
        num_attention_heads=num_heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // num_heads),
        rope_theta=float(_rope_theta(hf)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=_optional_int(hf.get("bos_token_id")),
        eos_token_id=_optional_int(eos[0] if isinstance(eos, list) else eos),
    )


def _rope_theta(hf: dict[str, Any]) -> float:
    """``rope_theta`` at the top level (transformers 4) or inside ``rope_parameters`` (transformers 5)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        if params.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters {params!r} are not supported")
        return float(params["rope_theta"])
    return float(hf.get("rope_theta", 10000.0))


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, handle.get_tensor(name)

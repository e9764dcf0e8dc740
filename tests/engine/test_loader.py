"""GGUF and safetensors loading on tiny random models written the way llama.cpp and transformers write them."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf.quants import dequantize, quantize

from splitserve.engine.engine import _max_model_len
from splitserve.model import registry
from splitserve.model.config import DecoderConfig
from splitserve.model.decoder import DecoderForCausalLM
from splitserve.model.kernels import native
from splitserve.model.loader import (
    fused_parts,
    gguf_to_hf_name,
    hf_decoder_config,
    load_gguf,
    load_safetensors_folder,
    partial_rotary_rows,
)
from splitserve.model.reference import transformers_config
from splitserve.model.registry import resolve_dtype
from splitserve.model.rope import partial_rotary_order, rotary_tables
from tests.support.paged import PagedRunner

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
ROPE_THETA = 50000.0


TINY = DecoderConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    rope_theta=ROPE_THETA,
    rms_norm_eps=1e-5,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_hf(tie: bool) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers_config(dataclasses.replace(TINY, tie_word_embeddings=tie))
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # norms start at ones: make them matter
    return model


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp ``convert_hf_to_gguf.py`` ``LlamaModel.permute``: rotate-half rows -> interleaved rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf_name in top:
        return top[hf_name]
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, index, rest = hf_name.split(".", 3)
    leaf = rest.removesuffix(".weight")
    return f"blk.{index}.{HF_TO_GGUF[leaf]}.weight"


def write_gguf(path: Path, model: transformers.LlamaForCausalLM, qtype: gguf.GGMLQuantizationType) -> None:
    """Write ``model`` like llama.cpp: permuted q/k, 2-D weights in ``qtype``, norms in F32."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = tensor.numpy()
        if name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, HEADS)
        elif name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, KV_HEADS)
        if w.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            data = quantize(w, qtype)
            writer.add_tensor(gguf_name(name), data, raw_shape=data.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def roundtrip(w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> torch.Tensor:
    if w.ndim != 2 or qtype == gguf.GGMLQuantizationType.F32:
        return torch.from_numpy(w)
    return torch.from_numpy(dequantize(quantize(w, qtype), qtype).reshape(w.shape))


def our_logits(config: DecoderConfig, state: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    from splitserve.model.attention import AttentionMetadata, PrefillChunk

    model = DecoderForCausalLM(config).float().eval()
    model.load_hf_state_dict(state)
    n = len(ids)
    kv = [(torch.zeros(n, KV_HEADS, HEAD_DIM), torch.zeros(n, KV_HEADS, HEAD_DIM)) for _ in model.layers]
    slots = torch.arange(n)
    meta = AttentionMetadata(slots, 0, None, [PrefillChunk(n, slots, n)])
    return model.compute_logits(model(ids, torch.arange(n), kv, meta))


@pytest.mark.parametrize(
    "qtype",
    [
        gguf.GGMLQuantizationType.F32,
        gguf.GGMLQuantizationType.F16,
        gguf.GGMLQuantizationType.Q8_0,
        gguf.GGMLQuantizationType.Q4_0,
        gguf.GGMLQuantizationType.Q4_1,
        gguf.GGMLQuantizationType.Q5_0,
        gguf.GGMLQuantizationType.Q5_1,
    ],
    ids=lambda q: q.name,
)
@pytest.mark.parametrize("native_kernels", ["1", "0"], ids=["native-dequantize", "gguf-dequantize"])
def test_gguf_tensors_come_back_unpermuted_and_dequantized(
    tmp_path: Path, qtype: gguf.GGMLQuantizationType, native_kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    hf = tiny_hf(tie=True)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf, qtype)
    monkeypatch.setenv("SPLITSERVE_NATIVE_KERNELS", native_kernels)
    native.cache_clear()
    try:
        config, state = load_gguf(path)
    finally:
        native.cache_clear()
    expected = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(state[name], roundtrip(tensor.numpy(), qtype), rtol=0, atol=0, msg=name)
    assert config == TINY


def test_a_model_built_around_its_weights_equals_one_loaded_into(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_hf(tie=False), gguf.GGMLQuantizationType.Q8_0)
    config, state = load_gguf(path)
    built = DecoderForCausalLM.from_hf_state_dict(config, state, torch.device("cpu"))
    loaded = DecoderForCausalLM(config).float()
    loaded.load_hf_state_dict(state)
    assert built.state_dict().keys() == loaded.state_dict().keys()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(built.state_dict()[name], tensor), name
    for name, buffer in loaded.named_buffers():
        assert torch.equal(dict(built.named_buffers())[name], buffer), name
    assert all(t.device.type == "cpu" for t in [*built.parameters(), *built.buffers()])
    with pytest.raises(ValueError, match=r"weights lack tensor 'model\.norm\.weight'"):
        DecoderForCausalLM.from_hf_state_dict(config, {k: v for k, v in state.items() if k != "model.norm.weight"},
                                              torch.device("cpu"))  # fmt: skip


def test_loading_for_serving_leaves_torch_dynamo_unimported(tmp_path: Path) -> None:
    """Made on the meta device, the model runs none of torch's reference ops, whose first use imports
    ``torch._dynamo``: a second of every worker's start."""
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_hf(tie=False), gguf.GGMLQuantizationType.Q8_0)
    script = (
        "import sys, torch\n"
        "from splitserve.model.registry import load_for_serving\n"
        "from splitserve.model.source import resolve_model\n"
        f"load_for_serving(resolve_model({str(path)!r}), torch.float32, torch.device('cpu'), 'auto')\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False"]


def test_f32_gguf_gives_transformers_logits(tmp_path: Path) -> None:
    hf = tiny_hf(tie=False)
    path = tmp_path / "untied.gguf"
    write_gguf(path, hf, gguf.GGMLQuantizationType.F32)
    config, state = load_gguf(path)
    assert not config.tie_word_embeddings and "lm_head.weight" in state
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    torch.testing.assert_close(our_logits(config, state, ids), expected, rtol=0, atol=1e-5)


def test_gguf_dtype_is_applied_while_loading(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_hf(tie=True), gguf.GGMLQuantizationType.Q8_0)
    _, state = load_gguf(path, dtype=torch.bfloat16)
    assert {t.dtype for t in state.values()} == {torch.bfloat16}


def test_unsupported_gguf_architecture_is_named(tmp_path: Path) -> None:
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'mamba'"):
        load_gguf(path)


def test_unknown_gguf_tensor_name_is_an_error() -> None:
    assert gguf_to_hf_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    with pytest.raises(ValueError, match=r"blk\.0\.ssm_conv1d\.weight"):
        gguf_to_hf_name("blk.0.ssm_conv1d.weight")


@pytest.mark.parametrize("tie", [True, False])
def test_safetensors_folder_round_trip(tmp_path: Path, tie: bool) -> None:
    hf = tiny_hf(tie=tie)
    hf.save_pretrained(str(tmp_path), safe_serialization=True, max_shard_size="40KB")  # several shards
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    config, state = load_safetensors_folder(tmp_path)
    assert config.tie_word_embeddings == tie
    assert (config.rope_theta, config.rms_norm_eps, config.eos_token_id) == (50000.0, 1e-5, 2)
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    torch.testing.assert_close(our_logits(config, state, ids), expected, rtol=0, atol=1e-5)


def test_a_truncated_safetensors_file_is_named(tmp_path: Path) -> None:
    tiny_hf(tie=True).save_pretrained(str(tmp_path), safe_serialization=True)
    (weights,) = tmp_path.glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[:5000])  # an interrupted download
    with pytest.raises(ValueError, match=r"model\.safetensors \(5,000 bytes\) is truncated or corrupt"):
        load_safetensors_folder(tmp_path)


def test_non_llama_folder_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"unsupported architecture \['GPT2LMHeadModel'\]"):
        load_safetensors_folder(tmp_path)


@pytest.mark.parametrize(
    ("name", "expected"),
    [("float32", torch.float32), ("FP32", torch.float32), ("bfloat16", torch.bfloat16), ("half", torch.float16)],
)
def test_explicit_dtypes(name: str, expected: torch.dtype) -> None:
    assert resolve_dtype(name, torch.device("cpu")) == expected


def test_auto_dtype_on_cpu_follows_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(registry, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto", cpu) == torch.bfloat16
    monkeypatch.setattr(registry, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", cpu) == torch.float32


def test_unknown_dtype_lists_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown dtype 'int8'; choose one of auto, float32"):
        resolve_dtype("int8", torch.device("cpu"))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"mlp_bias": True}, "mlp_bias=True is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}, "unsupported rope scaling 'mrope'"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope rope scaling needs short_factor"),
    ],
)
def test_an_option_the_model_does_not_compute_is_named(extra: dict[str, object], message: str) -> None:
    hf = {"architectures": ["LlamaForCausalLM"], **tiny_hf(tie=True).config.to_dict(), **extra}
    with pytest.raises(ValueError, match=re.escape(message)):
        hf_decoder_config(hf)


def test_a_partial_rotary_factor_rotates_that_share_of_each_head_in_the_full_width_layout() -> None:
    hf = {"architectures": ["Phi3ForCausalLM"], **tiny_hf(tie=True).config.to_dict(), "partial_rotary_factor": 0.5}
    cfg = hf_decoder_config(hf)
    assert cfg.rotary_dim == cfg.head_dim // 2
    assert partial_rotary_order(8, 4) == [0, 1, 4, 5, 2, 3, 6, 7]  # pairs (0, 2) and (1, 3) land at (0, 4), (1, 5)
    cos, sin = rotary_tables(8, 10000.0, None, 16, rotary_dim=4)
    full_cos, full_sin = rotary_tables(4, 10000.0, None, 16)
    assert torch.equal(cos[:, [0, 1, 4, 5]], full_cos) and torch.equal(sin[:, [0, 1, 4, 5]], full_sin)
    assert bool((cos[:, [2, 3, 6, 7]] == 1).all()) and bool((sin[:, [2, 3, 6, 7]] == 0).all())  # passed through
    q_rows = np.arange(2 * 8 * 3).reshape(16, 3)  # two heads of a q projection
    cfg8 = dataclasses.replace(cfg, head_dim=8, rotary_dim=4, num_attention_heads=2, num_key_value_heads=1)
    reordered = partial_rotary_rows(q_rows, "model.layers.0.self_attn.q_proj.weight", cfg8)
    assert reordered[:, 0].tolist() == [0, 3, 12, 15, 6, 9, 18, 21, 24, 27, 36, 39, 30, 33, 42, 45]
    assert partial_rotary_rows(q_rows, "model.layers.0.self_attn.v_proj.weight", cfg8) is q_rows


def test_a_fused_matrix_whose_rows_do_not_match_the_config_is_named() -> None:
    phi3 = {**tiny_hf(tie=True).config.to_dict(), "architectures": ["Phi3ForCausalLM"]}
    config = hf_decoder_config(phi3)
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    name = "model.layers.3.self_attn.qkv_proj.weight"
    assert fused_parts(name, q + 2 * kv, config) == [
        ("model.layers.3.self_attn.q_proj.weight", 0, q),
        ("model.layers.3.self_attn.k_proj.weight", q, q + kv),
        ("model.layers.3.self_attn.v_proj.weight", q + kv, q + 2 * kv),
    ]
    with pytest.raises(ValueError, match=re.escape(f"{name}: {q + kv} rows, not {q} + {kv} + {kv}")):
        fused_parts(name, q + kv, config)
    assert fused_parts("model.layers.0.mlp.down_proj.weight", 7, config) == [
        ("model.layers.0.mlp.down_proj.weight", 0, 7)
    ]


def test_qwen_slides_from_max_window_layers_once_switched_on() -> None:
    qwen = {**tiny_hf(tie=True).config.to_dict(), "architectures": ["Qwen2ForCausalLM"], "sliding_window": 64}
    layers = qwen["num_hidden_layers"]
    assert hf_decoder_config(qwen).sliding_window is None  # use_sliding_window defaults to off
    assert hf_decoder_config(qwen).qkv_bias
    cfg = hf_decoder_config({**qwen, "use_sliding_window": True, "max_window_layers": 1})
    assert [cfg.window_of(i) for i in range(layers)] == [None] + [64] * (layers - 1)
    assert hf_decoder_config({**qwen, "use_sliding_window": True, "max_window_layers": layers}).sliding_window is None
    listed = ["full_attention", "sliding_attention"] * (layers // 2)
    cfg = hf_decoder_config({**qwen, "use_sliding_window": True, "layer_types": listed})
    assert cfg.sliding_layers == tuple(kind == "sliding_attention" for kind in listed)  # the config's list wins


def test_mistrals_sliding_window_applies_to_every_layer_and_bounds_no_context() -> None:
    mistral = {**tiny_hf(tie=True).config.to_dict(), "architectures": ["MistralForCausalLM"], "sliding_window": 64}
    cfg = hf_decoder_config(mistral)
    assert (cfg.arch, cfg.sliding_window, cfg.sliding_layers) == ("llama", 64, None)
    assert cfg.window_of(0) == 64
    assert _max_model_len(None, cfg) == cfg.max_position_embeddings
    assert _max_model_len(128, cfg) == 128


def test_gemma3_configs_old_and_new_give_the_same_layers_and_rotations() -> None:
    base = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 7, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
            "query_pre_attn_scalar": 16, "sliding_window": 8, "hidden_activation": "gelu_pytorch_tanh"}  # fmt: skip
    old = {**base, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window_pattern": 6,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}}  # fmt: skip
    new = {**base, "layer_types": ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"],
           "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}  # fmt: skip
    for hf in (old, new):
        cfg = hf_decoder_config(hf)
        assert cfg.sliding_layers == (True,) * 5 + (False, True)
        assert (cfg.rope_theta, cfg.sliding_rope_theta, cfg.rope_scaling and cfg.rope_scaling.kind) == (
            1e6,
            1e4,
            "linear",
        )
        assert (cfg.hidden_act, cfg.sandwich_norms, cfg.embed_scale, cfg.attention_scale) == (
            "gelu_tanh",
            True,
            8.0,
            0.25,
        )
        assert [cfg.slides_with_own_rope(i) for i in range(7)] == [True] * 5 + [False, True]
    capped = hf_decoder_config({**old, "final_logit_softcapping": 30.0, "attn_logit_softcapping": None})
    assert (capped.final_softcap, capped.attn_softcap) == (30.0, None)
    gemma2 = hf_decoder_config({**base, "architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0})
    assert (gemma2.arch, gemma2.attn_softcap, gemma2.sliding_rope_theta) == ("gemma2", 50.0, None)
    assert gemma2.sliding_layers == (True, False, True, False, True, False, True)  # every other layer


def test_the_supported_architectures_are_listed() -> None:
    with pytest.raises(ValueError, match=r"supported: llama \(LlamaForCausalLM, MistralForCausalLM\), qwen2"):
        hf_decoder_config({"architectures": ["GemmaForCausalLM"]})


def test_a_multimodal_gemma3_folder_serves_its_language_model(tmp_path: Path) -> None:
    """Gemma 3's 4B and larger checkpoints are Gemma3ForConditionalGeneration: a sparse text_config (transformers'
    defaults fill the rest) and the language model's weights under a prefix, beside a vision tower left out."""
    text = {"model_type": "gemma3_text", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 7, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
            "sliding_window": 8, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}  # fmt: skip
    torch.manual_seed(0)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    hf = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.1)
    hf.save_pretrained(tmp_path)
    cfg, state = load_safetensors_folder(tmp_path)
    # Gemma's norms are 1 + w: kept in float32 whatever the dtype, or bfloat16 would round most of a small w away
    halved = load_safetensors_folder(tmp_path, torch.bfloat16)[1]
    norm = "model.layers.0.self_attn.q_norm.weight"
    assert halved[norm].dtype == torch.float32 and torch.equal(halved[norm], state[norm])
    assert (cfg.arch, cfg.num_hidden_layers, cfg.sliding_layers) == ("gemma3", 7, (True,) * 5 + (False, True))
    assert cfg.rope_scaling is not None and cfg.rope_scaling.kind == "linear"  # the global layers' own
    assert not any("vision" in name or "projector" in name for name in state)
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(1))
    model = DecoderForCausalLM(cfg).float().eval()
    model.load_hf_state_dict(state)
    model.prepare_for_inference()
    with torch.no_grad():
        expected = hf(input_ids=ids).logits[0]
    got = PagedRunner(model, 40).prefill(ids[0].tolist())
    assert (got - expected).abs().max().item() < 1e-4 * expected.abs().max().item()

"""Random-weight checkpoints of each architecture, made by ``transformers`` and converted by llama.cpp's own
``convert_hf_to_gguf.py``: what a user downloads, without downloading anything.

Each checkpoint is small (2 layers, hidden size 256) and carries SmolLM2's tokenizer (from the packaged GGUF).
Weights are drawn at a scale that gives logits of a few units, so greedy choices are decided; norms and biases are
random too, so a loader that drops or misplaces one changes the logits.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from splitserve.model.tokenizer import load_tokenizer

DEFAULT_LLAMA_CPP = Path.home() / ".cache/splitserve/peers/llama.cpp/src/unpacked"
SHAPE = dict(
    vocab_size=49152,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


@dataclass(frozen=True)
class Case:
    """One checkpoint to build: a transformers config class and what differs from ``SHAPE``."""

    name: str
    config_class: str  # e.g. "Qwen2Config"
    model_class: str  # e.g. "Qwen2ForCausalLM"
    extra: dict[str, Any] = field(default_factory=dict)


CASES = (
    Case("llama", "LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    Case(
        "llama3-rope",
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 512,
            },
        },
    ),
    Case(
        "llama-bias-linear",
        "LlamaConfig",
        "LlamaForCausalLM",
        {"attention_bias": True, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    ),
    Case("mistral", "MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    Case("qwen2", "Qwen2Config", "Qwen2ForCausalLM"),
    Case(
        "qwen2-yarn",
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}},
    ),
    Case("qwen3", "Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 96}),
    # Phi-4-mini's way: three quarters of each head rotates (48 of 64 dims: 24 pairs of longrope factors)
    Case(
        "phi3-partial-longrope",
        "Phi3Config",
        "Phi3ForCausalLM",
        {
            "original_max_position_embeddings": 1024,
            "pad_token_id": 0,
            "sliding_window": None,
            "partial_rotary_factor": 0.75,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0 + 0.05 * i for i in range(24)],
                "long_factor": [1.0 + 0.9 * i for i in range(24)],
            },
        },
    ),
    # six layers: five through a window of 24 positions (rotary base 10,000), the sixth over the whole context
    # (1,000,000), as transformers' and llama.cpp's default pattern has it
    # one layer through a window of 24 positions, one over the whole context; soft caps low enough to bend these
    # random weights' scores and logits (Gemma 2's own are 50 and 30)
    Case(
        "gemma2",
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "head_dim": 64,
            "query_pre_attn_scalar": 64,
            "sliding_window": 24,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
            "tie_word_embeddings": True,
            "pad_token_id": 0,
        },
    ),
    Case(
        "gemma3",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "num_hidden_layers": 6,
            "head_dim": 64,
            "query_pre_attn_scalar": 64,
            "sliding_window": 24,
            "tie_word_embeddings": True,
            "pad_token_id": 0,
        },
    ),
)


def make_checkpoint(
    case: Case, folder: Path, seed: int = 0, dtype: torch.dtype = torch.float32
) -> transformers.PreTrainedModel:
    """Build ``case`` with random weights, save it to ``folder`` (safetensors, config, tokenizer) in ``dtype``;
    returns it, in float32 (bfloat16 for a bfloat16 one: a 3B model's float32 copy is 12 GB)."""
    config = getattr(transformers, case.config_class)(**{**SHAPE, **case.extra})
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in dtype: no float32 copy of a large model on the way
    try:
        model = getattr(transformers, case.model_class)(config)
    finally:
        torch.set_default_dtype(default)
    gen = torch.Generator().manual_seed(seed)
    norm_offset = 0 if case.config_class.startswith("Gemma") else 1  # Gemma's norms multiply by 1 + weight
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name:
                param.copy_(norm_offset + 0.1 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(0.05 * noise)
    model.save_pretrained(folder)
    load_tokenizer("smollm2").hf.save_pretrained(folder)
    if case.config_class == "Phi3Config":  # llama.cpp's converter reads a Phi model's BPE vocabulary by this name
        path = folder / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "tokenizer_class": "GPT2Tokenizer"}))
    return (model if dtype == torch.bfloat16 else model.float()).eval()


def llama_cpp_source() -> Path:
    """llama.cpp's source tree (``scripts/fetch_llama_cpp.sh``, which ``make test`` runs): ``$LLAMA_CPP_SOURCE`` or
    the script's default place. ``FileNotFoundError`` when neither holds ``convert_hf_to_gguf.py``."""
    env = os.environ.get("LLAMA_CPP_SOURCE")
    candidates = [Path(env)] if env else sorted(DEFAULT_LLAMA_CPP.glob("*/llama.cpp"))
    for root in candidates:
        if (root / "convert_hf_to_gguf.py").is_file():
            return root
    raise FileNotFoundError("llama.cpp's source is not fetched: run scripts/fetch_llama_cpp.sh (make test does)")


def convert_to_gguf(folder: Path, out: Path, outtype: str = "f32") -> Path:
    """``convert_hf_to_gguf.py folder --outtype outtype`` in a child process; returns ``out``."""
    return convert_to_ggufs(folder, {outtype: out})[outtype]


def convert_to_ggufs(folder: Path, outs: dict[str, Path]) -> dict[str, Path]:
    """``folder`` converted to each outtype of ``outs`` (its file), a child process each, side by side.

    The converter names a BPE tokenizer by hashing how it splits a test text. SmolLM2's tokenizer as rebuilt from
    its GGUF by transformers splits a few whitespace runs differently from the original, so its hash is not in
    the converter's table; the child tells the converter it is SmolLM's (``smollm``), which it is. Gemma 2's
    converter reads only a SentencePiece vocabulary; the child has it read the BPE one, as Gemma 3's does when a
    checkpoint has no ``tokenizer.model``. The files get a neutral name: llama.cpp keys vocabulary quirks on
    ``general.name`` (a "phi3" in it looks up Phi-3's own special tokens, which SmolLM2's vocabulary lacks).
    """
    root = llama_cpp_source()
    code = (
        "import runpy, sys\n"
        f"sys.path[:0] = [{str(root)!r}, {str(root / 'gguf-py')!r}]\n"
        "import conversion.base as base\n"
        "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'smollm'\n"
        "import conversion.gemma as gemma\n"
        "gemma.Gemma2Model.set_vocab = lambda self: self._set_vocab_gpt2()\n"
        f"sys.argv = [{str(root / 'convert_hf_to_gguf.py')!r}, *sys.argv[1:]]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    failures = []
    with contextlib.ExitStack() as files:  # each child's log in a file: no pipe for a child to block on
        logs = {outtype: files.enter_context(tempfile.TemporaryFile("w+")) for outtype in outs}
        children = {
            outtype: subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    code,
                    str(folder),
                    "--outfile",
                    str(out),
                    "--outtype",
                    outtype,
                    "--model-name",
                    "random",
                ],
                stdout=subprocess.DEVNULL,
                stderr=logs[outtype],
            )
            for outtype, out in outs.items()
        }
        for outtype, child in children.items():
            try:
                child.wait(timeout=300)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            if child.returncode != 0 or not outs[outtype].is_file():
                logs[outtype].seek(0)
                failures.append(f"{outtype} ({child.returncode}):\n{logs[outtype].read()[-4000:]}")
    if failures:
        raise RuntimeError("convert_hf_to_gguf.py failed: " + "\n".join(failures))
    return outs

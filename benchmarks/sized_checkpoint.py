"""Random-weight checkpoints of real models' shapes, and their GGUFs, for measuring speed at real sizes.

The only real weights here are SmolLM2-135M's; speed depends on the shapes, not the values. This builds a
transformers checkpoint of a named shape with random weights and SmolLM2's tokenizer (so its vocabulary is 49,152
rather than the real model's), converts it with llama.cpp's ``convert_hf_to_gguf.py`` to f16 and quantizes that
with ``llama-quantize`` to each requested type:

    .venv/bin/python benchmarks/sized_checkpoint.py --shape llama-3.2-1b \\
        --llama-quantize ~/.cache/splitserve/peers/llama.cpp/src/build/bin/llama-quantize --types Q4_K_M Q8_0

It prints the folder and each GGUF's path (under ``--out``, by default ``~/.cache/splitserve/sized``); files
already there are kept. Serve them with ``benchmarks/serving_vs_peers.py --gguf PATH``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch
from common import REPO

sys.path.insert(0, str(REPO))
from tests.support.checkpoints import Case, convert_to_gguf, make_checkpoint

SHAPES = {
    # 16 layers, hidden 2048, 32 heads over 8 KV heads of 64, MLP 8192, tied embeddings
    "llama-3.2-1b": Case(
        "llama-3.2-1b",
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "tie_word_embeddings": True,
            "max_position_embeddings": 8192,
            "rope_theta": 500000.0,
        },
    ),
    # 36 layers, hidden 2048, 16 heads over 2 KV heads of 128, MLP 11008, q/k/v biases, tied embeddings
    "qwen2.5-3b": Case(
        "qwen2.5-3b",
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {
            "hidden_size": 2048,
            "intermediate_size": 11008,
            "num_hidden_layers": 36,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "tie_word_embeddings": True,
            "max_position_embeddings": 8192,
            "rope_theta": 1000000.0,
        },
    ),
    # 26 layers, hidden 1152, 4 heads over 1 KV head of 256, MLP 6912 (GeGLU), five of every six layers through a
    # window of 512 (Gemma 3 1B; its 262,144-token vocabulary is SmolLM2's 49,152 here)
    "gemma-3-1b": Case(
        "gemma-3-1b",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "hidden_size": 1152,
            "intermediate_size": 6912,
            "num_hidden_layers": 26,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "query_pre_attn_scalar": 256,
            "sliding_window": 512,
            "tie_word_embeddings": True,
            "max_position_embeddings": 32768,
            "pad_token_id": 0,
        },
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--llama-quantize", required=True, help="llama.cpp's llama-quantize binary")
    parser.add_argument("--types", nargs="+", default=["Q4_K_M", "Q8_0"])
    parser.add_argument("--out", type=Path, default=Path("~/.cache/splitserve/sized"))
    args = parser.parse_args()
    root = args.out.expanduser() / args.shape
    folder = root / "hf"
    if not (folder / "config.json").is_file():
        make_checkpoint(SHAPES[args.shape], folder, dtype=torch.bfloat16)  # as such checkpoints are published
    print(folder)
    f16 = root / f"{args.shape}-f16.gguf"
    if not f16.is_file():
        convert_to_gguf(folder, f16, "f16")
    for qtype in args.types:
        out = root / f"{args.shape}-{qtype}.gguf"
        if not out.is_file():
            subprocess.run([args.llama_quantize, str(f16), str(out), qtype, "2"], check=True, capture_output=True)
        print(out)


if __name__ == "__main__":
    main()

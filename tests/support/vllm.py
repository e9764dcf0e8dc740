"""vLLM for the end-to-end tests of vLLM workers: whether it is here, and SmolLM2 as the folder it loads."""

from __future__ import annotations

import os
from pathlib import Path

from splitserve.deploy import vllm


def vllm_missing() -> str | None:
    """Why vLLM cannot run here (the tests that need it skip), or None."""
    try:
        vllm.local_command(os.environ)
    except RuntimeError:
        return "vLLM is not installed (scripts/setup_vllm_cpu.sh, or SPLITSERVE_VLLM_PYTHON)"
    return None


def hf_folder(folder: Path) -> Path:
    """The built-in SmolLM2's weights, dequantized, as the Hugging Face folder vLLM loads (README: vLLM workers)."""
    import torch

    from splitserve.model.loader import load_gguf
    from splitserve.model.reference import transformers_model
    from splitserve.model.source import resolve_model
    from splitserve.model.tokenizer import Tokenizer

    source = resolve_model("smollm2")
    config, state_dict = load_gguf(source.path)
    transformers_model(config, state_dict, torch.bfloat16, attn_implementation="sdpa").save_pretrained(folder)
    Tokenizer.from_source(source).hf.save_pretrained(folder)
    return folder

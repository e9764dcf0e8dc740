"""SmolLM2-135M-Instruct as a worker loads it by default (``--dtype auto``, ``--quantization auto``: the GGUF's
quantized blocks in the native forward step), for the engine tests that need the real model."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from splitserve.model.decoder import DecoderForCausalLM
from splitserve.model.registry import load_for_serving, resolve_dtype
from splitserve.model.source import resolve_model
from splitserve.model.tokenizer import Tokenizer, load_tokenizer


def smollm2_defaults() -> tuple[DecoderForCausalLM, Tokenizer]:
    source = resolve_model("smollm2")
    model, quantized = load_for_serving(source, resolve_dtype("auto", torch.device("cpu")), torch.device("cpu"), "auto")
    assert quantized  # the worker's default: the GGUF's blocks, their float copy never made
    return model, load_tokenizer(source)


@contextmanager
def torch_threads(num: int) -> Iterator[None]:
    """PyTorch (and the native kernels, which follow it) on ``num`` threads inside the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(num)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class RealChats:
    model: DecoderForCausalLM
    tokenizer: Tokenizer
    prompts: dict[str, list[int]]  # each question as a one-turn chat, through the model's template
    answers: dict[str, list[int]]  # what the test module computes as its reference (e.g. each alone, cold)


@contextmanager
def smollm2_chats(
    questions: dict[str, str], reference: Callable[[RealChats, list[int]], list[int]]
) -> Iterator[RealChats]:
    """The real model with a worker's defaults on two threads, ``questions`` as chat prompts, and each prompt's
    ``reference(chats, prompt)`` answer."""
    with torch_threads(2):
        model, tokenizer = smollm2_defaults()
        prompts = {k: tokenizer.apply_chat_template([{"role": "user", "content": q}]) for k, q in questions.items()}
        chats = RealChats(model, tokenizer, prompts, {})
        chats.answers = {k: reference(chats, p) for k, p in prompts.items()}
        yield chats

"""bfloat16 vs float32 on this CPU: decode-step throughput of the real model, batch 1 and 16.

Justifies ``resolve_dtype("auto", cpu)``. Each step is shaped like the engine's decode step: B sequences
with ``--context`` cached tokens each compute one new token through the paged-attention path (weights,
attention over the KV cache, logits). Prints tokens/s per dtype and batch, and the bf16/fp32 ratio.

    .venv/bin/python benchmarks/dtype_matmul.py [--threads N] [--context 256] [--steps 20]
"""

from __future__ import annotations

import argparse
import time

import torch

from splitserve.model.attention import AttentionMetadata, DecodeBatch
from splitserve.model.decoder import DecoderForCausalLM
from splitserve.model.registry import cpu_has_native_bf16, load_model, resolve_dtype
from splitserve.model.source import resolve_model

BATCH_SIZES = (1, 16)
DTYPES = (torch.float32, torch.bfloat16)


def decode_step_inputs(
    model: DecoderForCausalLM, batch: int, context: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], AttentionMetadata]:
    """Random KV for ``batch`` sequences of ``context`` tokens each, and the metadata of one decode step."""
    cfg = model.config
    num_slots = batch * (context + 1)
    shape = (num_slots, cfg.num_key_value_heads, cfg.head_dim)
    kv = [(torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)) for _ in range(cfg.num_hidden_layers)]
    context_slots = torch.arange(num_slots).view(batch, context + 1)  # [B, context + 1], the last is new
    decode = DecodeBatch(context_slots, torch.full((batch,), context + 1), block_size=1)  # table = slot list
    meta = AttentionMetadata(context_slots[:, -1].contiguous(), batch, decode, [])
    input_ids = torch.randint(0, cfg.vocab_size, (batch,))
    positions = torch.full((batch,), context)
    return input_ids, positions, kv, meta


def tokens_per_s(model: DecoderForCausalLM, batch: int, context: int, steps: int, dtype: torch.dtype) -> float:
    input_ids, positions, kv, meta = decode_step_inputs(model, batch, context, dtype)
    for _ in range(3):  # warm-up: oneDNN picks kernels on first use
        model.compute_logits(model(input_ids, positions, kv, meta))
    start = time.perf_counter()
    for _ in range(steps):
        model.compute_logits(model(input_ids, positions, kv, meta))
    return batch * steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--context", type=int, default=256, help="cached tokens per sequence")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per measurement")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    print(f"threads={args.threads} context={args.context} native_bf16={cpu_has_native_bf16()} "
          f"auto={resolve_dtype('auto', device)}")  # fmt: skip
    source = resolve_model(args.model)
    results: dict[tuple[torch.dtype, int], float] = {}
    for dtype in DTYPES:
        model = load_model(source, dtype, device)
        for batch in BATCH_SIZES:
            results[dtype, batch] = tokens_per_s(model, batch, args.context, args.steps, dtype)
            print(f"{dtype!s:16s} batch {batch:2d}: {results[dtype, batch]:8.1f} tokens/s", flush=True)
        del model
    for batch in BATCH_SIZES:
        ratio = results[torch.bfloat16, batch] / results[torch.float32, batch]
        print(f"batch {batch:2d}: bfloat16 / float32 = {ratio:.2f}x")


if __name__ == "__main__":
    main()

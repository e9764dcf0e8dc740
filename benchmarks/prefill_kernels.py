"""The exact prefill's kernels per instruction-set build: attention and the matmuls of one layer of a cold
2,500-token prompt, and decode attention, on SmolLM2's shapes (no engine, no server).

    .venv/bin/python benchmarks/prefill_kernels.py [--threads 2] [--builds avx512,amx]

For each kernel build this CPU runs (or those named):
- **attention per layer** of a 2,500-token prompt in the engine's chunks of 1,024: three calls of
  ``NativeKernels.paged_attention`` (1,024 queries over 1-1,024 keys, 1,024 over 1,025-2,048, 452 over
  2,049-2,500), bfloat16 K/V in shuffled blocks of 16, 9 query heads over 3 KV heads of 64;
- **the matmuls at 1,024 rows**: layer 0's fused q/k/v, output, fused gate/up and down, from the GGUF's blocks;
- **decode attention**: 1 and 16 rows, each its own sequence, at 300 and 2,500 tokens.

Medians over at least 5 calls and 0.3 s after one warm-up (``quant_kernels.median_s``). Results go to
``benchmarks/results/prefill_kernels.json``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, write_result
from quant_kernels import median_s, model_matrices, pack, shapes

from splitserve.model.kernels import NativeKernels, detect_cpu, kernels_for

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
PROMPT, CHUNK = 2500, 1024


def median_ms(fn: Callable[[], Any]) -> float:
    return median_s(fn) * 1e3


def cache(tokens: int, seqs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V for `seqs` sequences of `tokens` tokens in shuffled blocks, and their block tables."""
    gen = torch.Generator().manual_seed(tokens)
    per_seq = -(-tokens // BLOCK)
    k = torch.randn(seqs * per_seq * BLOCK, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    v = torch.randn(seqs * per_seq * BLOCK, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    tables = torch.randperm(seqs * per_seq, generator=gen).reshape(seqs, per_seq).contiguous()
    return k, v, tables


def attention_per_layer(kernels: NativeKernels) -> float:
    k, v, table = cache(PROMPT, 1)
    total = 0.0
    for start in range(0, PROMPT, CHUNK):
        rows = min(CHUNK, PROMPT - start)
        q = torch.randn(rows, HEADS, HEAD_DIM).bfloat16()
        lens = torch.arange(start + 1, start + rows + 1)
        row_seq = torch.zeros(rows, dtype=torch.long)
        total += median_ms(
            lambda q=q, lens=lens, row_seq=row_seq: kernels.paged_attention(
                q, k, v, table, lens, BLOCK, HEAD_DIM**-0.5, row_seq
            )
        )
    return total


def decode_attention(kernels: NativeKernels, rows: int, tokens: int) -> float:
    k, v, tables = cache(tokens, rows)
    q = torch.randn(rows, HEADS, HEAD_DIM).bfloat16()
    lens = torch.full((rows,), tokens)
    return median_ms(lambda: kernels.paged_attention(q, k, v, tables, lens, BLOCK, HEAD_DIM**-0.5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--builds", default="", help="comma-separated kernel builds (default: every one here)")
    parser.add_argument("--model", default="smollm2", help="a GGUF (default: the packaged SmolLM2 Q4_1)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "prefill_kernels.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu = detect_cpu()
    wanted = set(filter(None, args.builds.split(",")))
    matrices = {name: w for name, w in shapes(model_matrices(args.model)).items() if not name.startswith("head")}
    results: dict[str, Any] = {"cpu": cpu.model_name, "isa_class": cpu.isa_class, "builds": {}}
    for level in cpu.levels:
        if level.name == "scalar" or (wanted and level.name not in wanted):
            continue
        kernels = kernels_for(level)
        if kernels is None:
            continue
        row: dict[str, float] = {"attention per layer ms": attention_per_layer(kernels)}
        for name, w in matrices.items():
            packed = pack(kernels, w)
            x = torch.randn(CHUNK, packed.k)
            took = median_ms(lambda x=x, p=packed, k=kernels: k.quant_matmul(x, p))
            row[f"{name} at {CHUNK} rows ms"] = took
            row[f"{name} GMAC/s"] = CHUNK * packed.n * packed.k / took / 1e6
        for rows, tokens in ((1, 300), (1, 2500), (16, 300), (16, 2500)):
            row[f"decode {rows} rows at {tokens} us"] = decode_attention(kernels, rows, tokens) * 1e3
        results["builds"][level.name] = row
        print(level.name, {key: round(value, 2) for key, value in row.items()}, flush=True)
    write_result(args.out, "prefill_kernels", args, results)


if __name__ == "__main__":
    main()

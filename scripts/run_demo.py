"""``make run``: start a worker with the default model, ask it one question, then stream its logs.

Starts ``splitserve worker`` as a child process (its logs go straight to this terminal), waits for
``/health``, asks "What is the capital of France?" through the chat API with the ``openai`` client, prints the
answer, the URL and a curl example, and stays in the foreground until Ctrl-C (or SIGTERM), which stops the
worker cleanly.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from types import FrameType

import httpx
import openai

QUESTION = "What is the capital of France?"
HEALTH_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 15.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="model to serve (default: smollm2)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    parser.add_argument("--max-model-len", type=int, default=2048, help="context length (default: 2048)")
    return parser.parse_args()


def start_worker(args: argparse.Namespace) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-c", "from splitserve.cli import main; main()", "worker",
               "--model", args.model, "--host", args.host, "--port", str(args.port),
               "--max-model-len", str(args.max_model_len)]  # fmt: skip
    return subprocess.Popen(command)


def wait_healthy(worker: subprocess.Popen[bytes], base_url: str) -> None:
    """Poll ``/health`` until 200; exit if the worker dies or takes too long."""
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if worker.poll() is not None:
            sys.exit(f"the worker exited with status {worker.returncode} before it was ready")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not bound yet
        time.sleep(0.5)
    stop_worker(worker)
    sys.exit(f"the worker was not healthy after {HEALTH_TIMEOUT_S:.0f} s")


def ask(base_url: str, model: str) -> str:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=64, temperature=0
    )
    return reply.choices[0].message.content or ""


def print_banner(base_url: str, model: str, answer: str) -> None:
    body = f'{{"model": "{model}", "messages": [{{"role": "user", "content": "{QUESTION}"}}], "max_tokens": 64}}'
    print(
        f"\n  Q: {QUESTION}\n  A: {answer.strip()}\n\n"
        f"  The worker is serving {model} at {base_url} (OpenAI API under {base_url}/v1).\n"
        f"  Try:\n    curl {base_url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"      -d '{body}'\n"
        f"  Metrics: {base_url}/metrics    Press Ctrl-C to stop.\n",
        flush=True,
    )


def stop_worker(worker: subprocess.Popen[bytes]) -> int:
    """SIGTERM (uvicorn shuts down gracefully), then SIGKILL if it does not exit in time."""
    if worker.poll() is None:
        worker.send_signal(signal.SIGTERM)
    try:
        return worker.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        worker.kill()
        return worker.wait()


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main() -> int:
    args = parse_args()
    base_url = f"http://{args.host}:{args.port}"
    signal.signal(signal.SIGTERM, _raise_interrupt)
    worker = start_worker(args)
    try:
        wait_healthy(worker, base_url)
        print_banner(base_url, args.model, ask(base_url, args.model))
        return worker.wait()  # the worker's logs keep streaming to this terminal
    except KeyboardInterrupt:
        print("\nstopping the worker...", flush=True)
        return 0 if stop_worker(worker) in (0, -signal.SIGTERM, -signal.SIGINT) else 1
    finally:
        if worker.poll() is None:
            stop_worker(worker)


if __name__ == "__main__":
    sys.exit(main())

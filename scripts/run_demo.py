"""``make run``: bring up ``examples/dpd.yaml`` (a prefill worker, a decode worker and the router), send the
two verification requests through the router, show how it routed them, and keep serving.

Runs ``splitserve up -f examples/dpd.yaml`` as a child process (its log goes to this terminal), waits until the
endpoint reports ``DPD prefill and decode deployments are ready``, then asks:
- a short chat message ("What is the capital of France? Answer in one sentence."), which goes straight to the
  decode worker;
- ``The quick brown fox jumps over the lazy dog. `` repeated 600 times (about 6,000 tokens, over the 4,096-token
  routing threshold) with ``max_tokens`` 30, which is prefilled on the prefill worker and decoded from the KV it
  pushed to the decode worker.

It prints both answers and the router's and decode worker's log lines about them, then stays in the foreground
until Ctrl-C (or SIGTERM), which stops every process of the endpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

import httpx

ROOT = Path(__file__).resolve().parent.parent
ENDPOINT = ROOT / "examples" / "dpd.yaml"
QUESTION = "What is the capital of France? Answer in one sentence."
FOX = "The quick brown fox jumps over the lazy dog. "
READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8000, help="the router's port (default: 8000)")
    parser.add_argument("-f", "--filename", type=Path, default=ENDPOINT, help="endpoint file (default: dpd.yaml)")
    return parser.parse_args()


def run_dir(name: str) -> Path:
    return Path(os.environ.get("SPLITSERVE_HOME", Path.home() / ".splitserve")) / "endpoints" / name


def wait_ready(up: subprocess.Popen[bytes], state_path: Path) -> dict[str, object]:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if up.poll() is not None:
            sys.exit(f"splitserve up exited with status {up.returncode} before the endpoint was ready")
        try:
            state: dict[str, object] = json.loads(state_path.read_text())
            condition = state["condition"]
            if isinstance(condition, dict) and condition.get("status") and state.get("supervisor_pid") == up.pid:
                return state
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    sys.exit(f"the endpoint was not ready after {READY_TIMEOUT_S:.0f} s")


def ask(base_url: str, content: str, max_tokens: int) -> str:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0}  # fmt: skip
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=600, trust_env=False)
    response.raise_for_status()
    return str(response.json()["choices"][0]["message"]["content"])


def log_lines(logs: Path, prefix: str, *needles: str) -> list[str]:
    lines: list[str] = []
    for log in sorted(logs.glob(f"{prefix}-*.log")):
        lines += [line for line in log.read_text(errors="replace").splitlines() if any(n in line for n in needles)]
    return lines


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main() -> int:
    args = parse_args()
    import yaml

    name = yaml.safe_load(args.filename.read_text())["metadata"]["name"]
    base_url = f"http://127.0.0.1:{args.port}"
    signal.signal(signal.SIGTERM, _raise_interrupt)
    command = [sys.executable, "-c", "from splitserve.cli import main; main()", "up", "-f", str(args.filename),
               "--port", str(args.port)]  # fmt: skip
    up = subprocess.Popen(command)
    try:
        wait_ready(up, run_dir(name) / "state.json")
        short = ask(base_url, QUESTION, 32)
        print(f"\n  Q: {QUESTION}\n  A: {short.strip()}", flush=True)
        print("\n  Now the long one: the fox sentence 600 times (about 6,000 tokens), max_tokens 30 ...", flush=True)
        long = ask(base_url, FOX * 600, 30)
        print(f"  A: {long.strip()[:200]}\n", flush=True)
        logs = run_dir(name) / "logs"
        for line in log_lines(logs, "router", "Conditional routing") + log_lines(logs, "decode", "Retrieved"):
            print(f"  {line}", flush=True)
        print(
            f"\n  The endpoint serves smollm2 at {base_url}/v1 (router), prefill and decode behind it.\n"
            f"  Try: curl {base_url}/v1/chat/completions -H 'Content-Type: application/json' -d "
            f'\'{{"model": "smollm2", "messages": [{{"role": "user", "content": "Hi"}}]}}\'\n'
            f"  Pods: .venv/bin/splitserve get {name}     Press Ctrl-C to stop.\n",
            flush=True,
        )
        return up.wait()
    except KeyboardInterrupt:
        print("\nstopping the endpoint...", flush=True)
        return 0
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                up.kill()


if __name__ == "__main__":
    sys.exit(main())

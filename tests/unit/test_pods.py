"""Local pods as real (model-free) processes: liveness kills a hung pod, pods die with their supervisor, and a
stale supervisor PID file never names another process. Local runs keep to the user: private run directories,
logs and disk L2, no secret in a logged command, no Kubernetes Secret reference taken for a value."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from splitserve.deploy import local
from splitserve.deploy import pods as pods_module
from splitserve.deploy.local import _supervisor_pid, _write_pid_file, load_for_local_run, private_dir
from splitserve.deploy.pods import PodSet, PodSpec, redacted
from splitserve.endpoint import EndpointError, load_endpoint
from tests.support.paths import EXAMPLES
from tests.support.waiting import wait_until
from tests.support.workers import free_port

# answers GET /health with 200 until the file "hang" exists, then accepts connections and never answers
HEALTH_SERVER = textwrap.dedent("""
    import http.server, os, sys, time
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            while os.path.exists(sys.argv[2]):
                time.sleep(1)
            self.send_response(200); self.end_headers()
        def log_message(self, *args): pass
    http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
""")


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie has exited


def test_a_ready_pod_that_stops_answering_is_killed_and_restarted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pods_module, "LIVENESS_PERIOD_S", 0.0)
    monkeypatch.setattr(pods_module, "PROBE_TIMEOUT_S", 0.3)
    monkeypatch.setattr(pods_module, "FIRST_BACKOFF_S", 0.1)
    port, hang = free_port(), tmp_path / "hang"
    pod_set = PodSet(tmp_path / "logs")
    pod = pod_set.add(PodSpec("colocated", (sys.executable, "-c", HEALTH_SERVER, str(port), str(hang)), port), "w")
    try:
        assert pod_set.wait_ready([pod], timeout_s=20, poll_s=0.05)
        assert pod.process is not None
        first_pid = pod.process.pid
        for _ in range(3):
            pod_set.tick()
        assert pod.is_ready and pod.restarts == 0  # answering: left alone
        hang.touch()
        wait_until(lambda: [pod_set.tick()] and pod.restarts == 1, timeout_s=20, interval_s=0.05)
        hang.unlink()
        assert pod_set.wait_ready([pod], timeout_s=20, poll_s=0.05)
        assert pod.process.pid != first_pid and not alive(first_pid) and pod.restarts == 1
    finally:
        pod_set.stop_all()


def test_what_a_dead_pod_leaves_behind_is_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a vLLM server killed outright leaves its engine and worker processes running, holding their memory
    monkeypatch.setattr(pods_module, "FIRST_BACKOFF_S", 60.0)
    child_pid = tmp_path / "child.pid"
    parent = textwrap.dedent(f"""
        import subprocess, sys, time
        from pathlib import Path
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        Path({str(child_pid)!r}).write_text(str(child.pid))
        time.sleep(300)
    """)
    pod_set = PodSet(tmp_path / "logs")
    pod = pod_set.add(PodSpec("colocated", (sys.executable, "-c", parent), 1), "p")
    try:
        wait_until(lambda: child_pid.exists() and child_pid.read_text() != "", timeout_s=20, interval_s=0.05)
        orphan = int(child_pid.read_text())
        assert pod.process is not None and alive(orphan)
        os.kill(pod.process.pid, signal.SIGKILL)
        pod.process.wait()
        assert alive(orphan)
        pod_set.tick()  # sees the exit: the pod restarts after its back-off, and nothing of it is left
        wait_until(lambda: not alive(orphan), timeout_s=10, interval_s=0.05)
        assert pod.restarts == 1
    finally:
        pod_set.stop_all()


def test_pods_die_with_a_sigkilled_supervisor(tmp_path: Path) -> None:
    supervisor = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from splitserve.deploy.pods import PodSet, PodSpec
        pod_set = PodSet(Path({str(tmp_path)!r}))
        pod = pod_set.add(PodSpec("colocated", (sys.executable, "-c", "import time; time.sleep(300)"), 1), "p")
        print(pod.process.pid, flush=True)
        time.sleep(300)
    """)
    process = subprocess.Popen([sys.executable, "-c", supervisor], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    pod_pid = int(process.stdout.readline())
    assert alive(pod_pid)
    process.send_signal(signal.SIGKILL)
    process.wait()
    wait_until(lambda: not alive(pod_pid), timeout_s=10, interval_s=0.05)


def test_a_pid_file_whose_process_is_gone_or_replaced_names_no_supervisor(tmp_path: Path) -> None:
    _write_pid_file(tmp_path / "supervisor.pid")
    assert _supervisor_pid(tmp_path) == os.getpid()
    pid, start = (tmp_path / "supervisor.pid").read_text().split()
    (tmp_path / "supervisor.pid").write_text(f"{pid} {int(start) + 1}")  # the pid now belongs to another process
    assert _supervisor_pid(tmp_path) is None
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "supervisor.pid").write_text(f"{gone.pid} {start}")
    assert _supervisor_pid(tmp_path) is None
    (tmp_path / "supervisor.pid").write_text("garbage")
    assert _supervisor_pid(tmp_path) is None


# ---------------------------------------------------------------------------------------------- kept private


def test_run_directories_and_their_new_parents_are_the_users_alone(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    run_dir = private_dir(tmp_path / "home" / ".splitserve" / "endpoints" / "dpd")
    for path in (run_dir, run_dir.parent, run_dir.parent.parent, run_dir.parent.parent.parent):
        assert mode(path) == 0o700, path
    assert mode(tmp_path) == 0o755  # an existing parent is left as it is
    run_dir.chmod(0o755)  # made by an older version
    assert mode(private_dir(run_dir)) == 0o700


def test_pod_logs_are_private(tmp_path: Path) -> None:
    pod_set = PodSet(tmp_path / "logs")
    pod = pod_set.add(PodSpec("colocated", (sys.executable, "-c", "print('hi')"), 1, health_path=None), "p")
    try:
        assert pod.process is not None
        pod.process.wait(10)
    finally:
        pod_set.stop_all()
    assert mode(tmp_path / "logs") == 0o700 and mode(tmp_path / "logs" / "p.log") == 0o600
    assert (tmp_path / "logs" / "p.log").read_text() == "hi\n"


def test_logged_commands_hide_keys_and_url_passwords() -> None:
    command = ["splitserve", "worker", "--api-key", "k1", "--api-key=k2", "--l2-url", "redis://app:pw-9@r:6379/0",
               "--l2-url=rediss://:pw-8@r:6380", "--model", "http://host/path@v1"]  # fmt: skip
    shown = " ".join(redacted(command))
    assert "k1" not in shown and "k2" not in shown and "pw-9" not in shown and "pw-8" not in shown
    assert "redis://app:***@r:6379/0" in shown and "--l2-url=rediss://:***@r:6380" in shown
    assert "http://host/path@v1" in shown  # no password: left alone


def test_a_secret_key_ref_cannot_run_locally_and_says_what_to_do_instead(tmp_path: Path) -> None:
    data = yaml.safe_load((EXAMPLES / "colocated.yaml").read_text())
    ref = {"secretKeyRef": {"name": "client-keys", "key": "main"}}
    data["spec"]["worker"]["environmentVariables"] = [{"name": "SPLITSERVE_API_KEY", "valueFrom": ref}]
    path = tmp_path / "endpoint.yaml"
    path.write_text(yaml.safe_dump(data))
    load_endpoint(path)  # valid for Kubernetes
    with pytest.raises(EndpointError) as info:
        load_for_local_run(path)
    (line,) = info.value.errors
    assert line.startswith("spec.worker.environmentVariables[0].valueFrom.secretKeyRef: a local run cannot read")
    assert "environment of splitserve up or apply" in line


def test_the_default_disk_l2_is_made_private_in_the_users_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    data = yaml.safe_load((EXAMPLES / "colocated.yaml").read_text())
    data["spec"]["kvCacheSpec"] = {"enableL2Cache": True, "l2CacheSpec": {"l2CacheBackend": "tieredstorage"}}
    path = tmp_path / "endpoint.yaml"
    path.write_text(yaml.safe_dump(data))
    local._private_l2(load_for_local_run(path))
    l2 = tmp_path / "cache" / "splitserve" / "l2" / "default" / "colocated"
    assert l2.is_dir() and mode(l2) == 0o700 and mode(tmp_path / "cache" / "splitserve") == 0o700

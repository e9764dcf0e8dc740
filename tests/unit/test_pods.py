"""Local pods as real (model-free) processes: liveness kills a hung pod, pods die with their supervisor, and a
stale supervisor PID file never names another process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from splitserve.deploy import pods as pods_module
from splitserve.deploy.local import _supervisor_pid, _write_pid_file
from splitserve.deploy.pods import PodSet, PodSpec
from tests.e2e.workers import free_port
from tests.waiting import wait_until

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

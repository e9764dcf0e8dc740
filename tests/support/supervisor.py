"""``splitserve up`` as a child process for the supervisor's end-to-end tests: start it, wait until its endpoint is
ready, read the state it writes, tell whether a pod's process still runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.support.waiting import wait_until
from tests.support.workers import free_port

SPLITSERVE = [sys.executable, "-c", "from splitserve.cli import main; main()"]
READY_S = 300.0


def state(home: Path, name: str) -> dict[str, Any]:
    try:
        result: dict[str, Any] = json.loads((home / "endpoints" / name / "state.json").read_text())
    except (OSError, ValueError):
        return {"condition": {"status": False}, "pods": []}
    return result


class Up:
    """``splitserve up -f FILE`` in the foreground, as a child process."""

    def __init__(self, home: Path, path: Path) -> None:
        self.home, self.name = home, yaml.safe_load(path.read_text())["metadata"]["name"]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (home / f"up-{self.name}.log").open("wb")
        env = {**os.environ, "SPLITSERVE_HOME": str(home)}
        self.process = subprocess.Popen([*SPLITSERVE, "up", "-f", str(path), "--port", str(self.port)],
                                        stdout=self.log, stderr=subprocess.STDOUT, env=env)  # fmt: skip

    def wait_ready(self) -> dict[str, Any]:
        wait_until(lambda: self.process.poll() is None and state(self.home, self.name)["condition"]["status"],
                   timeout_s=READY_S, interval_s=0.5)  # fmt: skip
        return state(self.home, self.name)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        self.process.wait(60)
        self.log.close()


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, exited but not yet reaped by whoever adopted it, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

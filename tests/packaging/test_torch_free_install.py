"""A plain ``pip install splitserve``, no extras: the wheel built from this tree, installed into a fresh
virtualenv with its dependencies from the local wheelhouse (``make test-packaging`` fills it; the test itself
reaches no package index), has no torch, yet runs the router (it serves a request),
``splitserve bench`` and the deploy tools; ``splitserve worker`` stops with one line naming the engine extra. The
wheel carries ``py.typed``, the LICENSE and the version ``splitserve.__version__`` states.

Slow: building the wheel and installing its dependencies.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

import splitserve

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
INSTALL_TIMEOUT_S = 600
WHEELHOUSE_ENV = "SPLITSERVE_WHEELHOUSE"  # set by make test-packaging


def _wheelhouse() -> Path:
    found = os.environ.get(WHEELHOUSE_ENV)
    if not found or not (Path(found) / ".built").exists():
        pytest.fail(f"no local wheelhouse: run make test-packaging (it fills .wheelhouse and sets {WHEELHOUSE_ENV})")
    return Path(found)


def _offline(wheelhouse: Path) -> list[str]:
    return ["--no-index", "--find-links", str(wheelhouse)]


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh virtualenv holding the built wheel and its base dependencies only; yields its bin folder."""
    wheelhouse = _wheelhouse()
    work = tmp_path_factory.mktemp("torch-free")
    wheel = _build_wheel(work, wheelhouse)
    _run([sys.executable, "-m", "venv", str(work / "venv")], cwd=work)
    bin_dir = work / "venv" / "bin"
    _run([str(bin_dir / "python"), "-m", "pip", "install", "--quiet", *_offline(wheelhouse), str(wheel)], cwd=work)
    yield bin_dir
    shutil.rmtree(work, ignore_errors=True)  # some 350 MB


def _build_wheel(work: Path, wheelhouse: Path) -> Path:
    """Build from a copy of the tree: in place, setuptools would reuse (and leave) build/ and egg-info here."""
    tree = work / "tree"
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, tree / name)
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", *_offline(wheelhouse)]
    _run([*build, "-w", str(work / "dist"), str(tree)], cwd=work)
    (wheel,) = (work / "dist").glob("splitserve-*.whl")
    return wheel


def _run(cmd: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "COLUMNS": "200"}
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    if check:
        assert result.returncode == 0, f"{cmd}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def _python(venv: Path, code: str) -> subprocess.CompletedProcess[str]:
    return _run([str(venv / "python"), "-c", code], cwd=venv, check=False)


def test_torch_is_not_installed(venv: Path) -> None:
    result = _python(venv, "import torch")
    assert result.returncode != 0 and "No module named 'torch'" in result.stderr


def test_the_dependencies_are_consistent_and_the_router_bench_and_deploy_modules_import(venv: Path) -> None:
    _run([str(venv / "python"), "-m", "pip", "check"], cwd=venv)
    modules = ["splitserve.router.app", "splitserve.router.run", "splitserve.bench.runner", "splitserve.deploy.local"]
    result = _python(venv, f"import sys, {', '.join(modules)}; print('torch' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--help"], "router"),
        (["router", "--help"], "--routing-strategy"),
        (["bench", "--help"], "serve"),
        (["bench", "serve", "--help"], "--max-concurrency"),
        (["render", "--help"], "--operator"),
    ],
)
def test_the_torch_free_commands_run(venv: Path, args: list[str], needle: str) -> None:
    result = _run([str(venv / "splitserve"), *args], cwd=venv)
    assert needle in result.stdout


def test_render_prints_an_endpoints_manifests_and_the_crd(venv: Path) -> None:
    manifests = _run([str(venv / "splitserve"), "render", "-f", str(ROOT / "examples" / "dpd.yaml")], cwd=venv)
    assert "kind: Deployment" in manifests.stdout
    crd = _run([str(venv / "splitserve"), "render", "--crd"], cwd=venv)  # deploy/crd.yaml, package data
    assert "kind: CustomResourceDefinition" in crd.stdout


def test_the_worker_names_the_engine_extra(venv: Path) -> None:
    result = _run([str(venv / "splitserve"), "worker"], cwd=venv, check=False)
    assert result.returncode == 2
    assert "pip install 'splitserve[engine]'" in result.stderr and "Traceback" not in result.stderr


def test_the_wheel_carries_py_typed_the_license_and_the_one_version(venv: Path) -> None:
    code = (
        "import json, importlib.metadata as md, splitserve\n"
        "meta = md.metadata('splitserve')\n"
        "files = [str(f) for f in md.files('splitserve')]\n"
        "print(json.dumps({'version': md.version('splitserve'), 'module_version': splitserve.__version__,"
        " 'license': meta['License-Expression'], 'files': files}))"
    )
    result = _python(venv, code)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["version"] == found["module_version"] == splitserve.__version__
    assert found["license"] == "Apache-2.0"
    assert "splitserve/py.typed" in found["files"]
    assert any(f.endswith("licenses/LICENSE") for f in found["files"])


def test_the_router_serves_a_request(venv: Path, stub_worker: str) -> None:
    port = _free_port()
    cmd = [str(venv / "splitserve"), "router", "--port", str(port), "--backend", stub_worker]
    router = subprocess.Popen(cmd, cwd=venv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_for_health(url, router)
        body = {"model": "smollm2", "prompt": "hi", "max_tokens": 1}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=10)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == "from the stub"
    finally:
        router.terminate()
        _, stderr = router.communicate(timeout=30)
    assert "Traceback" not in stderr, stderr


def _wait_for_health(url: str, process: subprocess.Popen[str], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1]
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"the router at {url} was not healthy after {timeout_s} s")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _StubWorker(BaseHTTPRequestHandler):
    """Answers /health and every completion with one fixed text: the router is what is under test."""

    def do_GET(self) -> None:
        self._reply({"status": "ok"})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        choice = {"index": 0, "text": "from the stub", "logprobs": None, "finish_reason": "length"}
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        self._reply({"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "smollm2",
                     "choices": [choice], "usage": usage})  # fmt: skip

    def _reply(self, body: dict[str, object]) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def stub_worker() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StubWorker)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()

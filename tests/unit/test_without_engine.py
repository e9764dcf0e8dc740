"""Without the engine extra (a plain ``pip install splitserve``: no torch), what needs the engine says so in one
line naming ``splitserve[engine]``, and the router runs on asyncio's own loop where uvloop is missing (Windows).

Each case runs in a fresh interpreter whose ``sys.modules["torch"] = None`` makes ``import torch`` fail as it
does where torch is not installed (the install test in tests/packaging checks the real thing)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.cli import ENGINE_EXTRA_INSTALL
from splitserve.router.run import run_event_loop

NO_TORCH = "import sys; sys.modules['torch'] = None; "


def _without_torch(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-c", NO_TORCH + code, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("args", [["worker"], ["worker", "--port", "8123"], ["up", "-f", "examples/dpd.yaml"]])
def test_commands_that_run_workers_exit_2_naming_the_engine_extra(args: list[str]) -> None:
    result = _without_torch("from splitserve.cli import main; sys.argv[0] = 'splitserve'; main()", *args)
    assert result.returncode == 2, result.stderr
    assert ENGINE_EXTRA_INSTALL in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_gguf_tokenizer_without_torch_is_a_value_error_naming_the_engine_extra(tmp_path: Path) -> None:
    code = (
        "from pathlib import Path; from splitserve.model.tokenizer import load_tokenizer\n"
        "try:\n    load_tokenizer('smollm2', cache_dir=Path(sys.argv[1]))\n"
        "except ValueError as exc:\n    print(exc)\nelse:\n    print('converted')"
    )
    result = _without_torch(code, str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "needs torch" in result.stdout and ENGINE_EXTRA_INSTALL in result.stdout
    assert not list(tmp_path.iterdir())  # no half-converted folder left in the cache


def test_the_router_loop_is_uvloop_where_installed_else_asyncio(monkeypatch: pytest.MonkeyPatch) -> None:
    loops: list[str] = []

    async def record_loop() -> None:
        loops.append(type(asyncio.get_running_loop()).__module__.partition(".")[0])

    run_event_loop(record_loop())
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` fails, as on Windows
    run_event_loop(record_loop())
    assert loops == ["uvloop", "asyncio"]

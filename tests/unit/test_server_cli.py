"""``splitserve worker`` refuses bad flags cleanly, and the CLI module stays light."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from splitserve.cli import app


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--tensor-parallel-size", "8"], "--tensor-parallel-size 8 is not supported"),
        (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2 is not supported"),
        (["--block-size", "7"], "--block-size"),
        (["--dtype", "int3"], "--dtype"),
        (["--kv-cache-memory", "lots"], "byte size"),
        (["--port", "70000"], "--port"),
        (["--uvicorn-log-level", "loud"], "--uvicorn-log-level"),
    ],
)
def test_bad_flags_exit_2_with_one_clear_line(args: list[str], needle: str) -> None:
    result = CliRunner().invoke(app, ["worker", *args])
    assert result.exit_code == 2
    assert needle in result.output
    assert "Traceback" not in result.output


def test_every_worker_flag_has_help() -> None:
    result = CliRunner().invoke(app, ["worker", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for flag in ("--model", "--host", "--port", "--served-model-name", "--dtype", "--max-model-len",
                 "--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--seed", "--kv-cache-memory",
                 "--gpu-memory-utilization", "--enable-prefix-caching", "--enable-chunked-prefill", "--role",
                 "--device", "--tensor-parallel-size", "--pipeline-parallel-size", "--uvicorn-log-level"):  # fmt: skip
        assert flag in result.output, flag


def test_importing_the_cli_does_not_import_torch_or_the_server() -> None:
    code = "import sys, splitserve.cli; print(sorted(m for m in ('torch', 'fastapi') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_startup_config_names_the_pd_role() -> None:
    from splitserve.config import EngineConfig, Role, ServerConfig
    from splitserve.server.run import startup_config

    roles = {r: startup_config(EngineConfig(), ServerConfig(role=r))["pd_role"] for r in Role}
    assert roles == {Role.COLOCATED: "colocated", Role.PREFILL: "sender", Role.DECODE: "receiver"}

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
                 "--device", "--tensor-parallel-size", "--pipeline-parallel-size", "--uvicorn-log-level",
                 "--l1-cache", "--l1-cache-bytes", "--l2-backend", "--l2-url", "--l2-path", "--kv-chunk-size",
                 "--save-decode-cache"):  # fmt: skip
        assert flag in result.output, flag


def test_importing_the_cli_does_not_import_torch_or_the_server() -> None:
    code = "import sys, splitserve.cli; print(sorted(m for m in ('torch', 'fastapi') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_startup_config_names_the_pd_role() -> None:
    from splitserve.config import EngineConfig, Role, ServerConfig
    from splitserve.worker.run import startup_config

    roles = {r: startup_config(EngineConfig(), ServerConfig(role=r))["pd_role"] for r in Role}
    assert roles == {Role.COLOCATED: "colocated", Role.PREFILL: "sender", Role.DECODE: "receiver"}


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--l2-backend", "redis"], "--l2-backend redis needs --l2-url"),
        (["--l2-backend", "redis", "--l2-url", "http://x:1"], "--l2-url must start with"),
        (["--l2-backend", "tieredstorage"], "--l2-backend tieredstorage needs --l2-path"),
        (["--l2-backend", "memcached"], "memcached"),
        (["--l1-cache", "--kv-chunk-size", "100"], "multiple of --block-size"),
        (["--l1-cache", "--l1-cache-bytes", "lots"], "byte size"),
    ],
)
def test_bad_kv_tier_flags_exit_2(args: list[str], needle: str) -> None:
    result = CliRunner().invoke(app, ["worker", *args])
    assert result.exit_code == 2, result.output
    assert needle in result.output
    assert "Traceback" not in result.output


def test_kv_tier_flags_and_environment_reach_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    import splitserve.worker.run
    from splitserve.config import EngineConfig, KVTierConfig, L2Backend

    seen: list[EngineConfig] = []
    monkeypatch.setattr(splitserve.worker.run, "run_worker", lambda config, *_: seen.append(config) or 0)
    env = {"SPLITSERVE_L2_URL": "redis://127.0.0.1:6390/2", "LMCACHE_SAVE_DECODE_CACHE": "True"}
    args = ["worker", "--l1-cache", "--l1-cache-bytes", "64MiB", "--l2-backend", "redis", "--kv-chunk-size", "64"]
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == 0, result.output
    assert seen[0].kv_tiers == KVTierConfig(
        l1_cache=True,
        l1_cache_bytes=64 << 20,
        l2_backend=L2Backend.REDIS,
        l2_url="redis://127.0.0.1:6390/2",
        kv_chunk_size=64,
        save_decode_cache=True,
    )
    result = CliRunner().invoke(app, ["worker"], env={"LMCACHE_SAVE_DECODE_CACHE": "False"})
    assert result.exit_code == 0 and seen[1].kv_tiers == KVTierConfig() and not seen[1].kv_tiers.is_enabled


def test_startup_config_hides_the_redis_password() -> None:
    from splitserve.config import EngineConfig, KVTierConfig, L2Backend, ServerConfig
    from splitserve.worker.run import startup_config

    tiers = KVTierConfig(l2_backend=L2Backend.REDIS, l2_url="redis://:hunter2@cache:6379/0")
    logged = startup_config(EngineConfig(kv_tiers=tiers), ServerConfig())
    assert logged["kv_tiers.l2_url"] == "redis://:***@cache:6379/0" and "hunter2" not in str(logged)

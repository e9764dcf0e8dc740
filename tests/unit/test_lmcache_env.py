"""LMCache's variables and config file become splitserve's settings: each mapped one with LMCache's units, each other
one named in a warning, a bad value an error naming the variable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve import lmcache_env
from splitserve.lmcache_env import GIB, translate

# production-stack's usual LMCache block for a vLLM pod
PRODUCTION_STACK = {
    "LMCACHE_USE_EXPERIMENTAL": "True",
    "LMCACHE_CHUNK_SIZE": "256",
    "LMCACHE_LOCAL_CPU": "True",
    "LMCACHE_MAX_LOCAL_CPU_SIZE": "5.0",
}


def test_a_production_stack_block_turns_l1_on_with_its_size_and_chunks() -> None:
    out = translate(PRODUCTION_STACK)
    assert out.settings == {
        "SPLITSERVE_KV_CHUNK_SIZE": "256",
        "SPLITSERVE_L1_CACHE": "true",
        "SPLITSERVE_L1_CACHE_BYTES": str(5 * GIB),
    }
    assert out.warnings == []


def test_a_size_alone_turns_l1_on_but_local_cpu_false_keeps_it_off() -> None:
    assert translate({"LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5"}).settings["SPLITSERVE_L1_CACHE"] == "true"
    off = translate({"LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5", "LMCACHE_LOCAL_CPU": "false"})
    assert off.settings["SPLITSERVE_L1_CACHE"] == "false" and off.settings["SPLITSERVE_L1_CACHE_BYTES"] == str(GIB // 2)


def test_tiers_redis_wins_over_a_local_disk_and_other_remotes_are_named() -> None:
    disk = translate({"LMCACHE_LOCAL_DISK": "file:///var/cache/kv/", "LMCACHE_MAX_LOCAL_DISK_SIZE": "20"})
    assert disk.settings == {
        "SPLITSERVE_L2_BACKEND": "tieredstorage",
        "SPLITSERVE_L2_PATH": "/var/cache/kv/",
        "SPLITSERVE_L2_MAX_BYTES": str(20 * GIB),
    }
    both = translate({"LMCACHE_LOCAL_DISK": "/d", "LMCACHE_REMOTE_URL": "redis://cache:6379"})
    assert both.settings == {"SPLITSERVE_L2_BACKEND": "redis", "SPLITSERVE_L2_URL": "redis://cache:6379"}
    assert both.warnings == ["LMCACHE_LOCAL_DISK is ignored: LMCACHE_REMOTE_URL gives the L2 tier (splitserve has one)"]
    lm = translate({"LMCACHE_REMOTE_URL": "lm://server:65432", "LMCACHE_REMOTE_SERDE": "cachegen"})
    assert lm.settings == {}
    assert lm.warnings == [
        "LMCACHE_REMOTE_URL is ignored: only redis:// and rediss:// remote tiers exist here, not lm://",
        "LMCACHE_REMOTE_SERDE is ignored: splitserve has no equivalent",
    ]


def test_splitserve_variables_win_and_the_decode_cache_flag_is_left_to_its_option() -> None:
    out = translate({**PRODUCTION_STACK, "SPLITSERVE_KV_CHUNK_SIZE": "512", "LMCACHE_SAVE_DECODE_CACHE": "True"})
    assert "SPLITSERVE_KV_CHUNK_SIZE" not in out.settings and out.warnings == []


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("LMCACHE_CHUNK_SIZE", "lots"),
        ("LMCACHE_CHUNK_SIZE", "0"),
        ("LMCACHE_LOCAL_CPU", "maybe"),
        ("LMCACHE_MAX_LOCAL_CPU_SIZE", "-1"),
        ("LMCACHE_MAX_LOCAL_CPU_SIZE", "nan"),
        ("LMCACHE_MAX_LOCAL_DISK_SIZE", "5GB"),
        ("LMCACHE_LOCAL_DISK", "file://"),
        ("LMCACHE_PD_BUFFER_SIZE", "big"),
    ],
)
def test_a_bad_value_is_an_error_naming_the_variable(name: str, value: str) -> None:
    with pytest.raises(ValueError, match=name):
        translate({name: value})


def test_the_config_file_is_read_and_variables_beat_it(tmp_path: Path) -> None:
    config = tmp_path / "lmcache.yaml"
    config.write_text("chunk_size: 128\nlocal_cpu: true\nmax_local_cpu_size: 2\nenable_blending: false\n")
    out = translate({"LMCACHE_CONFIG_FILE": str(config), "LMCACHE_CHUNK_SIZE": "64"})
    assert out.settings == {
        "SPLITSERVE_KV_CHUNK_SIZE": "64",
        "SPLITSERVE_L1_CACHE": "true",
        "SPLITSERVE_L1_CACHE_BYTES": str(2 * GIB),
    }
    assert out.warnings == ["LMCACHE_ENABLE_BLENDING is ignored: splitserve has no equivalent"]
    for text in ("[1, 2]\n", "chunk_size: [\n"):
        config.write_text(text)
        with pytest.raises(ValueError, match="LMCACHE_CONFIG_FILE"):
            translate({"LMCACHE_CONFIG_FILE": str(config)})
    with pytest.raises(ValueError, match="cannot read"):
        translate({"LMCACHE_CONFIG_FILE": str(tmp_path / "missing.yaml")})


def test_apply_sets_only_what_is_unset() -> None:
    environ = {**PRODUCTION_STACK, "SPLITSERVE_L1_CACHE": "false"}
    lmcache_env.apply(environ)
    assert environ["SPLITSERVE_L1_CACHE"] == "false" and environ["SPLITSERVE_KV_CHUNK_SIZE"] == "256"


def _worker(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``splitserve worker`` with ``env``, which each test makes fail before a model loads."""
    code = "from splitserve.cli import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code, "worker"],
        env=os.environ | env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_worker_takes_them_before_its_options_are_read() -> None:
    taken = _worker({"LMCACHE_CHUNK_SIZE": "100", "LMCACHE_NIXL_ROLE": "sender"})
    assert taken.returncode == 2
    # the chunk size reached --kv-chunk-size, whose check (a multiple of the block size) refuses 100
    assert "--kv-chunk-size" in taken.stderr and "100" in taken.stderr, taken.stderr
    assert "WARNING: LMCACHE_NIXL_ROLE is ignored: splitserve has no equivalent" in taken.stderr
    bad = _worker({"LMCACHE_MAX_LOCAL_CPU_SIZE": "lots"})
    assert bad.returncode == 2 and "Error: LMCACHE_MAX_LOCAL_CPU_SIZE='lots'" in bad.stderr
    assert "Traceback" not in taken.stderr + bad.stderr

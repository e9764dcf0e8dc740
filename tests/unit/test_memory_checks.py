"""The memory checks at start: the KV cache's size against the memory available beside the model, the model's
files against the memory available before loading, and a container's (cgroup's) limit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from splitserve.config import DEFAULT_CPU_KV_CACHE_BYTES
from splitserve.engine import engine
from splitserve.engine.engine import ACTIVATION_HEADROOM_BYTES, check_weights_fit, cpu_kv_cache_bytes
from splitserve.model.registry import load_footprint_bytes
from splitserve.model.source import resolve_model

GIB = 1 << 30


def test_an_asked_kv_cache_that_does_not_fit_is_an_error_naming_the_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "known_available_memory", lambda: 3 * GIB)
    assert cpu_kv_cache_bytes(None, 2 * GIB) == 2 * GIB
    with pytest.raises(ValueError, match=r"the model's serving copies 1\.00 GiB"):
        cpu_kv_cache_bytes(None, 2 * GIB, reserved=GIB)  # what prepare_for_inference still allocates counts
    with pytest.raises(ValueError, match=r"--kv-cache-memory 8\.00 GiB does not fit: 3\.00 GiB of memory is available"):
        cpu_kv_cache_bytes(None, 8 * GIB)
    assert cpu_kv_cache_bytes(0.5, None) == int(1.5 * GIB)  # a fraction is of what is available


def test_the_default_kv_cache_shrinks_to_what_is_available(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(engine, "known_available_memory", lambda: 16 * GIB)
    assert cpu_kv_cache_bytes(None, None) == DEFAULT_CPU_KV_CACHE_BYTES
    monkeypatch.setattr(engine, "known_available_memory", lambda: GIB)
    assert cpu_kv_cache_bytes(None, None) == GIB - ACTIVATION_HEADROOM_BYTES
    assert "not the default 2.00 GiB" in caplog.text


def test_a_model_larger_than_the_memory_available_is_refused_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "known_available_memory", lambda: 8 * GIB)
    check_weights_fit(7 * GIB, "model.gguf in bfloat16")
    with pytest.raises(
        ValueError, match=r"loading model\.gguf in bfloat16 takes at least 9\.00 GiB, more than the 8\.00"
    ):
        check_weights_fit(9 * GIB, "model.gguf in bfloat16")


@pytest.mark.parametrize(
    ("files", "room"),
    [
        ({"memory.max": "max", "memory.current": "100"}, None),  # cgroup v2, no limit
        ({"memory.max": "5000", "memory.current": "1200"}, 3800),
        ({"memory.max": "5000", "memory.current": "1200", "memory.stat": "anon 700\ninactive_file 500\n"}, 4300),
        ({"memory/memory.limit_in_bytes": "9223372036854771712", "memory/memory.usage_in_bytes": "5"}, None),  # v1
        ({"memory/memory.limit_in_bytes": "4096", "memory/memory.usage_in_bytes": "1024"}, 3072),
        (
            {
                "memory/memory.limit_in_bytes": "4096",
                "memory/memory.usage_in_bytes": "1024",
                "memory/memory.stat": "cache 600\ntotal_inactive_file 24\n",
            },
            3096,
        ),
        ({}, None),
    ],
)
def test_a_containers_memory_limit_counts(tmp_path: Path, files: dict[str, str], room: int | None) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text + "\n")
    assert engine._cgroup_room(tmp_path, tmp_path / "no-proc-self-cgroup") == room


def test_the_least_room_up_the_processs_own_cgroup_counts(tmp_path: Path) -> None:
    """Without a cgroup namespace the process sits deep in the tree (a systemd unit, a pod's container): its own
    cgroup's limit and its parents' count, the tightest wins."""
    unit = tmp_path / "system.slice" / "splitserve.service"
    unit.mkdir(parents=True)
    (tmp_path / "system.slice" / "memory.max").write_text("10000\n")
    (tmp_path / "system.slice" / "memory.current").write_text("7000\n")
    (unit / "memory.max").write_text("max\n")
    (unit / "memory.current").write_text("500\n")
    own = tmp_path / "cgroup"
    own.write_text("0::/system.slice/splitserve.service\n")
    assert engine._cgroup_room(tmp_path, own) == 3000
    (unit / "memory.max").write_text("2000\n")
    assert engine._cgroup_room(tmp_path, own) == 1500
    v1 = tmp_path / "v1"
    (v1 / "memory" / "pod").mkdir(parents=True)
    (v1 / "memory" / "pod" / "memory.limit_in_bytes").write_text("4096\n")
    (v1 / "memory" / "pod" / "memory.usage_in_bytes").write_text("96\n")
    own.write_text("12:cpu,cpuacct:/pod\n11:memory:/pod\n")
    assert engine._cgroup_room(v1, own) == 4000


def test_unknown_memory_refuses_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "known_available_memory", lambda: None)
    check_weights_fit(1 << 50, "a model of a petabyte")
    assert cpu_kv_cache_bytes(None, 64 * GIB) == 64 * GIB
    assert cpu_kv_cache_bytes(None, None) == DEFAULT_CPU_KV_CACHE_BYTES


def test_the_load_footprint_counts_the_float_weights_and_the_blocks_twice() -> None:
    source = resolve_model("smollm2")  # 134.5 M weights in a 0.1 GB Q4_1 file
    weights = load_footprint_bytes(source, torch.float32) - load_footprint_bytes(source, torch.bfloat16)
    assert 134e6 * 2 < weights < 136e6 * 2  # every weight dequantized: 2 more bytes each in float32
    native = load_footprint_bytes(source, torch.bfloat16, "auto")  # the matrices as blocks, read and packed
    assert 1.5 * source.path.stat().st_size < native < load_footprint_bytes(source, torch.bfloat16)

"""The kernels' build: every level compiles with ``-Wall -Wextra -Werror`` (x86 levels with this machine's
compiler whatever its CPU runs, ARM levels with the aarch64 cross compiler ``make setup`` installs), and a library
whose ABI is not the bindings' is refused at load."""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.quants import quantize

from splitserve.model import kernel_build, kernels
from splitserve.model.kernel_build import ARM_LEVELS, X86_LEVELS, IsaLevel, compile_command

CROSS = {"x86_64": "aarch64-linux-gnu-gcc", "aarch64": "x86_64-linux-gnu-gcc"}  # the other architecture's compiler


def _compilers() -> list[tuple[str, IsaLevel]]:
    native = shutil.which("cc") or shutil.which("gcc")
    assert native is not None, "no C compiler: make setup installs gcc"
    own, other = (X86_LEVELS, ARM_LEVELS) if platform.machine() == "x86_64" else (ARM_LEVELS, X86_LEVELS)
    found = [(native, level) for level in own]
    cross = shutil.which(CROSS.get(platform.machine(), ""))
    if cross is not None:
        found += [(cross, level) for level in other]
    return found


@dataclass
class StrictBuilds:
    prebuilt: Path  # this machine's levels as an image's libraries (``kernel_build.prebuild``), with -Werror
    errors: dict[tuple[str, str], str]  # (compiler, level name): the compiler's message; absent where it built


@pytest.fixture(scope="module")
def strict_builds(tmp_path_factory: pytest.TempPathFactory) -> StrictBuilds:
    """Every level built with ``-Werror``: this machine's as ``kernel_build.prebuild`` builds an image's (the
    prebuilt test loads them), the other architecture's with its cross compiler; one compiler per core."""
    folder = tmp_path_factory.mktemp("strict")
    errors: dict[tuple[str, str], str] = {}
    own = kernel_build.levels_of(platform.machine())
    native = [(compiler, level) for compiler, level in _compilers() if level in own]
    try:
        kernel_build.prebuild(folder / "prebuilt", extra=("-Werror",))
    except OSError as error:
        errors.update({(compiler, level.name): str(error) for compiler, level in native})

    def cross_build(compiler: str, level: IsaLevel) -> subprocess.CompletedProcess:
        cflags = [f for f in level.cflags if f != "-mtune=native"]  # a cross compiler tunes for no host CPU
        target = str(folder / f"{level.name}-{Path(compiler).name}.so")
        command = compile_command(compiler, IsaLevel(level.name, level.needs, tuple(cflags)), target)
        return subprocess.run([*command, "-Werror"], capture_output=True, text=True, timeout=600)

    cross = [pair for pair in _compilers() if pair not in native]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        results = list(pool.map(lambda pair: cross_build(*pair), cross))
    for (compiler, level), result in zip(cross, results, strict=True):
        if result.returncode != 0:
            errors[(compiler, level.name)] = result.stderr[-3000:]
    return StrictBuilds(folder / "prebuilt", errors)


@pytest.mark.parametrize(("compiler", "level"), _compilers(), ids=lambda v: v.name if isinstance(v, IsaLevel) else "")
def test_every_level_builds_without_a_warning(compiler: str, level: IsaLevel, strict_builds: StrictBuilds) -> None:
    assert (compiler, level.name) not in strict_builds.errors, strict_builds.errors[(compiler, level.name)]


def test_the_arm_levels_are_built_here_too() -> None:
    """On x86 the ARM levels need the cross compiler (make setup installs it): not a silent skip."""
    if platform.machine() == "x86_64":
        assert shutil.which(CROSS["x86_64"]), "aarch64-linux-gnu-gcc is missing: run make setup"


def test_a_library_whose_abi_differs_from_the_bindings_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    native = kernels.native()
    assert native is not None
    library = ctypes.CDLL(str(kernel_build.library_path(native.level)))
    kernels.check_abi(library)  # the real pair agrees
    monkeypatch.setattr(kernels, "ABI_VERSION", kernels.ABI_VERSION + 1)
    with pytest.raises(OSError, match="ABI"):
        kernels.NativeKernels(library, native.level)


def test_prebuilt_libraries_load_without_a_compiler_and_compute_the_same_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strict_builds: StrictBuilds
) -> None:
    """An image's libraries (built with generic tuning, here by the strict build) are found before any build, need
    no compiler, and give every level this CPU runs the same results as the library built for this machine."""
    built = sorted(strict_builds.prebuilt.glob("*.so"))
    assert [path.name for path in built] == sorted(
        kernel_build.prebuilt_name(level) for level in kernel_build.levels_of(platform.machine())
    )
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((64, 256)).astype(np.float32)
    blocks = torch.from_numpy(np.ascontiguousarray(quantize(weight, 2)))  # Q4_0
    x = torch.from_numpy(rng.standard_normal((5, 256)).astype(np.float32))
    local = {level.name: _matmul(kernel_build.library_path(level), level, blocks, x) for level in _runnable()}
    monkeypatch.setenv("SPLITSERVE_PREBUILT_KERNELS", str(strict_builds.prebuilt))
    monkeypatch.setenv("CC", "/nonexistent/cc")  # any build would fail
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    for level in _runnable():
        path = kernel_build.library_path(level)
        assert path.parent == strict_builds.prebuilt
        assert torch.equal(_matmul(path, level, blocks, x), local[level.name]), level.name


def _runnable() -> tuple[IsaLevel, ...]:
    return kernel_build.detect_cpu().levels


def _matmul(path: Path, level: IsaLevel, blocks: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    native = kernels.NativeKernels(ctypes.CDLL(str(path)), level)
    out = native.quant_matmul(x, native.pack(blocks, 2, x.shape[1]))
    assert out is not None
    return out

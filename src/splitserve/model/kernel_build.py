"""Building the native CPU kernels: the instruction-set levels, this CPU's features, and the compiler runs.

Torch-free, so that an image build can compile every level ahead of time (``python -m
splitserve.model.kernel_build DIR``) on a machine with a compiler, and ship the libraries in an image without one
(``SPLITSERVE_PREBUILT_KERNELS``). ``model.kernels`` loads what this module builds or finds.

**One source, every instruction set.** The sources are compiled once per instruction-set level, each level a
set of compiler flags the code's ``#if`` branches key on (``csrc/common.h``):

- ``scalar``: portable C, any CPU (always built by the tests);
- ``avx2``: x86 with AVX2 + FMA + F16C (Haswell, Zen 1-3: the common cloud baseline);
- ``avxvnni``: the same with AVX-VNNI's 8-bit dot products (Alder Lake and later without AVX-512);
- ``avx512``: x86 with AVX-512 F/BW/VL/DQ and VNNI (Ice Lake, Sapphire Rapids, Zen 4 and later);
- ``avx512bf16``: the same with AVX-512 BF16's pair dot products, which attention's scores take (Cooper Lake,
  Zen 4 and later);
- ``amx``: the same with AMX tiles (Sapphire Rapids and later);
- ``neon``, ``neon-dotprod``: ARMv8, and ARMv8.2 with 8-bit dot products (Graviton 2 and later).

**Where a library comes from.** First the prebuilt directory (``SPLITSERVE_PREBUILT_KERNELS``), whose libraries
are named by a digest of the sources and the flags, tuned for no particular CPU (``-mtune=generic``: the same
instructions and arithmetic, only scheduled for no particular core). Else a build for this machine in a cache
directory (``$SPLITSERVE_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/splitserve/kernels``), named by a digest of the
sources, the flags, the compiler and the CPU's features, so a changed source or another CPU builds afresh and
processes starting together never load a half-written file (each builds to a temporary name and renames).
Building takes a few seconds.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from splitserve import envs

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("csrc")
# -ffp-contract=off: a * b + c is fused only where the source says so (an fma intrinsic), the same in every
# copy of a function, so that results do not depend on how the compiler inlined it
BASE_FLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC", "-Wall", "-Wextra")


@dataclass(frozen=True, slots=True)
class IsaLevel:
    """A build of the kernels: the CPU features it needs (``/proc/cpuinfo`` names) and its compiler flags."""

    name: str
    needs: tuple[str, ...]
    cflags: tuple[str, ...]


X86_LEVELS = (
    IsaLevel("scalar", (), ("-march=x86-64", "-mtune=generic", "-DSS_SCALAR")),
    IsaLevel("avx2", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c", "-mtune=native")),
    IsaLevel(
        "avxvnni", ("avx2", "fma", "f16c", "avx_vnni"), ("-mavx2", "-mfma", "-mf16c", "-mavxvnni", "-mtune=native")
    ),
    IsaLevel(
        "avx512",
        ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"),
        ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
         "-mprefer-vector-width=512", "-mtune=native"),
    ),
    IsaLevel(
        "avx512bf16",
        ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"),
        ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
         "-mavx512bf16", "-mprefer-vector-width=512", "-mtune=native"),
    ),
    IsaLevel(
        "amx",
        ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16",
         "amx_tile", "amx_bf16", "amx_int8"),
        ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
         "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mamx-int8", "-mprefer-vector-width=512", "-mtune=native"),
    ),
)  # fmt: skip
GENERIC_LEVEL = IsaLevel("scalar", (), ("-DSS_SCALAR",))  # any other architecture: portable C only
ARM_LEVELS = (
    IsaLevel("scalar", (), ("-DSS_SCALAR",)),
    IsaLevel("neon", ("asimd",), ("-mtune=native",)),
    IsaLevel("neon-dotprod", ("asimd", "asimddp"), ("-march=armv8.2-a+dotprod", "-mtune=native")),
)


@dataclass(frozen=True, slots=True)
class CpuInfo:
    """What this CPU can run, read once at start (``detect_cpu``)."""

    arch: str  # platform.machine(): x86_64, aarch64, ...
    model_name: str
    flags: frozenset[str]

    @property
    def levels(self) -> tuple[IsaLevel, ...]:
        """The kernel builds this CPU can execute, best last."""
        table = X86_LEVELS if self.arch in ("x86_64", "AMD64") else ARM_LEVELS if self.is_arm else ()
        return tuple(level for level in table if all(f in self.flags for f in level.needs)) or (GENERIC_LEVEL,)

    @property
    def is_arm(self) -> bool:
        return self.arch in ("aarch64", "arm64")

    @property
    def features(self) -> list[str]:
        """The features that decide the kernel path and dtype, in the order the README lists them."""
        names = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                 "amx_bf16", "amx_int8", "asimd", "asimddp", "sve", "bf16", "i8mm")  # fmt: skip
        return [name for name in names if name in self.flags]

    @property
    def isa_class(self) -> str:
        """One word for the CPU class: amx, avx512-bf16, avx512, avx2, neon-dotprod, neon or scalar."""
        f = self.flags
        if "amx_bf16" in f:
            return "amx"
        if "avx512_bf16" in f:
            return "avx512-bf16"
        if "avx512f" in f:
            return "avx512"
        if "avx2" in f:
            return "avx2"
        if self.is_arm:
            return "neon-dotprod" if "asimddp" in f else "neon"
        return "scalar"


@functools.cache
def detect_cpu() -> CpuInfo:
    """This machine's CPU: architecture, model name and feature flags (from ``/proc/cpuinfo``)."""
    flags: set[str] = set()
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("flags", "Features") and not flags:
                flags = set(value.split())
            elif key == "model name" and not model:
                model = value.strip()
    except OSError:
        pass
    return CpuInfo(platform.machine(), model or platform.processor() or platform.machine(), frozenset(flags))


def select_level(cpu: CpuInfo) -> IsaLevel:
    """The best level ``cpu`` runs, or the one ``SPLITSERVE_KERNEL_ISA`` names (a ``ValueError`` if it can't)."""
    levels = cpu.levels
    wanted = envs.get(envs.KERNEL_ISA).lower()
    if not wanted or wanted == "auto":
        return levels[-1]
    for level in levels:
        if level.name == wanted:
            return level
    raise ValueError(
        f"SPLITSERVE_KERNEL_ISA={wanted!r} is not one this CPU runs; choose one of {[lv.name for lv in levels]}"
    )


def cache_dir() -> Path:
    if explicit := envs.get(envs.KERNEL_CACHE):
        return Path(explicit)
    return envs.cache_home() / "splitserve" / "kernels"


def sources() -> list[Path]:
    """Every C source, in a fixed order: the generic files in ``csrc/``, each architecture's in ``csrc/arch/``
    and AMX's in ``csrc/amx/``. Every level compiles all of them; each file holds code only for the levels it
    serves (its ``#if``), as ggml-cpu's layout does."""
    return sorted(SOURCE_DIR.rglob("*.c"))


def compile_command(compiler: str, level: IsaLevel, output: str, extra: Sequence[str] = ()) -> list[str]:
    """The command that builds ``level``'s library at ``output`` (``extra``: more flags, e.g. ``-Werror``)."""
    return [compiler, *BASE_FLAGS, *level.cflags, *extra, "-o", output, *map(str, sources()), "-lm"]


def library_path(level: IsaLevel) -> Path:
    """``level``'s library: the prebuilt one for these sources, else one built here (once per digest)."""
    found = prebuilt(level)
    if found is not None:
        return found
    compiler = _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    flags = [*BASE_FLAGS, *level.cflags]
    digest = _sources_digest(flags)
    for part in (version, " ".join(sorted(detect_cpu().flags))):
        digest.update(part.encode())
    target = cache_dir() / f"cpu_kernels-{level.name}-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        _compile(compiler, level, target)
        logger.info("built native CPU kernels: %s", target)
    return target


def levels_of(arch: str) -> tuple[IsaLevel, ...]:
    """Every level built for an architecture (``platform.machine()``)."""
    if arch in ("x86_64", "AMD64"):
        return X86_LEVELS
    return ARM_LEVELS if arch in ("aarch64", "arm64") else (GENERIC_LEVEL,)


def generic(level: IsaLevel) -> IsaLevel:
    """``level`` tuned for no particular CPU (a prebuilt library runs on every CPU of its level)."""
    return replace(level, cflags=tuple("-mtune=generic" if f == "-mtune=native" else f for f in level.cflags))


def _sources_digest(flags: Sequence[str]) -> hashlib._Hash:
    digest = hashlib.sha256()
    for path in sorted(p for p in SOURCE_DIR.rglob("*") if p.suffix in (".c", ".h")):
        digest.update(path.relative_to(SOURCE_DIR).as_posix().encode() + path.read_bytes())
    digest.update(" ".join(flags).encode())
    return digest


def prebuilt_name(level: IsaLevel) -> str:
    """The file name of ``level``'s prebuilt library: the sources and the generic flags decide it."""
    flags = [*BASE_FLAGS, *generic(level).cflags]
    return f"cpu_kernels-{level.name}-{_sources_digest(flags).hexdigest()[:16]}.so"


def prebuilt(level: IsaLevel) -> Path | None:
    """``level``'s library in ``SPLITSERVE_PREBUILT_KERNELS``, if that directory has one for these sources."""
    folder = envs.get(envs.PREBUILT_KERNELS)
    path = Path(folder) / prebuilt_name(level) if folder else None
    return path if path is not None and path.exists() else None


def prebuild(out_dir: Path, arch: str | None = None, extra: Sequence[str] = ()) -> list[Path]:
    """Build every level of ``arch`` (this machine's by default) into ``out_dir``, for an image (the levels at
    once, one compiler per core; ``extra``: more flags, e.g. ``-Werror``). ``OSError`` with the compiler's
    message when a level does not build."""
    compiler = _compiler()
    out_dir.mkdir(parents=True, exist_ok=True)
    levels = levels_of(arch or platform.machine())
    built = [out_dir / prebuilt_name(level) for level in levels]
    with ThreadPoolExecutor(max(1, min(len(levels), os.cpu_count() or 1))) as pool:
        builds = [
            pool.submit(_compile, compiler, generic(level), target, extra)
            for level, target in zip(levels, built, strict=True)
        ]
        for build in builds:
            build.result()
    return built


def _compiler() -> str:
    compiler = envs.get(envs.CC) or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    return compiler


def _compile(compiler: str, level: IsaLevel, target: Path, extra: Sequence[str] = ()) -> None:
    """Build to a temporary name beside ``target``, then rename: a reader never sees half a library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        command = compile_command(compiler, level, tmp, extra)
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise OSError(f"{compiler} failed for {level.name}: {result.stderr.strip()[-3000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


if __name__ == "__main__":  # python -m splitserve.model.kernel_build DIR: every level of this machine, for an image
    for path in prebuild(Path(sys.argv[1])):
        print(path)

"""Native CPU kernels: C sources in ``csrc/``, built with the system C compiler at first use, called via ctypes.

The build is ``cc -O3 -march=native -fopenmp`` into a cache directory (``$SPLITSERVE_KERNEL_CACHE``, else
``$XDG_CACHE_HOME/splitserve/kernels``, else ``~/.cache/splitserve/kernels``), named by a digest of the source,
the flags, the compiler and the CPU's feature flags, so a changed source or another CPU builds afresh and
processes starting together never load a half-written file (each builds to a temporary name and renames).
Building takes about a second. Without a compiler, or with ``SPLITSERVE_NATIVE_KERNELS=0``, ``native()``
returns None and callers use their PyTorch paths: the results agree, only speed differs.

ctypes releases the GIL for the call, so the engine thread's attention does not hold up the event loop.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ctypes import _SimpleCData

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC") + (
    ("-mprefer-vector-width=512",) if os.uname().machine in ("x86_64", "AMD64") else ()
)

_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# q, q_row_stride, k_cache, v_cache, tables, max_blocks, lens, out, num_seqs, num_heads, num_kv_heads,
# head_dim, block_size, scale, num_threads
_DECODE_ARGTYPES: list[type[_SimpleCData[Any]]] = [_P, _I64, _P, _P, _P, _I64, _P, _P, _I, _I, _I, _I, _I, _F, _I]
# x, delta, weight, out, num_rows, n, eps, num_threads
_NORM_ARGTYPES: list[type[_SimpleCData[Any]]] = [_P, _P, _P, _P, _I64, _I64, _F, _I]


class NativeKernels:
    """The loaded library. Each method checks that the tensors are ones its C function takes (CPU, dtype,
    layout) and declines (None or False) otherwise, so callers keep a PyTorch path for everything else."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.decode = {
            torch.bfloat16: library.paged_decode_attention_bf16,
            torch.float32: library.paged_decode_attention_f32,
        }
        for fn in self.decode.values():
            fn.argtypes = _DECODE_ARGTYPES
            fn.restype = ctypes.c_int
        # keyed by the output dtype, which the delta shares; the residual stream is always float32. These are
        # the model's two layouts: float32 throughout, and a float32 stream with bfloat16 matmul inputs
        self.norm = {
            torch.bfloat16: library.add_rms_norm_bf16_to_bf16,
            torch.float32: library.add_rms_norm_f32_to_f32,
        }
        for fn in self.norm.values():
            fn.argtypes = _NORM_ARGTYPES
            fn.restype = None

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, out_dtype: torch.dtype
    ) -> torch.Tensor | None:
        """``x += delta`` in place, then RMSNorm(x) * weight as ``out_dtype``; None where the kernel does not apply.

        x and weight are float32; delta, when given, is ``out_dtype`` (the matmul dtype), as is the result.
        """
        fn = self.norm.get(out_dtype)
        if (
            fn is None
            or x.device.type != "cpu"
            or x.dtype != torch.float32
            or weight.dtype != torch.float32
            or x.dim() != 2
            or not (x.is_contiguous() and weight.is_contiguous())
            or (delta is not None and (delta.dtype != out_dtype or delta.shape != x.shape or not delta.is_contiguous()))
        ):
            return None
        out = torch.empty(x.shape, dtype=out_dtype)
        delta_ptr = None if delta is None else delta.data_ptr()
        fn(
            x.data_ptr(),
            delta_ptr,
            weight.data_ptr(),
            out.data_ptr(),
            x.shape[0],
            x.shape[1],
            eps,
            torch.get_num_threads(),
        )
        return out

    def paged_decode_attention(
        self,
        q: torch.Tensor,  # [B, H, D], heads packed; rows may be strided
        k_cache: torch.Tensor,  # [slots, Hkv, D] contiguous
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [B, max_blocks] int64 contiguous
        context_lens: torch.Tensor,  # [B] int64: tokens each query attends to, its own included
        block_size: int,
        scale: float,
    ) -> torch.Tensor | None:
        """[B, H, D] attention output, or None when these tensors are not ones the kernel takes."""
        fn = self.decode.get(q.dtype)
        num_seqs, num_heads, head_dim = q.shape
        if (
            fn is None
            or q.device.type != "cpu"
            or not (k_cache.dtype == v_cache.dtype == q.dtype)
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or q.stride(2) != 1
            or q.stride(1) != head_dim
            or block_tables.dtype != torch.int64
            or context_lens.dtype != torch.int64
            or not (block_tables.is_contiguous() and context_lens.is_contiguous())
        ):
            return None
        out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype)
        status = fn(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(), out.data_ptr(),
            num_seqs, num_heads, k_cache.shape[1], head_dim, block_size, scale, torch.get_num_threads(),
        )  # fmt: skip
        return out if status == 0 else None


def cache_dir() -> Path:
    if explicit := os.environ.get("SPLITSERVE_KERNEL_CACHE"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "splitserve" / "kernels"


@functools.cache
def native() -> NativeKernels | None:
    """The native kernels, built on first call; None (logged once) where they cannot be built or loaded."""
    if os.environ.get("SPLITSERVE_NATIVE_KERNELS", "1") == "0":
        logger.info("native CPU kernels disabled (SPLITSERVE_NATIVE_KERNELS=0); using PyTorch attention")
        return None
    try:
        return NativeKernels(ctypes.CDLL(str(_build())))
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        logger.warning("native CPU kernels unavailable, using PyTorch attention: %s", exc)
        return None


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode(), _cpu_flags().encode()):
        digest.update(part)
    target = cache_dir() / f"cpu_kernels-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True, timeout=300
        )
        if result.returncode != 0:
            raise OSError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built native CPU kernels: %s", target)
    return target


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine

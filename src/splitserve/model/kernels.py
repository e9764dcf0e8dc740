"""Native CPU kernels: C sources in ``csrc/`` (their interface: ``csrc/ss_kernels.h``), built or found by
``model.kernel_build`` for each instruction-set level, called via ctypes.

``detect_cpu()`` reads the CPU's features once; ``native()`` loads the best level the CPU runs, or the one
``SPLITSERVE_KERNEL_ISA`` names (to measure another class's code path on this machine). Without a library (no
prebuilt one and no compiler), or with ``SPLITSERVE_NATIVE_KERNELS=0``, ``native()`` returns None and callers use
their PyTorch paths: the results agree, only speed differs. A library whose ABI is not these bindings' is refused
(``check_abi``).

ctypes releases the GIL for the call, so the engine thread's kernels do not hold up the event loop.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from splitserve import envs
from splitserve.model import kv_format
from splitserve.model.kernel_build import IsaLevel, detect_cpu, library_path, select_level

if TYPE_CHECKING:
    from ctypes import _SimpleCData

logger = logging.getLogger(__name__)


def describe_cpu() -> dict[str, Any]:
    """What ``GET /version`` shows: the CPU, its features and the kernel path chosen.

    Loads the kernels when nothing has yet (a few seconds the first time; call it off the event loop).
    """
    try:
        kernels = native()
        kernel_isa = kernels.level.name if kernels is not None else "none"
    except ValueError as exc:  # SPLITSERVE_KERNEL_ISA names a build this CPU cannot run
        kernel_isa = f"none ({exc})"
    return {**_cpu_labels(kernel_isa), "features": detect_cpu().features}


def loaded_cpu_info() -> dict[str, str]:
    """The ``splitserve:cpu_info`` labels, without building anything: the kernel path is "none" until loaded."""
    loaded = native() if native.cache_info().currsize else None
    return _cpu_labels(loaded.level.name if loaded is not None else "none")


def _cpu_labels(kernel_isa: str) -> dict[str, str]:
    cpu = detect_cpu()
    return {"arch": cpu.arch, "model_name": cpu.model_name, "isa_class": cpu.isa_class, "kernel_isa": kernel_isa}


_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# q, q_row_stride, k_cache, v_cache, tables, max_blocks, row_seq, lens, out, num_rows, num_heads, num_kv_heads,
# head_dim, block_size, scale, num_threads
_ATTENTION_ARGTYPES: list[type[_SimpleCData[Any]]] = [
    _P, _I64, _P, _P, _P, _I64, _P, _P, _P, _I, _I, _I, _I, _I, _F, _I64, _F, _I
]  # fmt: skip
# x, delta, weight, out, num_rows, n, eps, num_threads
_NORM_ARGTYPES: list[type[_SimpleCData[Any]]] = [_P, _P, _P, _P, _I64, _I64, _F, _I]
# x, x_dtype, x_stride, m, k, w, wtype, n, y, out_dtype, ldy, scratch, num_threads
_QMATMUL_ARGTYPES: list[type[_SimpleCData[Any]]] = [_P, _I, _I64, _I64, _I64, _P, _I, _I64, _P, _I, _I64, _P, _I]
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.uint8: 3}  # csrc/common.h; int8, fp8: KV only
# Paged attention's partition (csrc/cpu_kernels.c PARTITION): block sizes must divide it
ATTENTION_PARTITION_TOKENS = 256
# GGML type numbers of the weight formats the quantized matmul takes
QUANT_TYPES = {
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    20: "IQ4_NL",
    23: "IQ4_XS",
}
# The weight type of a weight stacked from parts in different formats (csrc/ss_kernels.h SS_MIXED)
MIXED_TYPE = 1000
_MIXED_PARTS = 4
_MIXED_ALIGN = 64


@dataclass(slots=True)
class PackedWeight:
    """A [n, k] weight in the kernels' interleaved layout (``NativeKernels.pack``), for the build that packed it."""

    data: torch.Tensor  # uint8, opaque
    wtype: int  # GGML type number, or MIXED_TYPE (parts in different formats: pack_stacked)
    n: int
    k: int
    isa: str  # the level whose layout this is

    @property
    def nbytes(self) -> int:
        return self.data.numel()


class NativeKernels:
    """The loaded library. Each method checks that the tensors are ones its C function takes (CPU, dtype,
    layout) and declines (None or False) otherwise, so callers keep a PyTorch path for everything else."""

    def __init__(self, library: ctypes.CDLL, level: IsaLevel) -> None:
        check_abi(library)
        self.level = level
        self.attention = {
            torch.bfloat16: library.ss_paged_attention_bf16,
            torch.float32: library.ss_paged_attention_f32,
        }
        for fn in self.attention.values():
            fn.argtypes = _ATTENTION_ARGTYPES
            fn.restype = ctypes.c_int
        self._attention_packed = library.ss_paged_attention_packed  # int8/fp8 caches (model/kv_format.py)
        self._attention_packed.argtypes = [*_ATTENTION_ARGTYPES, _I]
        self._attention_packed.restype = ctypes.c_int
        self._quantize_kv = library.ss_quantize_kv
        self._quantize_kv.argtypes = [_P, _I64, _I, _I, _P]
        self._quantize_kv.restype = None
        # keyed by the output dtype, which the delta shares; the residual stream is always float32. These are
        # the model's two layouts: float32 throughout, and a float32 stream with bfloat16 matmul inputs
        self.norm = {
            torch.bfloat16: library.ss_add_rms_norm_bf16,
            torch.float32: library.ss_add_rms_norm_f32,
        }
        for fn in self.norm.values():
            fn.argtypes = _NORM_ARGTYPES
            fn.restype = None
        self._qmatmul = library.ss_quant_matmul
        self._qmatmul.argtypes = _QMATMUL_ARGTYPES
        self._qmatmul.restype = ctypes.c_int
        self._packed_bytes = library.ss_packed_bytes
        self._packed_bytes.argtypes = [_I, _I64, _I64]
        self._packed_bytes.restype = _I64
        self._repack = library.ss_repack
        self._repack.argtypes = [_P, _I, _I64, _I64, _P]
        self._repack.restype = ctypes.c_int
        self.forward_step = library.ss_forward_step
        self.forward_step.argtypes = [_P, _P, _I, _P, _P, _P, _I64, _P, _P, _P, _I]
        self.forward_step.restype = ctypes.c_int
        self._dot_rows = library.ss_dot_rows_f32
        self._dot_rows.argtypes = [_P, _I64, _I64, _P, _P, _I64, _P, _I]
        self._dot_rows.restype = None
        self._prefill = library.ss_prefill_attention_bf16
        self._prefill.argtypes = [_P, _I64, _P, _P, _P, _I64, _I64, _P, _I, _I, _I, _F, _I]
        self._prefill.restype = ctypes.c_int
        self._silu_mul = library.ss_silu_mul_bf16
        self._silu_mul.argtypes = [_P, _I64, _I64, _I64, _P, _I]
        self._silu_mul.restype = None
        self._rotary = library.ss_rotary_bf16
        self._rotary.argtypes = [_P, _I64, _I64, _I, _I, _P, _P, _I]
        self._rotary.restype = None
        self._dequantize = library.ss_dequantize_rows
        self._dequantize.argtypes = [_P, _I, _I64, _I64, _I64, _P]
        self._dequantize.restype = ctypes.c_int

    def __deepcopy__(self, memo: dict[int, Any]) -> NativeKernels:
        return self  # a loaded library: copies of a model share it

    def pack(self, rows: torch.Tensor, wtype: int, k: int) -> PackedWeight:
        """GGUF rows ([n, row bytes] uint8, ``wtype`` blocks of 32 along k) in this build's layout.

        Raises ``ValueError`` for a format the kernels do not take or a k its blocks do not divide (32, or 256 for
        the K-quants).
        """
        n = rows.shape[0]
        size = self._packed_bytes(wtype, n, k) if wtype in QUANT_TYPES else -1
        if size < 0 or rows.dtype != torch.uint8 or not rows.is_contiguous():
            raise ValueError(f"cannot pack a GGML type {wtype} weight of {n} x {k} ({rows.dtype})")
        data = torch.empty(size, dtype=torch.uint8)
        if self._repack(rows.data_ptr(), wtype, n, k, data.data_ptr()) != 0:
            raise ValueError(f"repacking a GGML type {wtype} weight of {n} x {k} failed")
        return PackedWeight(data, wtype, n, k, self.level.name)

    def pack_stacked(self, parts: list[tuple[torch.Tensor, int]], k: int) -> PackedWeight:
        """GGUF weights stacked along their output rows (fused q/k/v, gate/up), each ``(rows, wtype)``, as one
        weight: in one format where they share one, else a mixed weight whose parts keep their own (a Q4_K_M
        file's v projection has more bits than its q and k). ``ValueError`` as ``pack``."""
        if len({wtype for _, wtype in parts}) == 1:
            return self.pack(torch.cat([rows for rows, _ in parts]), parts[0][1], k)
        # parts of one format next to each other stay one part
        merged: list[tuple[list[torch.Tensor], int]] = []
        for rows, wtype in parts:
            if merged and merged[-1][1] == wtype:
                merged[-1][0].append(rows)
            else:
                merged.append(([rows], wtype))
        if len(merged) > _MIXED_PARTS:
            raise ValueError(f"cannot pack a weight of {len(merged)} parts in alternating formats")
        packed = [self.pack(torch.cat(rows), wtype, k) for rows, wtype in merged]
        header = _Mixed()
        header.num_parts = len(packed)
        offset = -(-ctypes.sizeof(_Mixed) // _MIXED_ALIGN) * _MIXED_ALIGN
        for i, part in enumerate(packed):
            header.wtype[i], header.n[i], header.offset[i] = part.wtype, part.n, offset
            offset += -(-part.nbytes // _MIXED_ALIGN) * _MIXED_ALIGN
        data = torch.zeros(offset, dtype=torch.uint8)
        data[: ctypes.sizeof(_Mixed)] = torch.frombuffer(bytearray(bytes(header)), dtype=torch.uint8)
        for i, part in enumerate(packed):
            data[header.offset[i] : header.offset[i] + part.nbytes] = part.data
        return PackedWeight(data, MIXED_TYPE, sum(p.n for p in packed), k, self.level.name)

    def dequantize(self, rows: torch.Tensor | np.ndarray, wtype: int, k: int) -> torch.Tensor:
        """GGUF rows ([n, row bytes] uint8; a read-only memory map will do) as a float32 [n, k] tensor, equal to
        ``gguf.quants.dequantize``'s (the loader's, and the reference the tests compare to)."""
        pointer = rows.data_ptr() if isinstance(rows, torch.Tensor) else rows.ctypes.data
        if isinstance(rows, np.ndarray) and not rows.flags.c_contiguous:
            raise ValueError("GGUF rows to dequantize must be contiguous")
        out = torch.empty(rows.shape[0], k, dtype=torch.float32)
        if wtype not in QUANT_TYPES or self._dequantize(pointer, wtype, k, 0, rows.shape[0], out.data_ptr()):
            raise ValueError(f"cannot dequantize GGML type {wtype}")
        return out

    def quant_matmul(self, x: torch.Tensor, weight: PackedWeight) -> torch.Tensor | None:
        """``x @ W.T`` ([m, k] float32/bfloat16 -> [m, n] in x's dtype); None where the kernel does not apply.

        Activations are quantized to 8 bits per block of 32 on the way in (llama.cpp's Q8 scheme), and each
        row's block products are summed in block order: a row's result is the same at any row count and
        thread count (the 5+ row AMX tiles included).
        """
        code = _DTYPE_CODES.get(x.dtype)
        if (
            code is None
            or weight.isa != self.level.name
            or x.device.type != "cpu"
            or x.dim() != 2
            or x.shape[1] != weight.k
            or x.stride(1) != 1
        ):
            return None
        out = torch.empty(x.shape[0], weight.n, dtype=x.dtype)
        status = self._qmatmul(
            x.data_ptr(), code, x.stride(0), x.shape[0], weight.k, weight.data.data_ptr(), weight.wtype, weight.n,
            out.data_ptr(), code, weight.n, None, torch.get_num_threads(),
        )  # fmt: skip
        return out if status == 0 else None

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

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """SiLU(gate) * up of a bfloat16 [T, 2I] gate/up output, as [T, I]; None where the kernel does not apply."""
        if (
            gate_up.dtype != torch.bfloat16
            or gate_up.device.type != "cpu"
            or gate_up.dim() != 2
            or gate_up.stride(1) != 1
            or gate_up.shape[1] % 2
        ):
            return None
        rows, n = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, n, dtype=gate_up.dtype)
        self._silu_mul(gate_up.data_ptr(), gate_up.stride(0), rows, n, out.data_ptr(), torch.get_num_threads())
        return out

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Rotate-half rotary of bfloat16 x [T, heads, D] in place, with cos/sin [T, 1, D]; False if not applied."""
        num_tokens, num_heads, head_dim = x.shape
        if (
            x.dtype != torch.bfloat16
            or x.device.type != "cpu"
            or x.stride(2) != 1
            or x.stride(1) != head_dim
            or head_dim % 2
            or not (cos.dtype == sin.dtype == x.dtype)
            or not (cos.is_contiguous() and sin.is_contiguous())
            or cos.numel() != num_tokens * head_dim
            or sin.numel() != num_tokens * head_dim
        ):
            return False
        self._rotary(
            x.data_ptr(), x.stride(0), num_tokens, num_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return True

    def prefill_attention(
        self,
        q: torch.Tensor,  # [Q, H, D] bfloat16, heads packed; rows may be strided
        k_cache: torch.Tensor,  # [slots, Hkv, D] contiguous, this chunk's K already written
        v_cache: torch.Tensor,
        context_slots: torch.Tensor,  # [C] int64: the slot of each context position
        scale: float,
    ) -> torch.Tensor | None:
        """Causal attention of a prefill chunk over its context ([Q, H, D]), query i at position C - Q + i.

        Only the ``amx`` build computes it (bfloat16, head size 64); None elsewhere, and the caller uses SDPA.
        """
        if (
            self.level.name != "amx"
            or q.dtype != torch.bfloat16
            or q.device.type != "cpu"
            or not (k_cache.dtype == v_cache.dtype == q.dtype)
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or q.stride(2) != 1
            or q.stride(1) != q.shape[2]
            or context_slots.dtype != torch.int64
            or not context_slots.is_contiguous()
        ):
            return None
        num_q, num_heads, head_dim = q.shape
        out = torch.empty(num_q, num_heads, head_dim, dtype=q.dtype)
        status = self._prefill(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), context_slots.data_ptr(),
            context_slots.shape[0], num_q, out.data_ptr(), num_heads, k_cache.shape[1], head_dim, scale,
            torch.get_num_threads(),
        )  # fmt: skip
        return out if status == 0 else None

    def paged_attention(
        self,
        q: torch.Tensor,  # [T, H, D], heads packed; rows may be strided
        k_cache: torch.Tensor,  # [slots, Hkv, D] contiguous, the rows' own K/V already written
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [S, max_blocks] int64 contiguous
        context_lens: torch.Tensor,  # [T] int64: tokens each query attends to, its own included
        block_size: int,
        scale: float,
        row_seq: torch.Tensor | None = None,  # [T] int64: each row's table (None: row i uses table i)
        window: int | None = None,  # a sliding window: each row attends to its last ``window`` positions at most
        softcap: float | None = None,  # scores capped to softcap * tanh(score / softcap) (Gemma 2)
    ) -> torch.Tensor | None:
        """[T, H, D] attention output, or None when these tensors are not ones the kernel takes.

        Each row's result depends on its query, its context length and the cache alone (``csrc/cpu_kernels.c``):
        the same bits whichever rows run beside it and however many threads run them. An int8 or fp8 cache
        (``model/kv_format.py``) takes a bfloat16 ``q``.
        """
        num_rows, num_heads, head_dim = q.shape
        packed = k_cache.dtype in kv_format.PACKED
        fn = (self._attention_packed if q.dtype == torch.bfloat16 else None) if packed else self.attention.get(q.dtype)
        if (
            fn is None
            or q.device.type != "cpu"
            or not (k_cache.dtype == v_cache.dtype == (k_cache.dtype if packed else q.dtype))
            or k_cache.shape[2] != kv_format.row_width(k_cache.dtype, head_dim)
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or q.stride(2) != 1
            or q.stride(1) != head_dim
            or not _int64_rows(block_tables, context_lens, row_seq)
        ):
            return None
        out = torch.empty(num_rows, num_heads, head_dim, dtype=q.dtype)
        status = fn(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            block_tables.data_ptr(), block_tables.shape[1], None if row_seq is None else row_seq.data_ptr(),
            context_lens.data_ptr(), out.data_ptr(), num_rows, num_heads, k_cache.shape[1], head_dim, block_size,
            scale, window or 0, softcap or 0.0, torch.get_num_threads(),
            *([_DTYPE_CODES[k_cache.dtype]] if packed else []),
        )  # fmt: skip
        return out if status == 0 else None

    def quantize_kv(self, x: torch.Tensor, dtype: torch.dtype = torch.int8) -> torch.Tensor | None:
        """``x [..., head_dim]`` float32 as packed KV rows ``[..., head_dim + head_dim / 16]`` of ``dtype`` (int8, or
        uint8 for fp8: ``model/kv_format.py``), by the forward step's own code; None where the kernel does not
        apply."""
        if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous() or x.dim() < 1:
            return None
        head_dim = x.shape[-1]
        if head_dim % kv_format.GROUP or dtype not in kv_format.PACKED:
            return None
        out = torch.empty(*x.shape[:-1], kv_format.row_width(dtype, head_dim), dtype=dtype)
        self._quantize_kv(x.data_ptr(), x.numel() // head_dim, head_dim, _DTYPE_CODES[dtype], out.data_ptr())
        return out

    def dot_rows(self, x: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
        """``out[i, j] = x[i] . weight[rows[i, j]]`` in float32, each dot product in one fixed order (so a row's
        values never depend on the others or the thread count); None where the kernel does not apply."""
        if (
            x.dtype != torch.float32
            or weight.dtype != torch.float32
            or rows.dtype != torch.int64
            or x.device.type != "cpu"
            or x.dim() != 2
            or rows.dim() != 2
            or rows.shape[0] != x.shape[0]
            or weight.shape[1] != x.shape[1]
            or not (x.is_contiguous() and weight.is_contiguous() and rows.is_contiguous())
        ):
            return None
        out = torch.empty(rows.shape, dtype=torch.float32)
        self._dot_rows(
            x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), rows.data_ptr(), rows.shape[1], out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return out


def _int64_rows(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.dtype == torch.int64 and t.is_contiguous()) for t in tensors)


ABI_VERSION = 7  # csrc/ss_kernels.h's SS_ABI_VERSION: these bindings' idea of the library's interface


def check_abi(library: ctypes.CDLL) -> None:
    """``OSError`` unless the library's ABI version and struct sizes are these bindings' (``ss_kernels.h``)."""
    library.ss_abi_version.restype = ctypes.c_int32
    library.ss_struct_size.argtypes = [_I]
    library.ss_struct_size.restype = _I64
    version = library.ss_abi_version()
    sizes = {name: library.ss_struct_size(which) for which, name in enumerate(("ss_layer", "ss_model", "ss_mixed"))}
    expected = {"ss_layer": ctypes.sizeof(_Layer), "ss_model": ctypes.sizeof(_Model), "ss_mixed": ctypes.sizeof(_Mixed)}
    if version != ABI_VERSION or sizes != expected:
        raise OSError(
            f"the kernel library's ABI (version {version}, struct sizes {sizes}) is not these bindings' "
            f"(version {ABI_VERSION}, {expected}): csrc/ss_kernels.h and model/kernels.py disagree"
        )


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _P), ("post_norm", _P), ("qkv", _P), ("o", _P), ("gate_up", _P), ("down", _P),
        ("qkv_type", ctypes.c_int32), ("o_type", ctypes.c_int32), ("gate_up_type", ctypes.c_int32),
        ("down_type", ctypes.c_int32), ("qkv_bias", _P), ("o_bias", _P), ("q_norm", _P), ("k_norm", _P),
        ("attn_out_norm", _P), ("mlp_out_norm", _P), ("cos", _P), ("sin", _P), ("window", _I64),
    ]  # fmt: skip


class _Mixed(ctypes.Structure):
    _fields_ = [
        ("num_parts", _I64), ("wtype", _I64 * _MIXED_PARTS), ("n", _I64 * _MIXED_PARTS),
        ("offset", _I64 * _MIXED_PARTS),
    ]  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", ctypes.c_int32), ("hidden", ctypes.c_int32), ("num_heads", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32), ("intermediate", ctypes.c_int32),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("cos", _P), ("sin", _P), ("max_positions", _I64),
        ("final_norm", _P), ("layers", ctypes.POINTER(_Layer)), ("kv", _P), ("num_slots", _I64),
        ("kv_dtype", ctypes.c_int32), ("block_size", ctypes.c_int32), ("activation", ctypes.c_int32),
        ("attn_softcap", ctypes.c_float),
    ]  # fmt: skip


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # ss_model.activation (csrc/ss_kernels.h)


@dataclass(frozen=True, slots=True)
class StepLayer:
    """One decoder layer's tensors for ``ForwardStep``: float32 norm weights and packed matmul weights, and what
    some architectures add: float32 biases, q/k head norms, norms of the attention's and the MLP's outputs, the
    layer's own rotary tables (float32 [max_positions, head_dim]) and its sliding window."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: PackedWeight
    o: PackedWeight
    gate_up: PackedWeight
    down: PackedWeight
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None
    window: int | None = None


class ForwardStep:
    """A whole step, decode rows and prefill chunks alike, in one native call (``csrc/forward_step.c``), over
    the model's tensors: every row computed from that row alone, in one fixed order.

    Built once per model and KV cache; holds references to every tensor it points at, so they outlive it.
    """

    def __init__(
        self,
        kernels: NativeKernels,
        layers: list[StepLayer],
        final_norm: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [max_positions, head_dim] float32
        kv_cache: torch.Tensor,  # [layers, 2, slots, kv_heads, row] (model/kv_format.py)
        shape: tuple[int, int, int, int, int],  # hidden, heads, kv heads, head_dim, intermediate
        eps: float,
        block_size: int,
        scale: float,  # of the attention scores
        activation: str = "silu",  # a key of ACTIVATIONS
        attn_softcap: float | None = None,  # the scores' soft cap (Gemma 2)
    ) -> None:
        hidden, num_heads, num_kv_heads, head_dim, intermediate = shape
        self._keep = (layers, final_norm, rotary, kv_cache)
        self._layers = (_Layer * len(layers))()
        for slot, layer in zip(self._layers, layers, strict=True):
            slot.input_norm, slot.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
            for name in ("qkv", "o", "gate_up", "down"):
                weight: PackedWeight = getattr(layer, name)
                setattr(slot, name, weight.data.data_ptr())
                setattr(slot, f"{name}_type", weight.wtype)
            for name in ("qkv_bias", "o_bias", "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm"):
                extra: torch.Tensor | None = getattr(layer, name)
                setattr(slot, name, None if extra is None else extra.data_ptr())
            if layer.rotary is not None:
                if layer.rotary[0].shape != rotary[0].shape:
                    raise ValueError(
                        f"a layer's rotary tables {tuple(layer.rotary[0].shape)} beside the model's "
                        f"{tuple(rotary[0].shape)}"
                    )
                slot.cos, slot.sin = (t.data_ptr() for t in layer.rotary)
            slot.window = layer.window or 0
        cos, sin = rotary
        self._model = _Model(
            len(layers), hidden, num_heads, num_kv_heads, head_dim, intermediate, eps, scale,
            cos.data_ptr(), sin.data_ptr(), cos.shape[0], final_norm.data_ptr(), self._layers, kv_cache.data_ptr(),
            kv_cache.shape[2], _DTYPE_CODES[kv_cache.dtype], block_size, ACTIVATIONS[activation], attn_softcap or 0.0,
        )  # fmt: skip
        self.hidden = hidden
        self._fn = kernels.forward_step

    def __call__(
        self,
        x: torch.Tensor,  # [T, hidden] float32 embeddings, overwritten
        positions: torch.Tensor,  # [T] int64
        slots: torch.Tensor,  # [T] int64
        block_tables: torch.Tensor,  # [S, max_blocks] int64
        row_seq: torch.Tensor,  # [T] int64: the table of each row
        context_lens: torch.Tensor,  # [T] int64: what each row attends to, itself included
    ) -> torch.Tensor | None:
        """The final-normed hidden states [T, hidden] float32, or None where the step cannot run here."""
        if not _int64_rows(positions, slots, block_tables, row_seq, context_lens):
            return None
        out = torch.empty_like(x)
        status = self._fn(
            ctypes.byref(self._model), x.data_ptr(), x.shape[0], positions.data_ptr(), slots.data_ptr(),
            block_tables.data_ptr(), block_tables.shape[1], row_seq.data_ptr(), context_lens.data_ptr(),
            out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return out if status == 0 else None


@functools.cache
def native() -> NativeKernels | None:
    """The kernels of this CPU's best level, built on first call; None (logged once) where they cannot be."""
    if envs.get(envs.NATIVE_KERNELS) == "0":
        logger.info("native CPU kernels disabled (SPLITSERVE_NATIVE_KERNELS=0); using PyTorch paths")
        return None
    cpu = detect_cpu()
    level = select_level(cpu)
    kernels = kernels_for(level)
    if kernels is None and envs.get(envs.KERNEL_ISA).lower() == "auto":
        # an older compiler may lack the best level's flags (AMX needs GCC 11): take the next level down
        for lower in reversed(cpu.levels[: cpu.levels.index(level)]):
            if (kernels := kernels_for(lower)) is not None:
                level = lower
                break
    if kernels is not None:
        logger.info(
            "CPU %s (%s; %s): native kernels built for %s",
            cpu.model_name, cpu.isa_class, " ".join(cpu.features) or "no vector extensions", level.name,
        )  # fmt: skip
    return kernels


@functools.cache
def kernels_for(level: IsaLevel) -> NativeKernels | None:
    """The kernels built for ``level`` (which the caller knows this CPU runs); None where they cannot be built."""
    try:
        return NativeKernels(ctypes.CDLL(str(library_path(level))), level)
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        logger.warning("native CPU kernels (%s) unavailable, using PyTorch paths: %s", level.name, exc)
        return None

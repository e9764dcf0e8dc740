"""On PYTHONPATH, PyTorch's CPU probes answer as an AVX2 CPU's (``serving_vs_peers.py --isa avx2``).

vLLM picks its compiled kernel library (``_C_AVX2`` against ``_C_AVX512`` and ``_C``), its CPU attention's
instruction set and its bfloat16 paths from ``torch.cpu._is_*_supported()``, which read the CPU, not
``ATEN_CPU_CAPABILITY``; splitserve's ``--dtype auto`` asks the same probes. Answering False for AVX-512, VNNI
and AMX makes both load and run what they run on an AVX2 machine. torch is patched when something imports it,
not before, so a process that never imports torch stays without it. A benchmark aid only: nothing in
splitserve imports it.
"""

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

PROBES = (
    "_is_avx512_supported",
    "_is_avx512_bf16_supported",
    "_is_vnni_supported",
    "_is_amx_tile_supported",
    "_is_amx_fp16_supported",
)


def _answer_as_avx2(torch: ModuleType) -> None:
    for probe in PROBES:
        if hasattr(torch.cpu, probe):
            setattr(torch.cpu, probe, lambda: False)


class _PatchTorchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):  # type: ignore[no-untyped-def]
        if name != "torch":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _answer_as_avx2(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _PatchTorchOnImport())

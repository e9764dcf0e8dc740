"""On PYTHONPATH for vLLM under ``serving_vs_peers.py --isa avx2``: PyTorch's CPU probes answer as an AVX2 CPU's.

vLLM picks its compiled kernel library (``_C_AVX2`` against ``_C_AVX512`` and ``_C``), its CPU attention's
instruction set and its bfloat16 paths from ``torch.cpu._is_*_supported()``, which read the CPU, not
``ATEN_CPU_CAPABILITY``. Answering False for AVX-512, VNNI and AMX makes it load and run what it runs on an AVX2
machine. A benchmark aid only: nothing in splitserve imports it.
"""

import torch

for _probe in (
    "_is_avx512_supported",
    "_is_avx512_bf16_supported",
    "_is_vnni_supported",
    "_is_amx_tile_supported",
    "_is_amx_fp16_supported",
):
    if hasattr(torch.cpu, _probe):
        setattr(torch.cpu, _probe, lambda: False)

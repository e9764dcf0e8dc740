"""Who may import whom: the contracts in pyproject.toml (``lint-imports``, run by ``make lint``), and the
fact they protect, checked directly: the router, the deploy tools and the benchmark client start without torch."""

from __future__ import annotations

import subprocess
import sys

TORCH_FREE_ENTRY_POINTS = [
    "splitserve.cli",
    "splitserve.router.run",
    "splitserve.router.app",
    "splitserve.router.k8s_discovery",
    "splitserve.deploy.local",
    "splitserve.deploy.supervisor",
    "splitserve.deploy.render",
    "splitserve.deploy.operator",
    "splitserve.bench.cli",
    "splitserve.endpoint",
]


def test_the_router_deploy_and_bench_entry_points_never_import_torch() -> None:
    imports = "; ".join(f"import {module}" for module in TORCH_FREE_ENTRY_POINTS)
    code = f"import sys; {imports}; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]", result.stdout

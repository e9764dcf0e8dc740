"""Who may import whom: the contracts in pyproject.toml (``lint-imports``, run by ``make lint``), and the
fact they protect, checked directly: the router, the deploy tools and the benchmark client start without torch,
so that a plain ``pip install splitserve`` (no engine extra, no torch) runs them."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import splitserve.bench
import splitserve.deploy
import splitserve.router

TORCH_FREE_PACKAGES = [splitserve.router, splitserve.deploy, splitserve.bench]
TORCH_FREE_MODULES = ["splitserve.cli", "splitserve.endpoint", "splitserve.model.source", "splitserve.model.tokenizer"]


def torch_free_entry_points() -> list[str]:
    """Every module of the router, deploy and bench packages, and the torch-free modules they start from."""
    modules = [
        info.name for pkg in TORCH_FREE_PACKAGES for info in pkgutil.walk_packages(pkg.__path__, f"{pkg.__name__}.")
    ]
    return [*TORCH_FREE_MODULES, *modules]


def test_every_router_deploy_and_bench_module_is_found() -> None:
    modules = torch_free_entry_points()
    for name in (
        "splitserve.router.app",
        "splitserve.router.run",
        "splitserve.deploy.operator",
        "splitserve.bench.cli",
    ):
        assert name in modules


def test_the_router_deploy_and_bench_entry_points_never_import_torch() -> None:
    imports = "; ".join(f"import {module}" for module in torch_free_entry_points())
    code = f"import sys; {imports}; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]", result.stdout

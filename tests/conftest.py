"""Markers by folder, so a run selects tests by what they cost (``make test-fast`` runs ``unit`` alone).

=============  ======================================================================================
folder         what its tests may use
=============  ======================================================================================
unit           this process only: fakes, in-process servers on loopback sockets, no real model
engine         the engine in this process: the real model (SmolLM2) or a tiny random one, native kernels
integration    real processes besides this one (redis-server) on loopback
security       real workers, routers and Redis, attacked the way an outsider would
e2e            real worker and router processes with the real model, over real HTTP
packaging      a wheel built from this tree, installed into a fresh virtualenv from the local wheelhouse
=============  ======================================================================================

``slow`` (more than a few seconds), ``redis`` (needs a redis-server binary) and ``gpu`` (needs CUDA) are set by
the tests themselves. ``--strict-markers`` (pyproject.toml) refuses any other.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).parent
FOLDER_MARKERS = ("unit", "engine", "integration", "security", "e2e", "packaging")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(item.path).relative_to(TESTS).parts[0]
        if folder not in FOLDER_MARKERS:
            raise pytest.UsageError(f"{item.nodeid}: tests live in one of the folders {', '.join(FOLDER_MARKERS)}")
        item.add_marker(folder)

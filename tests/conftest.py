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

And by fixture: a test that takes one of ``FIXTURE_MARKERS``' fixtures, directly or through another fixture,
gets its markers (``redis`` for a real redis-server). ``slow`` (more than a few seconds), ``gpu`` (needs CUDA)
and ``redis`` where no fixture says it are set by the tests themselves. ``--strict-markers`` (pyproject.toml)
refuses any other.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).parent
FOLDER_MARKERS = ("unit", "engine", "integration", "security", "e2e", "packaging")
FIXTURE_MARKERS = {"redis_server": ("redis",)}  # fixture -> the markers of every test that uses it


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(item.path).relative_to(TESTS).parts[0]
        if folder not in FOLDER_MARKERS:
            raise pytest.UsageError(f"{item.nodeid}: tests live in one of the folders {', '.join(FOLDER_MARKERS)}")
        item.add_marker(folder)
        for fixture in getattr(item, "fixturenames", ()):
            for marker in FIXTURE_MARKERS.get(fixture, ()):
                item.add_marker(marker)

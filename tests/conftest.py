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

import itertools
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
FOLDER_MARKERS = ("unit", "engine", "integration", "security", "e2e", "packaging")
FIXTURE_MARKERS = {"redis_server": ("redis",)}  # fixture -> the markers of every test that uses it


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Leave out a marker folder whose tests the ``-m`` expression cannot select: collecting a folder imports its
    modules, and each of ``make test``'s steps imported every folder's (about 10 s a step)."""
    if collection_path.parent != TESTS or collection_path.name not in FOLDER_MARKERS:
        return None
    expression = config.getoption("markexpr")
    return True if expression and not _may_select(expression, collection_path.name) else None


def _may_select(expression: str, folder: str) -> bool:
    """Whether ``expression`` holds for some test of ``folder``: its folder marker set, every other folder's
    unset, each other marker (``slow``, ``redis``...) either way. True where the expression cannot be read."""
    try:
        from _pytest.mark.expression import Expression  # pytest's own -m parser

        compiled = Expression.compile(expression)
    except Exception:  # another pytest, or an expression pytest will refuse itself
        return True
    others = sorted(set(re.findall(r"[A-Za-z_]\w*", expression)) - {"and", "or", "not", *FOLDER_MARKERS})
    for values in itertools.product((False, True), repeat=len(others)):
        assigned = dict(zip(others, values, strict=True))

        def matcher(name: str, /, assigned: dict[str, bool] = assigned, **_kwargs: object) -> bool:
            return name == folder if name in FOLDER_MARKERS else assigned.get(name, False)

        if compiled.evaluate(matcher):
            return True
    return False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(item.path).relative_to(TESTS).parts[0]
        if folder not in FOLDER_MARKERS:
            raise pytest.UsageError(f"{item.nodeid}: tests live in one of the folders {', '.join(FOLDER_MARKERS)}")
        item.add_marker(folder)
        for fixture in getattr(item, "fixturenames", ()):
            for marker in FIXTURE_MARKERS.get(fixture, ()):
                item.add_marker(marker)

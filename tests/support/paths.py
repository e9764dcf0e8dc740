"""Where the repository's own files are: its root and the example endpoint resources (``examples/*.yaml``)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"

"""Opening a GGUF file quickly, without torch (the tokenizer conversion and the weight loaders share it)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


class _PlainArrayGGUFReader(gguf.GGUFReader):
    """``gguf.GGUFReader`` over a plain ndarray view of its memory map (see ``open_gguf``)."""

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = value.view(np.ndarray)


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """A ``gguf.GGUFReader`` over ``path`` that parses the header about 3x faster.

    The stock reader slices a ``np.memmap`` about a million times while reading the token list, and every
    memmap slice runs ``memmap.__array_finalize__``; a plain ndarray view of the same mapping avoids that.
    Tensor ``data`` arrays are then plain read-only views of the mapping.
    """
    return _PlainArrayGGUFReader(str(path))

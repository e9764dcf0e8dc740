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


GGUF_MAGIC = b"GGUF"


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """A ``gguf.GGUFReader`` over ``path`` that parses the header about 3x faster.

    The stock reader slices a ``np.memmap`` about a million times while reading the token list, and every
    memmap slice runs ``memmap.__array_finalize__``; a plain ndarray view of the same mapping avoids that.
    Tensor ``data`` arrays are then plain read-only views of the mapping.

    A file that is not a GGUF, or is cut short or corrupt (a tensor's data past the end of the file, a header that
    does not parse), is a ``ValueError`` that says which, instead of whatever the reader trips over.
    """
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    try:
        reader = _PlainArrayGGUFReader(str(path))
    except (ValueError, IndexError, KeyError, TypeError, OverflowError) as exc:
        raise ValueError(f"{path} ({size:,} bytes) is truncated or corrupt (an incomplete download?): {exc}") from exc
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size:
            raise ValueError(
                f"{path} is truncated: tensor {tensor.name} ends at byte {end:,} but the file has {size:,} bytes"
            )
    return reader

"""Opening a GGUF: a file that is not one, or is cut short, is one clear error naming the file and what is wrong."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from splitserve.model.gguf_file import open_gguf


def write_gguf(path: Path) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("blk.0.attn_q.weight", np.arange(64 * 64, dtype=np.float32).reshape(64, 64))
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_whole_file_opens(tmp_path: Path) -> None:
    reader = open_gguf(write_gguf(tmp_path / "m.gguf"))
    assert [t.name for t in reader.tensors] == ["blk.0.attn_q.weight", "output_norm.weight"]


@pytest.mark.parametrize("keep", [8, 200, -64, -1])  # inside the header, and inside the last tensor's data
def test_a_truncated_file_is_named_as_truncated(tmp_path: Path, keep: int) -> None:
    whole = write_gguf(tmp_path / "m.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:keep])
    with pytest.raises(ValueError, match=r"cut\.gguf .*truncated"):
        open_gguf(cut)


def test_a_file_that_is_not_a_gguf_says_so(tmp_path: Path) -> None:
    other = tmp_path / "model.safetensors.gguf"
    other.write_bytes(b'{"not": "a gguf"}' * 10)
    with pytest.raises(ValueError, match=r"is not a GGUF file \(it starts with b'\{\"no'"):
        open_gguf(other)

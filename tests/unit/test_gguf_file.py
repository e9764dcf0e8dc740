"""Opening a GGUF: a file that is not one, or is cut short, is one clear error naming the file and what is wrong."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from splitserve.model.gguf_file import array_length, array_values, open_gguf


def write_gguf(path: Path) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_token_list(["<s>", "</s>", "héllo", ""])
    writer.add_token_types([1, 3, 1, 1])
    writer.add_chat_template("{{ messages }}")
    writer.add_tensor("blk.0.attn_q.weight", np.arange(64 * 64, dtype=np.float32).reshape(64, 64))
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_whole_file_opens(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    reader, stock = open_gguf(path), gguf.GGUFReader(path)
    assert [t.name for t in reader.tensors] == ["blk.0.attn_q.weight", "output_norm.weight"]
    assert [(t.data_offset, t.n_bytes) for t in reader.tensors] == [(t.data_offset, t.n_bytes) for t in stock.tensors]
    np.testing.assert_array_equal(reader.tensors[0].data, stock.tensors[0].data)
    # scalars and strings as the stock reader has them; arrays without a part per item
    assert reader.fields["llama.block_count"].contents() == 1
    assert reader.fields["tokenizer.chat_template"].contents() == "{{ messages }}"
    tokens, types = reader.fields["tokenizer.ggml.tokens"], reader.fields["tokenizer.ggml.token_type"]
    assert array_length(tokens) == 4 and tokens.contents() == [] and tokens.types == stock.fields[tokens.name].types
    assert array_length(types) == 4 and types.contents() == [1, 3, 1, 1] == list(array_values(types))
    assert list(reader.fields) == list(stock.fields)


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

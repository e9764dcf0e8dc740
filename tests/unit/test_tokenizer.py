"""The SmolLM2 tokenizer: round trips, chat rendering, message validation, the cache, and no torch.

Uses the real tokenizer from the packaged GGUF through the default cache (converted once per machine,
then about a second to load).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from splitserve.model import tokenizer as tokenizer_module
from splitserve.model.tokenizer import Tokenizer, load_tokenizer

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("smollm2")


def test_importing_and_loading_the_tokenizer_imports_no_torch() -> None:
    code = (
        "import sys, splitserve.model.tokenizer as t; assert 'torch' not in sys.modules; "
        "tok = t.load_tokenizer('smollm2'); tok.apply_chat_template([{'role': 'user', 'content': 'hi'}]); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


@pytest.mark.parametrize("text", ["Hello world", "  spaces  and\ttabs\n", "héllo 世界 🙂", "x" * 500, ""])
def test_encode_decode_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_encode_adds_no_special_tokens(tok: Tokenizer) -> None:
    assert tok.encode("Hello world") == [19556, 905]


def test_special_tokens_and_stop_ids(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.eos_token_id == 2
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    assert tok.stop_token_ids == {2}
    assert tok.decode([1, 19556, 2]) == "Hello"
    assert tok.decode([1, 19556, 2], skip_special_tokens=False) == "<|im_start|>Hello<|im_end|>"


def test_chat_template_ends_with_the_assistant_prompt(tok: Tokenizer) -> None:
    text = tok.render_chat(CHAT)
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.apply_chat_template(CHAT)
    assert ids[-4:] == tok.encode("<|im_start|>assistant\n")
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_chat_ids_match_transformers(tok: Tokenizer) -> None:
    expected = tok.hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tok.apply_chat_template(CHAT) == list(expected)


def test_text_parts_are_joined(tok: Tokenizer) -> None:
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}],
        }
    ]
    assert tok.render_chat(parts) == tok.render_chat(CHAT)


def test_no_generation_prompt(tok: Tokenizer) -> None:
    assert tok.render_chat(CHAT, add_generation_prompt=False).endswith("<|im_end|>\n")


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"role": "user"}], r"messages\[0\] \(user\) has no content"),
        ([{"role": "user", "content": None}], "has no content"),
        ([{"role": "wizard", "content": "hi"}], r"messages\[0\]\.role must be one of .*'wizard'"),
        ([{"content": "hi"}], r"role must be one of .*None"),
        ([{"role": "user", "content": 42}], "must be a string or a list of text parts"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "parts must be"),
    ],
)
def test_malformed_messages_raise_value_error(tok: Tokenizer, messages: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)


TOOL_TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %}{{ t.function.name }};{% endfor %}|{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}call {{ c.function.name }}({{ c.function.arguments }}){% endfor %}"
    "{% endif %}{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}|{% endfor %}"
)
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


def test_tool_calls_and_tools_reach_a_template_that_renders_them(tok: Tokenizer) -> None:
    original = tok.hf.chat_template
    tok.hf.chat_template = TOOL_TEMPLATE
    try:
        text = tok.render_chat(TOOL_CHAT, add_generation_prompt=False, tools=TOOLS)
    finally:
        tok.hf.chat_template = original
    assert text == 'tools:weather;|<user>Weather in Paris?|<assistant>call weather({"city": "Paris"})|<tool>sunny [c1]|'


def test_tool_calls_or_tools_a_template_never_reads_are_refused(tok: Tokenizer) -> None:
    assert "tool_calls" not in tokenizer_module.template_fields(tok.hf.chat_template)
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls: this model's chat template does not render"):
        tok.render_chat(TOOL_CHAT)
    with pytest.raises(ValueError, match="tools: this model's chat template does not render tool definitions"):
        tok.render_chat(CHAT, tools=TOOLS)
    tool_result = tok.render_chat([*CHAT, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    assert tool_result.endswith("<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "content": "x", "tool_calls": [{"id": "1"}]},
        {"role": "assistant", "content": "x", "tool_calls": "call it"},
        {"role": "assistant", "content": None, "tool_calls": []},
    ],
    ids=["not-assistant", "not-a-list", "empty-without-content"],
)
def test_malformed_tool_calls_raise_value_error(tok: Tokenizer, message: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        tok.render_chat([message])


def test_template_errors_become_value_errors(tok: Tokenizer) -> None:
    strict = Tokenizer(tok.hf)
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}x"
    original = tok.hf.chat_template
    tok.hf.chat_template = template
    try:
        with pytest.raises(ValueError, match="first message must be user"):
            strict.render_chat([{"role": "system", "content": "hi"}])
    finally:
        tok.hf.chat_template = original


def test_cache_is_published_once_and_reused(tok: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A finished cache folder is loaded without converting; a lost publish race is not an error."""
    gguf_path = Path(tokenizer_module.__file__)  # any file: the fake conversion copies the real tokenizer
    calls: list[Path] = []

    def fake_convert(path: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        tok.hf.save_pretrained(str(out_dir))
        (out_dir / tokenizer_module._META_FILE).write_text('{"format": 1, "stop_token_ids": [2, 7]}')

    monkeypatch.setattr(tokenizer_module, "_convert", fake_convert)
    first = Tokenizer.from_gguf(gguf_path, cache_dir=tmp_path)
    second = Tokenizer.from_gguf(gguf_path, cache_dir=tmp_path)
    assert len(calls) == 1
    assert first.stop_token_ids == second.stop_token_ids == {2, 7}
    published = [p for p in tmp_path.iterdir()]
    assert len(published) == 1 and not published[0].name.startswith(".")
    # A second process that converted concurrently finds the folder already published.
    tokenizer_module._convert_into_cache(gguf_path, published[0])
    assert [p.name for p in tmp_path.iterdir()] == [published[0].name]
    assert second.encode("Hello world") == tok.encode("Hello world")


def test_hf_folder_stop_ids_include_generation_config(tok: Tokenizer, tmp_path: Path) -> None:
    tok.hf.save_pretrained(str(tmp_path))
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    folder_tok = Tokenizer.from_folder(tmp_path)
    assert folder_tok.stop_token_ids == {0, 2}
    assert folder_tok.apply_chat_template(CHAT) == tok.apply_chat_template(CHAT)


def test_folder_without_tokenizer_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        Tokenizer.from_folder(tmp_path)


def test_a_gemma_gguf_stops_at_end_of_turn_as_llama_cpp_does(tmp_path: Path) -> None:
    """A SentencePiece vocabulary as Gemma's GGUFs carry it: eos is <eos>, and <end_of_turn> (which closes every chat
    turn) is in no metadata key; llama.cpp finds it by its text, and so does the tokenizer."""
    import numpy as np
    from gguf import GGUFWriter

    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "▁", "▁hello", "h", "e", "l", "o"]
    path = tmp_path / "gemma.gguf"
    writer = GGUFWriter(str(path), "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 6 + [-1.0, -2.0] + [-5.0] * 4)
    writer.add_token_types([3, 3, 3, 2, 3, 3] + [1] * 6)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_pad_token_id(0)
    writer.add_unk_token_id(3)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tok = load_tokenizer(str(path), cache_dir=tmp_path / "cache")
    assert tok.stop_token_ids == {1, 5}
    assert tok.decode(tok.encode("hello")) == "hello"

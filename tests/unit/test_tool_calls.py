"""Tool calls and reasoning read out of model text, whole and streamed one character at a time: the streamed
deltas assemble to the calls and content the whole text gives."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from splitserve.engine.sampling_params import StructuredKind
from splitserve.worker.reasoning import ReasoningSplitter
from splitserve.worker.tools import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ToolChoice,
    ToolPlan,
    ToolStream,
    parser_for_template,
    plan_tools,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time"}}
NAMES = frozenset({"get_weather", "get_time"})

AUTO_CASES = [
    (HermesParser(), 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
     "</tool_call>", "Let me check.", [("get_weather", {"city": "Paris"})]),
    (HermesParser(), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n<tool_call>\n'
     '{"name": "get_time", "arguments": {}}\n</tool_call>', None,
     [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    (HermesParser(), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}', None,
     [("get_weather", {"city": "Rome"})]),  # cut off by the end of the output before </tool_call>
    (HermesParser(), "No call here, 1 < 2.", "No call here, 1 < 2.", []),
    (HermesParser(), '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', []),
    (Llama3JsonParser(), '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", {"city": "Paris"})]),
    (Llama3JsonParser(), '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "X"}}',
     None, [("get_time", {}), ("get_weather", {"city": "X"})]),
    (Llama3JsonParser(), 'It is {"not": "a call"}', 'It is {"not": "a call"}', []),
    (MistralParser(), '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', None,
     [("get_weather", {"city": "Paris"})]),
    (MistralParser(), '[{"name": "get_time", "arguments": {}}]', None, [("get_time", {})]),  # the marker dropped
]  # fmt: skip


def calls_of(plan: ToolPlan, text: str) -> tuple[str | None, list[tuple[str, Any]]]:
    content, calls = plan.extract(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def streamed(plan: ToolPlan, text: str) -> tuple[str | None, list[tuple[str, Any]]]:
    """Feed ``text`` a character at a time; assemble the deltas as a client does."""
    stream = ToolStream(plan)
    content = ""
    assembled: dict[int, dict[str, Any]] = {}
    parts = [stream.feed(ch) for ch in text]
    parts.append(stream.finish())
    for piece, deltas in parts:
        content += piece
        for delta in deltas:
            call = assembled.setdefault(delta["index"], {"name": "", "arguments": ""})
            call["name"] += delta["function"].get("name", "")
            call["arguments"] += delta["function"].get("arguments", "")
            if "id" in delta:
                assert delta["type"] == "function" and delta["id"].startswith("chatcmpl-tool-")
    calls = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(assembled.items())]
    return content.strip() or None, calls


@pytest.mark.parametrize(("parser", "text", "content", "calls"), AUTO_CASES)
def test_each_parser_reads_its_format_whole_and_streamed(parser: Any, text: str, content: Any, calls: Any) -> None:
    plan = ToolPlan(ToolChoice.AUTO, NAMES, parser)
    assert calls_of(plan, text) == (content, calls)
    got_content, got_calls = streamed(plan, text)
    assert got_calls == calls
    assert got_content == (content.strip() if content else None)


def test_required_and_named_choices_are_grammars_and_read_back() -> None:
    plan, spec = plan_tools([WEATHER, TIME], "required", False, None, None)
    assert plan is not None and spec is not None and spec.kind == StructuredKind.JSON
    schema = json.loads(spec.spec)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1  # parallel_tool_calls false: one call
    assert [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    assert calls_of(plan, text) == (None, [("get_weather", {"city": "Paris"})])
    assert streamed(plan, text) == (None, [("get_weather", {"city": "Paris"})])
    named, spec = plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None, None, None)
    assert named is not None and spec is not None and json.loads(spec.spec) == WEATHER["function"]["parameters"]
    assert calls_of(named, '{"city": "Oslo"}') == (None, [("get_weather", {"city": "Oslo"})])
    assert streamed(named, '{"city": "Oslo"}') == (None, [("get_weather", {"city": "Oslo"})])
    assert named.finish_reason("stop", named.extract('{"city": "Oslo"}')[1]) == "stop"  # as vLLM, for a named one
    assert plan.finish_reason("stop", plan.extract(text)[1]) == "tool_calls"


@pytest.mark.parametrize(
    ("tools", "choice", "parser", "template", "message"),
    [
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, None, None, "tool_choice: the named function"),
        ([WEATHER], "sometimes", None, None, "tool_choice: must be"),
        ([{"type": "retrieval"}], "auto", None, None, "tools: tools[0]"),
        ([WEATHER], "auto", None, "{{ messages }}", "tool_choice: this model's chat template shows no tool-call"),
        (None, "required", None, None, "tool_choice: a named or required"),
    ],
)  # fmt: skip
def test_a_plan_that_cannot_work_names_the_field(
    tools: Any, choice: Any, parser: Any, template: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        plan_tools(tools, choice, None, parser, template)


def test_the_parser_follows_the_chat_templates_markers() -> None:
    assert isinstance(parser_for_template("... <tool_call> ..."), HermesParser)
    assert isinstance(parser_for_template("... [TOOL_CALLS] ..."), MistralParser)
    assert isinstance(parser_for_template("... <|python_tag|> ..."), Llama3JsonParser)
    assert parser_for_template("{{ messages }}") is None
    assert plan_tools([WEATHER], "none", None, None, None) == (None, None)


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text", ["<think>\nHmm.\n</think>\n\nParis.", "Hmm.</think>Paris.", "Paris.", "<think>cut"])
def test_reasoning_splits_the_same_whole_and_streamed(parser: str, text: str) -> None:
    whole = ReasoningSplitter(parser).split(text)
    splitter = ReasoningSplitter(parser)
    parts = [splitter.feed(ch) for ch in text] + [splitter.feed("", final=True)]
    assert ("".join(r for r, _ in parts) or None, "".join(c for _, c in parts) or None) == whole
    if text.startswith("<think>\nHmm."):
        assert whole == ("\nHmm.\n", "Paris.")
    if text == "Paris.":
        assert whole == (("Paris.", None) if parser == "deepseek_r1" else (None, "Paris."))


def _call_deltas(parts: list[tuple[str, list[dict[str, Any]]]]) -> list[Any]:
    """A stream's content and call deltas, the calls' random ids left out."""
    return [(piece, [{k: v for k, v in d.items() if k != "id"} for d in deltas]) for piece, deltas in parts]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), AUTO_CASES)
def test_a_stream_that_took_its_text_at_once_goes_on_as_one_fed_piece_by_piece(
    parser: Any, text: str, content: Any, calls: Any
) -> None:
    """A resumed stream's reader takes the text its client has in one piece: from there, it sends what the
    original reader, fed a character at a time, would have (the next call's index, the rest of the content)."""
    plan = ToolPlan(ToolChoice.AUTO, NAMES, parser)
    for cut in range(len(text) + 1):
        original, resumed = ToolStream(plan), ToolStream(plan)
        for ch in text[:cut]:
            original.feed(ch)
        resumed.feed(text[:cut])
        goes_on = [[s.feed(ch) for ch in text[cut:]] + [s.finish()] for s in (original, resumed)]
        assert _call_deltas(goes_on[0]) == _call_deltas(goes_on[1]), cut


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_a_reasoning_split_that_took_its_text_at_once_goes_on_the_same(parser: str) -> None:
    text = "<think>\nHmm, <b>no</b>.\n</think>\n\nParis."
    for cut in range(len(text) + 1):
        original, resumed = ReasoningSplitter(parser), ReasoningSplitter(parser)
        for ch in text[:cut]:
            original.feed(ch)
        resumed.feed(text[:cut])
        goes_on = [[s.feed(ch) for ch in text[cut:]] + [s.feed("", final=True)] for s in (original, resumed)]
        assert goes_on[0] == goes_on[1], cut

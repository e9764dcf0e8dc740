"""Tool calling: what a request's ``tools`` and ``tool_choice`` make of its output, whole and streamed.

- ``auto``: the model writes calls in its own format, and a parser reads them back: ``hermes`` (``<tool_call>``
  JSON ``</tool_call>``: Qwen, Hermes, ChatML with ``examples/chat_templates/chatml_tools.jinja``),
  ``llama3_json`` (a JSON object with ``name`` and ``parameters``, after an optional ``<|python_tag|>``) or
  ``mistral`` (``[TOOL_CALLS]`` and a JSON list). ``--tool-call-parser`` names it; else the chat template's own
  markers choose it.
- ``required`` and a named function: a grammar makes the output a call, as vLLM does: a JSON list of
  ``{"name", "parameters"}`` objects (one of the tools each), or the named function's arguments.
- ``none``: the model reads the tools and calls nothing.

Streamed, a call goes out as deltas the way vLLM sends them: the call's ``id``, ``type`` and ``name`` first,
then its ``arguments``. Text that may start a call is held back until it is one, or is not.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from splitserve.engine.sampling_params import StructuredKind, StructuredOutput
from splitserve.worker.reasoning import partial_suffix


class ToolChoice(StrEnum):
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def as_api(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_from(obj: Any, names: frozenset[str]) -> ToolCall | None:
    """A call from a parsed ``{"name", "arguments" | "parameters"}`` object naming one of ``names``."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(str(obj["name"]), json.dumps(arguments, ensure_ascii=False))


class ToolParser:
    """Reads calls out of a model's text; ``markers``: the strings a call may start with."""

    name = ""
    markers: tuple[str, ...] = ()

    def extract(self, text: str, names: frozenset[str]) -> tuple[str | None, list[ToolCall]]:
        """(the content before the calls, or None when there is none; the calls). No call: the text is content."""
        raise NotImplementedError

    def call_start(self, text: str, at_start: bool) -> int | None:
        """Where a call (or the start of one) begins in ``text``; None when nothing in it can be one.
        ``at_start``: ``text`` begins the output."""
        found = [i for marker in self.markers if (i := text.find(marker)) >= 0]
        if found:
            return min(found)
        for marker in self.markers:  # a marker cut by the end of the text so far
            if size := partial_suffix(text, marker):
                return len(text) - size
        return None


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str, names: frozenset[str]) -> tuple[str | None, list[ToolCall]]:
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        calls = []
        for body in self._CALL.findall(text[start:]):
            try:
                call = call_from(json.loads(body), names)
            except ValueError:
                call = None
            if call is not None:
                calls.append(call)
        if not calls:
            return text, []
        content = text[:start].strip()
        return content or None, calls


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>", "{")

    def call_start(self, text: str, at_start: bool) -> int | None:
        stripped = text.lstrip()
        if not at_start:  # a call is the whole output
            return None
        if not stripped or "<|python_tag|>".startswith(stripped[:14]) or stripped.startswith(("{", "<|python_tag|>")):
            return len(text) - len(stripped)
        return None

    def extract(self, text: str, names: frozenset[str]) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        calls = _json_objects(body, names, separators=";")
        return (None, calls) if calls else (text, [])


class MistralParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)

    def call_start(self, text: str, at_start: bool) -> int | None:
        start = super().call_start(text, at_start)
        stripped = text.lstrip()
        if start is None and at_start and (not stripped or stripped.startswith("[")):  # a dropped special marker
            return len(text) - len(stripped)
        return start

    def extract(self, text: str, names: frozenset[str]) -> tuple[str | None, list[ToolCall]]:
        start = text.find("[TOOL_CALLS]")
        body = text[start + len("[TOOL_CALLS]") :] if start >= 0 else text.lstrip()
        try:
            parsed = json.loads(body.strip())
        except ValueError:
            return text, []
        items = parsed if isinstance(parsed, list) else [parsed]
        calls = [c for item in items if (c := call_from(item, names)) is not None]
        if not calls:
            return text, []
        content = text[:start].strip() if start >= 0 else ""
        return content or None, calls


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def parser_for_template(template: str | None) -> ToolParser | None:
    """The parser whose format a chat template writes, from its markers; None when it shows none."""
    if not template:
        return None
    if "<tool_call>" in template:
        return HermesParser()
    if "[TOOL_CALLS]" in template:
        return MistralParser()
    if "<|python_tag|>" in template or "ipython" in template:
        return Llama3JsonParser()
    return None


def _json_objects(body: str, names: frozenset[str], separators: str = "") -> list[ToolCall]:
    decoder = json.JSONDecoder()
    calls = []
    index = 0
    while index < len(body):
        while index < len(body) and (body[index].isspace() or body[index] in separators):
            index += 1
        if index >= len(body):
            break
        try:
            obj, index = decoder.raw_decode(body, index)
        except ValueError:
            return []
        call = call_from(obj, names)
        if call is None:
            return []
        calls.append(call)
    return calls


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one request's output becomes tool calls."""

    choice: ToolChoice
    names: frozenset[str]
    parser: ToolParser | None = None  # auto
    function: str | None = None  # named
    parallel: bool = True

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole output as (content, calls)."""
        if self.choice == ToolChoice.NAMED:
            assert self.function is not None
            try:
                arguments = json.loads(text)
            except ValueError:
                return text, []
            return None, [ToolCall(self.function, json.dumps(arguments, ensure_ascii=False))]
        if self.choice == ToolChoice.REQUIRED:
            try:
                items = json.loads(text)
            except ValueError:
                return text, []
            calls = [c for item in items if (c := call_from(item, self.names)) is not None]
            return (None, calls) if calls else (text, [])
        assert self.parser is not None
        content, calls = self.parser.extract(text, self.names)
        return content, calls if self.parallel else calls[:1]

    def finish_reason(self, reason: str | None, calls: list[ToolCall]) -> str | None:
        """``tool_calls`` when the model called (vLLM keeps ``stop`` for a named function)."""
        if calls and reason == "stop" and self.choice != ToolChoice.NAMED:
            return "tool_calls"
        return reason


def plan_tools(
    tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None, parallel: bool | None,
    parser_name: str | None, template: str | None,
) -> tuple[ToolPlan | None, StructuredOutput | None]:  # fmt: skip
    """The request's plan and the grammar it needs (required and named); ``ValueError`` as "param: message"."""
    if not tools or tool_choice == "none":
        if isinstance(tool_choice, dict) or tool_choice == "required":
            raise ValueError("tool_choice: a named or required tool_choice needs 'tools'")
        return None, None
    functions = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type") != "function" or not isinstance(function, dict) or not function.get("name"):
            raise ValueError(f"tools: tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise ValueError(f"tools: tools[{i}].function.parameters must be a JSON schema object")
        functions[str(function["name"])] = parameters
    names = frozenset(functions)
    parallel = parallel is not False
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        if name not in functions:
            raise ValueError(f"tool_choice: the named function {name!r} is not among the tools")
        spec = StructuredOutput(StructuredKind.JSON, json.dumps(functions[name]))
        return ToolPlan(ToolChoice.NAMED, names, function=name), spec
    if tool_choice == "required":
        items = {"anyOf": [
            {"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
             "required": ["name", "parameters"], "additionalProperties": False}
            for name, schema in functions.items()
        ]}  # fmt: skip
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
        if not parallel:
            schema["maxItems"] = 1
        return ToolPlan(ToolChoice.REQUIRED, names, parallel=parallel), StructuredOutput(
            StructuredKind.JSON, json.dumps(schema)
        )
    if tool_choice not in (None, "auto"):
        raise ValueError(f"tool_choice: must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}")
    parser = PARSERS[parser_name]() if parser_name else parser_for_template(template)
    if parser is None:
        raise ValueError(
            "tool_choice: this model's chat template shows no tool-call format: start the worker with "
            "--tool-call-parser (hermes, llama3_json, mistral), or send tool_choice 'none'"
        )
    return ToolPlan(ToolChoice.AUTO, names, parser, parallel=parallel), None


@dataclass(slots=True)
class ToolStream:
    """One streamed choice's text as content deltas and tool-call deltas."""

    plan: ToolPlan
    text: str = ""
    sent: int = 0  # characters of ``text`` sent as content
    held_from: int | None = None  # where a (possible) call starts: held back from there
    calls: list[ToolCall] = field(default_factory=list)  # sent so far

    def feed(self, new_text: str) -> tuple[str, list[dict[str, Any]]]:
        """The content to send now, and the tool-call deltas."""
        self.text += new_text
        if self.plan.choice == ToolChoice.NAMED:
            deltas = []
            if not self.calls:
                assert self.plan.function is not None
                self.calls.append(ToolCall(self.plan.function, ""))
                deltas.append(_head_delta(0, self.calls[0]))
            if new_text:
                deltas.append({"index": 0, "function": {"arguments": new_text}})
            return "", deltas
        if self.plan.choice == ToolChoice.REQUIRED:
            return "", []  # the list is read whole at the end
        parser = self.plan.parser
        assert parser is not None
        if self.held_from is not None and parser.call_start(self.text[self.held_from :], self.held_from == 0) != 0:
            self.held_from = None  # what looked like the start of a call is not one
        if self.held_from is None:
            start = parser.call_start(self.text[self.sent :], self.sent == 0)
            if start is not None:
                self.held_from = self.sent + start
        end = self.held_from if self.held_from is not None else len(self.text)
        content = self.text[self.sent : end]
        self.sent = end
        if self.held_from is not None and isinstance(parser, HermesParser):  # each call as it closes
            return content, self._new_calls(closed_only=True)
        return content, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left at the end: held text that was no call goes out as content."""
        if self.plan.choice == ToolChoice.NAMED:
            return "", [] if self.calls else self.feed("")[1]
        deltas = self._new_calls(closed_only=False)
        if not self.calls:
            content = self.text[self.sent :]
            self.sent = len(self.text)
            return content, []
        return "", deltas

    def _new_calls(self, closed_only: bool) -> list[dict[str, Any]]:
        held = self.text[self.held_from or 0 :] if self.plan.choice == ToolChoice.AUTO else self.text
        if closed_only:
            held = held[: held.rfind("</tool_call>") + len("</tool_call>")] if "</tool_call>" in held else ""
        if not held:
            return []
        _, calls = self.plan.extract(held)
        deltas = []
        for index in range(len(self.calls), len(calls)):
            call = calls[index]
            self.calls.append(call)
            deltas.append(_head_delta(index, call))
            deltas.append({"index": index, "function": {"arguments": call.arguments}})
        return deltas


def _head_delta(index: int, call: ToolCall) -> dict[str, Any]:
    return {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}

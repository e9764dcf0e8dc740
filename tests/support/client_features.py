"""The official ``openai`` client's structured-output and tool-calling flows, for the end-to-end tests that run
them against a worker, a router or a disaggregated pair (which need ``--chat-template`` with tools:
``TOOLS_TEMPLATE_ARGS``)."""

from __future__ import annotations

import json
from typing import Any, Literal

import openai
import pydantic

MODEL = "smollm2"
TOOLS_TEMPLATE_ARGS = ["--chat-template", "examples/chat_templates/chatml_tools.jinja"]
WEATHER_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                       "required": ["city"], "additionalProperties": False},
    },
}  # fmt: skip


class Pet(pydantic.BaseModel):
    kind: str = pydantic.Field(max_length=16)
    name: str = pydantic.Field(max_length=24)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=40)
    age: int
    city: Literal["Paris", "Rome", "Oslo", "Lima"]
    pets: list[Pet] = pydantic.Field(max_length=3)


def parse_person(client: openai.OpenAI, question: str, **extra: Any) -> Person:
    """``chat.completions.parse`` with a pydantic model: the SDK sends its strict schema and parses the answer."""
    reply = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": question}], response_format=Person, max_tokens=200,
        **extra,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice
    assert choice.message.parsed is not None, choice.message.content
    return choice.message.parsed


def tool_round_trip(client: openai.OpenAI, question: str) -> tuple[dict[str, Any], str]:
    """The model must call the tool; its result goes back; the final answer comes. Returns the call (name and
    parsed arguments) and the final answer's text."""
    messages: list[Any] = [{"role": "user", "content": question}]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False,
        temperature=0, max_tokens=60,
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id
    arguments = json.loads(call.function.arguments)
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]  # fmt: skip
    final = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], temperature=0, max_tokens=40
    )
    assert final.choices[0].finish_reason in ("stop", "length")
    return {"name": call.function.name, "arguments": arguments}, final.choices[0].message.content or ""


def streamed_tool_calls(client: openai.OpenAI, question: str, **extra: Any) -> tuple[list[dict[str, Any]], str | None]:
    """A required tool call streamed: the deltas assembled as a client does; and the finish reason."""
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], tools=[WEATHER_TOOL], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=60, stream=True, **extra,
    )  # fmt: skip
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": delta.id, "name": "", "arguments": ""})
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return [{"name": c["name"], "arguments": json.loads(c["arguments"])} for _, c in sorted(calls.items())], finish

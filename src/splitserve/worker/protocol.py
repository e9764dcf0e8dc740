"""OpenAI-compatible request models (pydantic v2) for the worker's HTTP API, and the answers of its own routes
(models, tokenize, KV lookup); completions and chat completions answer with ``splitserve.protocol.openai``.

Requests accept every field the official ``openai`` client sends for completions and chat completions, plus
vLLM's extras (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output``, ``prompt_logprobs``, ``cache_salt``) and ``kv_transfer_params`` (disaggregated
prefill/decode), and a chat request's ``resume_from`` (a migrated stream, :class:`ResumeFrom`). Unknown fields are
a validation error naming the field. Fields that are accepted but unsupported with a non-default value
(``suffix``, other modalities, ...) are refused by ``unsupported_reason()`` with a message the server returns as a
400. Tool-call messages (``tool_calls``, ``tool_call_id``, ``name``) reach the chat template, which must render
them (else a 400, never a silent drop).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from splitserve.engine.sampling_params import StructuredKind, StructuredOutput
from splitserve.keys import MAX_CACHE_SALT_CHARS


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    """A nested object whose extra keys we tolerate (forward compatibility with new client versions)."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JSONSchemaFormat(_Open):
    """``response_format.json_schema``: the schema the output follows (``strict`` is accepted: the grammar makes
    every output follow the schema anyway)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Open):
    type: str = "text"
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsParams(_Strict):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingFields(_Strict):
    """Fields shared by both request kinds, with the defaults OpenAI documents."""

    model: str | None = None
    max_tokens: Annotated[int, Field(strict=True)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    repetition_penalty: float | None = None
    skip_special_tokens: bool = True
    return_token_ids: bool | None = False  # vLLM's: token ids beside the text (a router's stream migration uses them)
    cache_salt: CacheSalt | None = None  # vLLM's: cached prefixes are shared only among requests with the same salt
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and this many most likely tokens'
    structured_outputs: StructuredOutputsParams | None = None  # vLLM's; and its older guided_* fields:
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # disaggregated prefill/decode: the router's signed transfer instructions (a worker with a secret checks them)
    kv_transfer_params: dict[str, Any] | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def structured_output(self) -> tuple[str, StructuredOutput] | None:
        """The one constraint on the output and the field that set it, or None; ``ValueError`` naming the
        field when two are given or one is malformed (a schema that is not JSON, an empty choice list)."""
        given: list[tuple[str, StructuredKind, Any]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            given.append(("response_format", StructuredKind.JSON_OBJECT, None))
        elif fmt is not None and fmt.type == "json_schema":
            schema = fmt.json_schema.json_schema if fmt.json_schema is not None else None
            given.append(("response_format", StructuredKind.JSON if schema is not None else StructuredKind.JSON_OBJECT,
                          schema))  # fmt: skip
        so = self.structured_outputs
        if so is not None:
            for kind, value in ((StructuredKind.JSON, so.json_), (StructuredKind.REGEX, so.regex),
                                (StructuredKind.CHOICE, so.choice), (StructuredKind.GRAMMAR, so.grammar)):  # fmt: skip
                if value is not None:
                    given.append(("structured_outputs", kind, value))
            if so.json_object:
                given.append(("structured_outputs", StructuredKind.JSON_OBJECT, None))
        for name, kind, value in (("guided_json", StructuredKind.JSON, self.guided_json),
                                  ("guided_regex", StructuredKind.REGEX, self.guided_regex),
                                  ("guided_choice", StructuredKind.CHOICE, self.guided_choice),
                                  ("guided_grammar", StructuredKind.GRAMMAR, self.guided_grammar)):  # fmt: skip
            if value is not None:
                given.append((name, kind, value))
        if not given:
            return None
        if len(given) > 1:
            raise ValueError(f"{given[1][0]}: give one constraint on the output, got {len(given)}")
        name, kind, value = given[0]
        return name, StructuredOutput(kind, _spec_text(name, kind, value))

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats``: usage on every chunk (only together with ``include_usage``)."""
        return self.include_usage() and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def unsupported_reason(self) -> tuple[str, str] | None:
        """``(param, message)`` for the first field set to a value we do not support, else None."""
        checks: list[tuple[bool, str, str]] = [
            (not self.skip_special_tokens, "skip_special_tokens", "skip_special_tokens=false is not supported"),
            (
                self.stream_options is not None and not self.stream,
                "stream_options",
                "Stream options can only be defined when `stream=True`.",
            ),
            (
                self.response_format is not None
                and self.response_format.type not in ("text", "json_object", "json_schema"),
                "response_format",
                "response_format type must be 'text', 'json_object' or 'json_schema'",
            ),
        ]
        for failed, param, message in checks:
            if failed:
                return param, message
        return None


def _spec_text(name: str, kind: StructuredKind, value: Any) -> str:
    """A constraint's text: a schema or choice list as compact JSON (keys in the client's order), else as given."""
    if kind == StructuredKind.JSON_OBJECT:
        return ""
    if kind == StructuredKind.JSON:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"{name}: the schema is not JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise ValueError(f"{name}: the schema must be a JSON object")
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    if kind == StructuredKind.CHOICE:
        if not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError(f"{name}: choice must be a non-empty list of non-empty strings")
        return json.dumps(value, ensure_ascii=False)
    if not value:
        raise ValueError(f"{name}: the {kind} is empty")
    return str(value)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def unsupported_reason(self) -> tuple[str, str] | None:
        if (reason := super().unsupported_reason()) is not None:
            return reason
        if self.suffix:
            return "suffix", "suffix is not supported"
        prompt = self.prompt
        if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], str | list):
            return "prompt", "batched prompts are not supported: send one prompt per request"
        return None


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant: the calls it made (the template must render them)
    tool_call_id: str | None = None  # tool: the call this message answers

    def as_dict(self) -> dict[str, Any]:
        """What the chat template sees: role, content as text, and the tool fields that are set."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        fields = {"name": self.name, "tool_call_id": self.tool_call_id, "tool_calls": self.tool_calls}
        message.update({key: value for key, value in fields.items() if value is not None})
        return message

    def text(self) -> str:
        """The content as one string; text parts are joined with newlines, as vLLM does."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ResumeFrom(_Strict):
    """splitserve's extension of a chat request: a stream the router resumes here after its worker failed
    (``router/migrate.py``). The prompt is these ids, not the messages' template, and the answer goes on after
    ``output_token_ids``: its text, reasoning and tool calls continue exactly where the original stream's would
    have (the detokenizer and the readers replay those tokens first); the grammar, penalties and seeded draws go on
    from them too."""

    prompt_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    output_token_ids: list[Annotated[int, Field(ge=0)]]


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(strict=True)] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    modalities: list[str] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    resume_from: ResumeFrom | None = None

    def unsupported_reason(self) -> tuple[str, str] | None:
        if (reason := super().unsupported_reason()) is not None:
            return reason
        if self.modalities not in (None, ["text"]):
            return "modalities", "only the text modality is supported"
        if self.chat_template_kwargs:
            return "chat_template_kwargs", "chat_template_kwargs are not supported"
        return None

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (the current OpenAI name) wins over the deprecated ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.as_dict() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template renders (with ``tool_choice`` 'none' too: the model reads them, calls
        nothing)."""
        return self.tools or None


class KVLookupRequest(_Strict):
    """``POST /kv/lookup``: exactly one of ``prompt`` (text or token ids), ``token_ids`` or ``messages``."""

    model: str | None = None
    prompt: str | list[int] | None = None
    token_ids: list[int] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: bool = True
    cache_salt: CacheSalt | None = None

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.as_dict() for m in self.messages or []]


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's): one of ``prompt`` or ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True  # accepted; the prompt is encoded as /v1/completions encodes it
    return_token_strs: bool | None = False  # vLLM's: the vocabulary strings of the ids, beside them
    tools: list[dict[str, Any]] | None = None  # messages: tool definitions for the template, as in chat

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.as_dict() for m in self.messages or []]


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM's)."""

    model: str | None = None
    tokens: list[int]


# ---- answers of the worker's own routes ----------------------------------------------------------------


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class KVLookupResponse(BaseModel):
    """Tokens of the prompt a request would not compute, by where they would come from."""

    num_tokens: int
    num_matched_tokens: int
    matched_tokens: dict[str, int]  # engine (prefix cache), l1, l2


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "splitserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]

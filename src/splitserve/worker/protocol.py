"""OpenAI-compatible request models (pydantic v2) for the worker's HTTP API, and the answers of its own routes
(models, tokenize, KV lookup); completions and chat completions answer with ``splitserve.protocol.openai``.

Requests accept every field the official ``openai`` client sends for completions and chat completions, plus
vLLM's extras (``top_k``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output``, ``cache_salt``) and ``kv_transfer_params`` (disaggregated prefill/decode).
Unknown fields are a validation error naming the field. Fields that are accepted but unsupported with a
non-default value (``n`` > 1, logprobs, echo, penalties, JSON response formats, tool calling, ...) are refused
by ``unsupported_reason()`` with a message the server returns as a 400. Tool-call messages (``tool_calls``,
``tool_call_id``, ``name``) reach the chat template, which must render them (else a 400, never a silent drop).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

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


class ResponseFormat(_Open):
    type: str = "text"


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
    # disaggregated prefill/decode: the router's signed transfer instructions (a worker with a secret checks them)
    kv_transfer_params: dict[str, Any] | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats``: usage on every chunk (only together with ``include_usage``)."""
        return self.include_usage() and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def unsupported_reason(self) -> tuple[str, str] | None:
        """``(param, message)`` for the first field set to a value we do not support, else None."""
        checks: list[tuple[bool, str, str]] = [
            (self.n not in (None, 1), "n", "only n=1 is supported"),
            (bool(self.presence_penalty), "presence_penalty", "presence_penalty is not supported (use 0)"),
            (bool(self.frequency_penalty), "frequency_penalty", "frequency_penalty is not supported (use 0)"),
            (self.repetition_penalty not in (None, 1.0), "repetition_penalty", "repetition_penalty is not supported"),
            (bool(self.logit_bias), "logit_bias", "logit_bias is not supported"),
            (self.min_p not in (None, 0.0), "min_p", "min_p is not supported"),
            (not self.skip_special_tokens, "skip_special_tokens", "skip_special_tokens=false is not supported"),
            (
                self.stream_options is not None and not self.stream,
                "stream_options",
                "Stream options can only be defined when `stream=True`.",
            ),
            (
                self.response_format is not None and self.response_format.type != "text",
                "response_format",
                "only response_format type 'text' is supported",
            ),
        ]
        for failed, param, message in checks:
            if failed:
                return param, message
        return None


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
        if self.echo:
            return "echo", "echo is not supported"
        if self.logprobs is not None:
            return "logprobs", "logprobs are not supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.best_of not in (None, 1):
            return "best_of", "only best_of=1 is supported"
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

    def unsupported_reason(self) -> tuple[str, str] | None:
        if (reason := super().unsupported_reason()) is not None:
            return reason
        if self.logprobs or self.top_logprobs:
            return "logprobs", "logprobs are not supported"
        if self.tools and self.tool_choice != "none":
            return "tool_choice", (
                "tool calling needs a tool-call parser, which splitserve does not have: send tool_choice 'none' to "
                "give the model the tools as text (its chat template must render them), or leave out 'tools'"
            )
        if self.tool_choice not in (None, "none", "auto"):
            return "tool_choice", "a named or required tool_choice needs 'tools' and a tool-call parser"
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
        """The tools the chat template renders (``tool_choice`` 'none': the model reads them, calls nothing)."""
        return self.tools if self.tools and self.tool_choice == "none" else None


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

"""OpenAI's completion and chat completion answers, whole and streamed: their shapes, one builder each, and their
SSE bytes. The worker answers with them; the router builds the chunks it writes itself with them (a
disaggregated stream's first token, a resumed stream's chunks); the benchmark client reads chunks with them.
Torch-free and pydantic-free, so the router stays light.

Each builder writes its keys in the order clients have always received them, and leaves out the keys OpenAI
leaves out when unset (``NotRequired`` below), so the bytes on the wire do not depend on who built a chunk.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal, NotRequired, TypedDict

from splitserve.protocol.errors import error_body

CHAT_CHUNK = "chat.completion.chunk"
COMPLETION_CHUNK = "text_completion"  # a completion's object, whole or streamed

FinishReason = str | None
StopReason = int | str | None


class PromptTokensDetails(TypedDict):
    cached_tokens: int  # prompt tokens not computed: engine prefix cache, L1, L2 or pushed by a prefill worker


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: NotRequired[PromptTokensDetails]


def usage(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int | None = None) -> Usage:
    """Token counts; ``prompt_tokens_details`` only when the cached tokens are known."""
    counts: Usage = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output_tokens,
                     "total_tokens": num_prompt_tokens + num_output_tokens}  # fmt: skip
    if num_cached_tokens is not None:
        counts["prompt_tokens_details"] = {"cached_tokens": num_cached_tokens}
    return counts


# ---- log-probabilities ----------------------------------------------------------------------------------------


class TopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]  # the token's text as UTF-8


class ChatTokenLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]  # the most likely tokens at this position, most likely first


class ChatLogprobs(TypedDict):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(TypedDict):
    """The legacy shape: parallel lists; ``top_logprobs`` maps the most likely tokens' text (and the chosen
    one's) to their logprobs; an echoed prompt's first token has None for both."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]  # where each token's text starts in the choice's text (streamed: in the whole text)


class PromptLogprob(TypedDict):
    """vLLM's ``prompt_logprobs`` entry for one token id (the prompt's own token and the most likely ones)."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # one per prompt token, None for the first


# ---- completions: /v1/completions answers the same object whole and streamed ---------------------------------


class CompletionChoice(TypedDict):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason
    stop_reason: StopReason
    prompt_logprobs: NotRequired[PromptLogprobs]  # vLLM's, when asked
    # return_token_ids: the prompt's (first chunk only, when streaming) and the output's, as vLLM puts them
    prompt_token_ids: NotRequired[list[int]]
    token_ids: NotRequired[list[int]]


class Completion(TypedDict):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: NotRequired[Usage | None]  # a chunk the router writes has none
    kv_transfer_params: NotRequired[dict[str, Any]]  # the prefill role's report of its push


def completion_choice(
    text: str,
    finish_reason: FinishReason = None,
    stop_reason: StopReason = None,
    *,
    prompt_token_ids: list[int] | None = None,
    token_ids: list[int] | None = None,
    index: int = 0,
    logprobs: CompletionLogprobs | None = None,
    prompt_logprobs: PromptLogprobs | None = None,
) -> CompletionChoice:
    choice: CompletionChoice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                                "stop_reason": stop_reason}  # fmt: skip
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def completion(
    id: str,
    created: int,
    model: str,
    choices: list[CompletionChoice],
    usage: Usage | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
) -> Completion:
    """A whole completion or one of its chunks (``choices`` empty: the usage chunk)."""
    answer: Completion = {"id": id, "object": "text_completion", "created": created, "model": model,
                          "choices": choices, "usage": usage}  # fmt: skip
    if kv_transfer_params is not None:
        answer["kv_transfer_params"] = kv_transfer_params
    return answer


# ---- chat completions -------------------------------------------------------------------------------------


class FunctionCall(TypedDict):
    name: str
    arguments: str  # JSON text


class ToolCall(TypedDict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(TypedDict):
    role: Literal["assistant"]
    content: str | None  # None when the answer is tool calls only
    reasoning_content: NotRequired[str | None]  # --reasoning-parser: the text up to </think>
    tool_calls: NotRequired[list[ToolCall]]


class ChatChoice(TypedDict):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason
    stop_reason: StopReason
    token_ids: NotRequired[list[int]]  # return_token_ids


class ChatCompletion(TypedDict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: NotRequired[list[int]]  # return_token_ids
    prompt_logprobs: NotRequired[PromptLogprobs]  # vLLM's, when asked
    kv_transfer_params: NotRequired[dict[str, Any]]  # the prefill role's report of its push


def chat_choice(
    content: str | None,
    finish_reason: FinishReason = None,
    stop_reason: StopReason = None,
    token_ids: list[int] | None = None,
    *,
    index: int = 0,
    logprobs: ChatLogprobs | None = None,
    tool_calls: list[ToolCall] | None = None,
    reasoning: str | None = None,
) -> ChatChoice:
    """``content`` None: tool calls only. ``reasoning``: set only with a reasoning parser."""
    message: AssistantMessage = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    choice: ChatChoice = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
                          "stop_reason": stop_reason}  # fmt: skip
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chat_completion(
    id: str,
    created: int,
    model: str,
    choices: list[ChatChoice],
    usage: Usage,
    *,
    prompt_token_ids: list[int] | None = None,
    prompt_logprobs: PromptLogprobs | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
) -> ChatCompletion:
    answer: ChatCompletion = {"id": id, "object": "chat.completion", "created": created, "model": model,
                              "choices": choices, "usage": usage}  # fmt: skip
    if prompt_token_ids is not None:
        answer["prompt_token_ids"] = prompt_token_ids
    if prompt_logprobs is not None:
        answer["prompt_logprobs"] = prompt_logprobs
    if kv_transfer_params is not None:
        answer["kv_transfer_params"] = kv_transfer_params
    return answer


class ChatDelta(TypedDict, total=False):
    """A chat stream's delta; unset keys are left out, so a finishing chunk carries ``"delta": {}``."""

    role: Literal["assistant"]
    content: str
    reasoning_content: str  # --reasoning-parser
    tool_calls: list[dict[str, Any]]  # deltas: a call's index, id, type and name first, then its arguments


class ChatChunkChoice(TypedDict):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason
    token_ids: NotRequired[list[int]]  # return_token_ids


class ChatChunk(TypedDict):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: NotRequired[Usage | None]  # a chunk the router writes has none
    prompt_token_ids: NotRequired[list[int]]  # return_token_ids, on the first chunk


def chat_delta(text: str, finish_reason: FinishReason = None, *, role: bool = False) -> ChatDelta:
    """The delta carrying ``text`` (the assistant's ``role`` too on a stream's first): a finishing delta without
    text is empty."""
    delta: ChatDelta = {"role": "assistant"} if role else {}
    if text or finish_reason is None:
        delta["content"] = text
    return delta


def chat_chunk_choice(
    delta: ChatDelta,
    finish_reason: FinishReason = None,
    token_ids: list[int] | None = None,
    *,
    index: int = 0,
    logprobs: ChatLogprobs | None = None,
) -> ChatChunkChoice:
    choice: ChatChunkChoice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chat_chunk(
    id: str,
    created: int,
    model: str,
    choices: list[ChatChunkChoice],
    usage: Usage | None = None,
    prompt_token_ids: list[int] | None = None,
) -> ChatChunk:
    """One chunk of a chat stream (``choices`` empty: the usage chunk)."""
    chunk: ChatChunk = {"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": choices, "usage": usage}  # fmt: skip
    if prompt_token_ids is not None:
        chunk["prompt_token_ids"] = prompt_token_ids
    return chunk


# ---- what the router writes into a stream, and reads from answers ---------------------------------------------


def text_chunk(
    is_chat: bool,
    common: Mapping[str, Any],
    text: str,
    finish: str | None = None,
    *,
    token_ids: list[int] | None = None,
    stop_reason: Any = None,
    role: bool = False,
    index: int = 0,
) -> dict[str, Any]:
    """A chunk of choice ``index`` carrying ``text`` (a :class:`ChatChunk` or a :class:`Completion`, without
    usage): a chat delta (with the assistant's ``role`` on the first one) or a completion's text. ``common``: the
    stream's ``id``, ``created`` and ``model``, whose keys come first, as the router has always written them."""
    choice: ChatChunkChoice | CompletionChoice
    if is_chat:
        choice = chat_chunk_choice(chat_delta(text, finish, role=role), finish, token_ids, index=index)
    else:
        choice = completion_choice(text, finish, stop_reason, index=index, token_ids=token_ids)
    return {**common, "object": CHAT_CHUNK if is_chat else COMPLETION_CHUNK, "choices": [choice]}


def answer_text(is_chat: bool, answer: Mapping[str, Any]) -> str:
    """The text of the first choice of a whole (non-streamed) answer."""
    choice = (answer.get("choices") or [{}])[0]
    if is_chat:
        return str((choice.get("message") or {}).get("content") or "")
    return str(choice.get("text") or "")


def chunk_text(is_chat: bool, chunk: Mapping[str, Any]) -> str:
    """The text of the first choice of a streamed chunk; "" for a usage chunk, or one of another shape."""
    choices = chunk.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    return choice_text(is_chat, choice) if isinstance(choice, dict) else ""


def choice_text(is_chat: bool, choice: Mapping[str, Any]) -> str:
    """The text a streamed choice adds: a chat delta's content, or a completion choice's text."""
    if is_chat:
        delta = choice.get("delta")
        return str(delta.get("content") or "") if isinstance(delta, dict) else ""
    return str(choice.get("text") or "")


def sse_event(chunk: Mapping[str, Any]) -> bytes:
    """One SSE event: the chunk as compact JSON, non-ASCII characters as they are (as ``JSONResponse`` writes)."""
    return f"data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


def stream_error_end(message: str) -> bytes:
    """How a stream that cannot go on ends: an error event (OpenAI's error body, code 502), then ``[DONE]``."""
    return f"data: {json.dumps(error_body(message, 502, code=502))}\n\ndata: [DONE]\n\n".encode()

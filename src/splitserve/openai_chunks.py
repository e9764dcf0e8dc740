"""OpenAI's streaming chunks as plain dicts and SSE bytes, for the processes that build them outside the
worker's pydantic models (``server/protocol.py``): the router, when it rewrites a resumed stream or sends a
disaggregated stream's first token itself. Torch-free and pydantic-free, so the router stays light.
"""

from __future__ import annotations

import json
from typing import Any

from splitserve.protocol.errors import error_body

CHAT_CHUNK = "chat.completion.chunk"
COMPLETION_CHUNK = "text_completion"


def text_chunk(
    is_chat: bool,
    common: dict[str, Any],
    text: str,
    finish: str | None = None,
    *,
    token_ids: list[int] | None = None,
    stop_reason: Any = None,
    role: bool = False,
) -> dict[str, Any]:
    """A chunk of one choice carrying ``text``: a chat delta (with the assistant's ``role`` on the first one) or
    a completion's text. ``common``: the stream's ``id``, ``created`` and ``model``."""
    choice: dict[str, Any]
    if is_chat:
        delta = {"role": "assistant"} if role else {}
        if text or finish is None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return common | {"object": CHAT_CHUNK if is_chat else COMPLETION_CHUNK, "choices": [choice]}


def answer_text(is_chat: bool, answer: dict[str, Any]) -> str:
    """The text of the first choice of a whole (non-streamed) answer."""
    choice = (answer.get("choices") or [{}])[0]
    if is_chat:
        return str((choice.get("message") or {}).get("content") or "")
    return str(choice.get("text") or "")


def sse_event(chunk: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


def stream_error_end(message: str) -> bytes:
    """How a stream that cannot go on ends: an error event (OpenAI's error body, code 502), then ``[DONE]``."""
    return f"data: {json.dumps(error_body(message, 502, code=502))}\n\ndata: [DONE]\n\n".encode()

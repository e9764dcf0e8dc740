"""SageMaker's container contract, shared by the worker and the router: ``GET /ping`` answers like
``/health``, and ``POST /invocations`` serves a chat completion or a completion, chosen by the body's shape
(as vLLM's ``/invocations`` does: a body with ``messages`` is a chat, one with ``prompt`` a completion)."""

from __future__ import annotations

from typing import Any

INVOCATIONS_PATH = "/invocations"
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MISSING_SHAPE = "an /invocations body needs 'messages' (a chat completion) or 'prompt' (a completion)"


def openai_path(body: Any) -> str | None:
    """The OpenAI route an ``/invocations`` body is for, or None when its shape names neither."""
    if not isinstance(body, dict):
        return None
    if "messages" in body:
        return CHAT_PATH
    return COMPLETIONS_PATH if "prompt" in body else None

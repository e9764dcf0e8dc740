"""The prompt's token ids as a worker would compute them, for the cache-aware policies.

Same tokenizer and chat template as the workers (``splitserve.model.tokenizer``, no torch), same message
handling as the worker's ``/v1/chat/completions`` (text parts joined by newlines, tool fields passed on).
Anything the router cannot read gives None: the policy then falls back, and the worker answers the client's
mistake itself.
"""

from __future__ import annotations

from typing import Any

from splitserve.model.tokenizer import TokenizerLike


def prompt_token_ids(tokenizer: TokenizerLike, path: str, body: dict[str, Any]) -> list[int] | None:
    try:
        if path.endswith("/chat/completions"):
            return _chat_ids(tokenizer, body)
        return _completion_ids(tokenizer, body.get("prompt"))
    except (ValueError, TypeError, KeyError):
        return None


def _chat_ids(tokenizer: TokenizerLike, body: dict[str, Any]) -> list[int] | None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    dicts = [_message(m) for m in messages]
    tools = body.get("tools") if body.get("tool_choice") == "none" else None  # as the worker renders them
    return tokenizer.apply_chat_template(dicts, body.get("add_generation_prompt", True) is not False, tools)


def _message(message: dict[str, Any]) -> dict[str, Any]:
    out = {"role": message["role"], "content": _text(message.get("content"))}
    out.update({key: message[key] for key in ("name", "tool_call_id", "tool_calls") if message.get(key) is not None})
    return out


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part["text"] for part in content)


def _completion_ids(tokenizer: TokenizerLike, prompt: Any) -> list[int] | None:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return tokenizer.encode(prompt) if prompt else None
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return list(prompt)
    return None

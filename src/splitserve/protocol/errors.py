"""OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``: the one builder every process uses."""

from __future__ import annotations

from typing import Any


def error_type(status: int) -> str:
    """OpenAI's ``type`` for an HTTP status: the client's mistake, an overloaded or draining service, or ours."""
    if status == 503:
        return "service_unavailable"
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(
    message: str, status: int, *, code: str | int | None = None, param: str | None = None, type_: str | None = None
) -> dict[str, Any]:
    """The JSON object of an error answer (``type`` from ``status`` unless given)."""
    return {"error": {"message": message, "type": type_ or error_type(status), "param": param, "code": code}}

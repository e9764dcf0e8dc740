"""Who may call what: client API keys on the OpenAI routes, and the cluster secret the cluster's own processes
use among themselves.

- **Client keys** (``--api-key``, repeatable, or ``SPLITSERVE_API_KEY``; a worker also honours vLLM's
  ``VLLM_API_KEY``) guard ``/v1/*``, ``/invocations``, ``/tokenize`` and ``/detokenize`` on the worker and the
  router: ``Authorization: Bearer <key>``, else a 401 with OpenAI's error body. ``/health``, ``/ping``,
  ``/metrics`` and ``/version`` stay open. With no key configured, those routes are open, and the process
  says so once, loudly.
- **The cluster secret** (``SPLITSERVE_CLUSTER_SECRET``, or ``--cluster-secret-file``) is the router's
  credential towards its workers. The router never forwards a client's ``Authorization`` header; it sends the
  cluster secret instead, and a worker accepts it wherever it accepts a client key.

Keys are compared in constant time. They never appear in logs.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

logger = logging.getLogger(__name__)

API_KEY_ENV = "SPLITSERVE_API_KEY"
VLLM_API_KEY_ENV = "VLLM_API_KEY"
CLUSTER_SECRET_ENV = "SPLITSERVE_CLUSTER_SECRET"
CLIENT_PATHS = ("/v1/", "/invocations", "/tokenize", "/detokenize")  # prefixes of the routes keys guard


def api_keys(flags: Iterable[str], env_names: Sequence[str] = (API_KEY_ENV,)) -> tuple[str, ...]:
    """The client keys from ``--api-key`` flags and the environment variables ``env_names`` (in that order)."""
    keys = [key.strip() for key in flags]
    keys += [os.environ[name].strip() for name in env_names if os.environ.get(name, "").strip()]
    if any(not key for key in keys):
        raise ValueError("--api-key must not be empty")
    return tuple(dict.fromkeys(keys))


def cluster_secret(path: str | None) -> str | None:
    """The cluster secret from ``--cluster-secret-file`` (first line), else ``SPLITSERVE_CLUSTER_SECRET``."""
    if path:
        try:
            secret = Path(path).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"cannot read --cluster-secret-file {path}: {exc.strerror}") from None
        if not secret:
            raise ValueError(f"--cluster-secret-file {path} is empty")
        return secret
    return os.environ.get(CLUSTER_SECRET_ENV, "").strip() or None


def bearer_header(secret: str | None) -> dict[str, str]:
    """The ``Authorization`` header carrying ``secret``, or no header."""
    return {"Authorization": f"Bearer {secret}"} if secret else {}


def warn_if_open(process: str, keys: Sequence[str]) -> None:
    """One loud warning when a process serves its OpenAI routes to anyone."""
    if not keys:
        logger.warning(
            "SECURITY: this %s has no API key: anyone who can reach it may use /v1/*. Set --api-key or %s "
            "(the supervisor and the Kubernetes operator set one up themselves).",
            process, API_KEY_ENV,
        )  # fmt: skip


class ClientKeyMiddleware:
    """ASGI middleware: a 401 with OpenAI's error body on a client route without a valid bearer token.

    ``keys`` are the client keys; ``cluster_secret``, when set, is accepted too (the router's credential). With
    no keys every request passes.
    """

    def __init__(self, app: ASGIApp, keys: Sequence[str], cluster_secret: str | None = None) -> None:
        self.app = app
        self._accepted = [key.encode() for key in keys]
        if keys and cluster_secret:
            self._accepted.append(cluster_secret.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._accepted and str(scope["path"]).startswith(CLIENT_PATHS):
            token = _bearer_token(scope)
            if token is None or not self._accepts(token):
                await _unauthorized(send, token is None)
                return
        await self.app(scope, receive, send)

    def _accepts(self, token: bytes) -> bool:
        matched = False
        for key in self._accepted:  # every key, so the time does not tell which one nearly matched
            matched |= hmac.compare_digest(token, key)
        return matched


def _bearer_token(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = bytes(value).partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" and token.strip() else None
    return None


async def _unauthorized(send: Send, missing: bool) -> None:
    message = (
        "You didn't provide an API key. Provide it in an Authorization header using Bearer auth "
        "(Authorization: Bearer YOUR_KEY)."
        if missing
        else "Incorrect API key provided."
    )
    body = json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b"Bearer"),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})

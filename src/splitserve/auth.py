"""Who may call what: client API keys on the OpenAI routes, and the cluster secret the cluster's own processes
use among themselves.

- **Client keys** (``--api-key``, repeatable, or ``SPLITSERVE_API_KEY``; a worker also honours vLLM's
  ``VLLM_API_KEY``) guard ``/v1/*``, ``/invocations``, ``/tokenize`` and ``/detokenize`` on the worker and the
  router: ``Authorization: Bearer <key>``, else a 401 with OpenAI's error body. ``/health``, ``/ping``,
  ``/metrics`` and ``/version`` stay open. With no key configured, those routes are open, and the process
  says so once, loudly.
- **The cluster secret** (``SPLITSERVE_CLUSTER_SECRET``, or ``--cluster-secret-file``) is the credential of
  the cluster's own processes. The router never forwards a client's ``Authorization`` header; it sends the
  cluster secret instead, and a worker accepts it wherever it accepts a client key. When a process has one,
  its internal routes (``/admin/*``, ``/kv/*``: worker lists, KV events, KV transfer addresses and lookups)
  take the cluster secret and nothing else; client keys get a 401 there. Workers send it with their KV events.

Keys are compared in constant time. They never appear in logs. The key a client used is left in the request's
state (:func:`client_key_of`), so that ``--salt-per-api-key`` can make each key a tenant (:func:`tenant_salt`).

The cluster secret also signs what crosses the cluster outside HTTP or through a client's hands
(:func:`sign`, :func:`verified`): every KV push from a prefill worker (its control message, then a GMAC over
its payload under a key of that push's own, ``pd.wire.PayloadMac``), and the ``kv_transfer_params`` the
router puts in the requests it sends, which a worker with a secret accepts from no one else.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from splitserve import envs
from splitserve.protocol.errors import error_body

logger = logging.getLogger(__name__)

CLIENT_PATHS = ("/v1/", "/invocations", "/tokenize", "/detokenize")  # prefixes of the routes keys guard
INTERNAL_PATHS = ("/admin/", "/kv/")  # prefixes of the routes only the cluster secret opens


MAC_FIELD = "mac"


def sign(secret: str, message: Mapping[str, Any]) -> str:
    """HMAC-SHA256 (hex) of ``message`` in canonical JSON (sorted keys), its own ``mac`` field left out."""
    canonical = json.dumps({k: v for k, v in message.items() if k != MAC_FIELD}, sort_keys=True, separators=(",", ":"))
    return hmac.new(secret.encode(), canonical.encode(), hashlib.sha256).hexdigest()


def verified(secret: str, message: Mapping[str, Any]) -> bool:
    """True when ``message`` carries the ``mac`` :func:`sign` gives it with ``secret`` (constant time)."""
    mac = message.get(MAC_FIELD)
    return isinstance(mac, str) and hmac.compare_digest(mac, sign(secret, message))


CLIENT_KEY_STATE = "client_key"  # where AuthMiddleware leaves the client key a request used (``request.state``)


def tenant_salt(client_key: str, cache_salt: str | None) -> str:
    """The ``cache_salt`` of a request under ``--salt-per-api-key``: a digest of the client's key (every key a
    tenant of its own), then the client's own salt, if any, which splits the tenant further."""
    tenant = "t-" + hashlib.sha256(b"splitserve tenant\0" + client_key.encode()).hexdigest()[:32]
    return f"{tenant}/{hashlib.sha256(cache_salt.encode()).hexdigest()[:32]}" if cache_salt else tenant


def client_key_of(scope_state: Mapping[str, Any]) -> str | None:
    """The client key a request authenticated with; None for the cluster secret or an open route."""
    key = scope_state.get(CLIENT_KEY_STATE)
    return key if isinstance(key, str) else None


def bearer_header(secret: str | None) -> dict[str, str]:
    """The ``Authorization`` header carrying ``secret``, or no header."""
    return {"Authorization": f"Bearer {secret}"} if secret else {}


def warn_if_open(process: str, keys: Sequence[str], secret: str | None) -> None:
    """One loud warning when a process serves its OpenAI or its internal routes to anyone."""
    open_routes = [what for what, guarded in (("/v1/*", keys), ("/admin/* and /kv/*", secret)) if not guarded]
    if open_routes:
        logger.warning(
            "SECURITY: anyone who can reach this %s may use %s. Set --api-key (or %s) and the cluster secret "
            "(%s or --cluster-secret-file).",
            process, " and ".join(open_routes), envs.API_KEY.name, envs.CLUSTER_SECRET.name,
        )  # fmt: skip


class AuthMiddleware:
    """ASGI middleware: a 401 with OpenAI's error body for a request without a bearer token its route accepts.

    Client routes accept ``keys``, and the cluster secret too when ``secret_opens_client_routes`` (a worker:
    the router's credential); with no keys they are open. Internal routes accept the cluster secret only; with
    none configured they are open. Every other route is open.
    """

    def __init__(
        self,
        app: ASGIApp,
        keys: Sequence[str],
        cluster_secret: str | None = None,
        secret_opens_client_routes: bool = True,
    ) -> None:
        self.app = app
        secret = [cluster_secret.encode()] if cluster_secret else []
        self._keys = [key.encode() for key in keys]
        self._client = list(self._keys)
        if self._client and secret_opens_client_routes:
            self._client += secret
        self._internal = secret

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = str(scope["path"])
            accepted = self._client if path.startswith(CLIENT_PATHS) else None
            if path.startswith(INTERNAL_PATHS):
                accepted = self._internal
            if accepted:
                token = _bearer_token(scope)
                if token is None or not _matches(token, accepted):
                    await _unauthorized(send, token is None, accepted is self._internal)
                    return
                if accepted is self._client and _matches(token, self._keys):  # a client's key, not the cluster's
                    scope.setdefault("state", {})[CLIENT_KEY_STATE] = token.decode()
        await self.app(scope, receive, send)


def _matches(token: bytes, accepted: Sequence[bytes]) -> bool:
    matched = False
    for key in accepted:  # every one, so the time does not tell which one nearly matched
        matched |= hmac.compare_digest(token, key)
    return matched


def _bearer_token(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = bytes(value).partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" and token.strip() else None
    return None


async def _unauthorized(send: Send, missing: bool, internal: bool) -> None:
    if internal:
        message = "This route is internal to the cluster: it takes the cluster secret as a Bearer token."
    elif missing:
        message = (
            "You didn't provide an API key. Provide it in an Authorization header using Bearer auth "
            "(Authorization: Bearer YOUR_KEY)."
        )
    else:
        message = "Incorrect API key provided."
    body = json.dumps(error_body(message, 401, code="invalid_api_key")).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b"Bearer"),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})

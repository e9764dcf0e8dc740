"""The worker's FastAPI app: OpenAI endpoints, ``/health`` and ``/metrics`` over one :class:`AsyncEngine`.

Handlers are thin: validate (pydantic), translate (:class:`OpenAIServing`), answer. Every client mistake is
a 400/404/413 with OpenAI's error body, never FastAPI's default 422 or a 500, and the worker keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splitserve import __version__, httpserver
from splitserve.auth import AuthMiddleware, client_key_of, tenant_salt
from splitserve.config import ServerConfig
from splitserve.engine.async_engine import AsyncEngine
from splitserve.model.kernels import describe_cpu
from splitserve.protocol import sagemaker
from splitserve.protocol.kv_events import WorkerLoad
from splitserve.worker.kv_events import KVEventLog
from splitserve.worker.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    KVLookupRequest,
    TokenizeRequest,
)
from splitserve.worker.serving import ApiError, OpenAIServing

logger = logging.getLogger(__name__)

T = TypeVar("T")
B = TypeVar("B", CompletionRequest, ChatCompletionRequest)
MAX_EVENTS_WAIT_S = 30.0  # a subscriber's long poll on GET /kv/events
EVENTS_POLL_S = 0.05


def _salted(body: B, raw: Request, per_key: bool) -> B:
    """``body`` with its tenant's ``cache_salt`` under ``--salt-per-api-key`` when a client key opened it (the
    router's requests carry the cluster secret and the salt the router set)."""
    key = client_key_of(raw.scope.get("state", {})) if per_key else None
    return body if key is None else body.model_copy(update={"cache_salt": tenant_salt(key, body.cache_salt)})


def build_app(
    engine: AsyncEngine,
    config: ServerConfig | None = None,
    draining: threading.Event | None = None,
    events: KVEventLog | None = None,
) -> FastAPI:
    """The worker app. Its lifespan starts ``engine`` (unless already started) and shuts it down. Once
    ``draining`` is set (SIGTERM), ``/health`` and new requests answer 503 ``draining``. ``events`` (what the
    caches hold) is served at ``GET /kv/events``; without it that route is a 404."""
    config = config or ServerConfig()
    draining = draining or threading.Event()
    serving = OpenAIServing(
        engine, config.max_tokens_limit, draining, config.cluster_secret, config.max_logprobs,
        config.tool_call_parser, config.reasoning_parser,
    )  # fmt: skip

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not engine.is_started:
            engine.start()
        try:
            yield
        finally:
            serving.close()
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="splitserve worker", lifespan=lifespan, **_without_native_telemetry())
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=config.max_request_body_bytes)
    # added last, so it runs first: a request without a valid key is refused before its body is read
    app.add_middleware(AuthMiddleware, keys=config.api_keys, cluster_secret=config.cluster_secret)
    _install_error_handlers(app)
    _add_health_routes(app, engine, config, draining)
    _add_kv_routes(app, serving, events, draining, engine)
    _add_openai_routes(app, serving, config)
    return app


def _add_health_routes(app: FastAPI, engine: AsyncEngine, config: ServerConfig, draining: threading.Event) -> None:
    """Health (``/health``, SageMaker's ``/ping``), metrics, version and where KV events are published."""

    @app.get("/health")
    async def health() -> Response:
        if draining.is_set():
            return _error(ApiError(503, "the worker is draining", code="draining"))
        if engine.is_healthy:
            return Response(status_code=200)
        reason = "the engine failed" if engine.error is not None else "the model is loading"
        return _error(ApiError(503, f"unhealthy: {reason}"))

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """SageMaker's health check: 200 once the model serves, 503 while it loads or the worker drains."""
        return await health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> Response:
        cpu = await asyncio.to_thread(describe_cpu)
        return _json({"version": __version__, "cpu": cpu})

    @app.get("/kv_event_sources")
    async def kv_event_sources() -> Response:
        """vLLM's route: where this worker publishes its KV events in vLLM's format, per data-parallel rank (its
        ``--kv-events-config``, rank 0 only); ``{}`` when it does not publish them."""
        events_config = config.kv_events_config
        if events_config is None or not events_config.is_enabled:
            return _json({})
        return _json({"0": dataclasses.asdict(events_config)})


def _add_kv_routes(
    app: FastAPI, serving: OpenAIServing, events: KVEventLog | None, draining: threading.Event, engine: AsyncEngine
) -> None:
    """The cluster's internal routes: the KV receiver's address, KV events (with the engine's load), lookups."""

    @app.get("/kv/transfer")
    async def kv_transfer() -> Response:
        return _json(serving.kv_transfer_info())

    @app.get("/kv/events")
    async def kv_events(
        raw: Request, after: int | None = None, epoch: str | None = None, wait: float = 0.0, load_only: bool = False
    ) -> Response:
        """The events after ``after`` (of ``epoch``), waiting up to ``wait`` seconds for one or for a change of
        the engine's load; a snapshot when the caller has nothing, or has fallen behind what the log keeps
        (``worker.kv_events.KVEventLog``). Every answer carries the load (``protocol.kv_events.WorkerLoad``).
        ``load_only``: no events at all (a router that keeps no KV index), and the wait is for the load alone."""
        if events is None:
            raise ApiError(404, "this worker publishes no KV events", code="not_found")
        if draining.is_set():  # subscribers back off, rather than poll a worker on its way out
            raise ApiError(503, "the worker is draining", code="draining")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(max(wait, 0.0), MAX_EVENTS_WAIT_S)
        seen = _load(engine).changes

        def up_to_date() -> bool:
            return load_only or (after is not None and events.seq <= after and epoch in (None, events.epoch))

        while after is not None and up_to_date() and loop.time() < deadline:
            if draining.is_set() or await raw.is_disconnected():
                raise ApiError(503, "the worker is draining", code="draining")
            await asyncio.sleep(EVENTS_POLL_S)
            if _load(engine).changes != seen:
                break
        batch = events.no_events() if load_only else events.batch_after(after, epoch)
        return _json({**batch, "load": _load(engine).to_json()})

    @app.post("/kv/lookup")
    async def kv_lookup(body: KVLookupRequest) -> Response:
        return _json((await serving.kv_lookup(body)).model_dump())


def _load(engine: AsyncEngine) -> WorkerLoad:
    backlog = engine.backlog
    running = backlog.num_in_flight - backlog.num_waiting
    return WorkerLoad(backlog.num_waiting, backlog.num_prefilling, running, backlog.prefill_tokens)


def _add_openai_routes(app: FastAPI, serving: OpenAIServing, config: ServerConfig) -> None:
    """The client routes: models, (de)tokenize, completions, chat completions and SageMaker's invocations."""

    @app.get("/v1/models")
    async def models() -> Response:
        return _json(serving.models().model_dump())

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        return _json((await serving.tokenize(body)).model_dump())

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        return _json((await serving.detokenize(body)).model_dump())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        body = _salted(body, raw, config.salt_per_api_key)
        engine_input = await serving.completion_input(body, _resumed_prompt_tokens(raw))
        stream = await serving.submit(engine_input)
        if body.stream:
            return _sse(serving.stream_completion(engine_input, stream, body.include_usage(), body.continuous_usage()))
        return _json(await _cancel_on_disconnect(raw, serving.complete(engine_input, stream)))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        body = _salted(body, raw, config.salt_per_api_key)
        engine_input = await serving.chat_input(body)
        stream = await serving.submit(engine_input)
        if body.stream:
            return _sse(serving.stream_chat(engine_input, stream, body.include_usage(), body.continuous_usage()))
        return _json(await _cancel_on_disconnect(raw, serving.chat(engine_input, stream)))

    @app.post(sagemaker.INVOCATIONS_PATH)
    async def invocations(raw: Request) -> Response:
        """SageMaker's inference route: a body with ``messages`` is a chat completion, one with ``prompt`` a
        completion (streaming too), as vLLM's ``/invocations`` serves them."""
        body = await _json_body(raw)
        path = sagemaker.openai_path(body)
        if path is None:
            raise ApiError(400, sagemaker.MISSING_SHAPE)
        try:
            if path == sagemaker.CHAT_PATH:
                return await chat_completions(ChatCompletionRequest.model_validate(body), raw)
            return await completions(CompletionRequest.model_validate(body), raw)
        except ValidationError as exc:
            raise validation_error(exc.errors()) from exc


def _resumed_prompt_tokens(raw: Request) -> int | None:
    """The original prompt's length of a stream the router resumes here (None when it is not one)."""
    value = raw.headers.get(httpserver.RESUMED_PROMPT_TOKENS_HEADER, "")
    return int(value) if value.isdigit() else None


async def _json_body(raw: Request) -> Any:
    try:
        return json.loads(await raw.body())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise ApiError(400, "the request body is nested too deeply") from exc


def _json(content: Mapping[str, Any], status: int = 200) -> JSONResponse:
    return JSONResponse(content, status_code=status)


def _sse(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _error(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _cancel_on_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Run ``work``, cancelling it if the client disconnects first (the request is then aborted)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    finally:
        watcher.cancel()


# ---- errors ----------------------------------------------------------------------------------------------


def _install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return _error(exc)

    async def on_validation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return _error(validation_error(exc.errors()))

    async def on_http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        code = "not_found" if exc.status_code == 404 else None
        return _error(ApiError(exc.status_code, str(exc.detail), code=code))

    async def on_unexpected(_: Request, exc: Exception) -> Response:
        logger.exception("unexpected error while serving a request")
        return _error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)


def validation_error(errors: Any) -> ApiError:
    """A 400 for pydantic's first complaint, naming the field (``messages.0.content``) and the problem."""
    first: dict[str, Any] = next(iter(errors), {"loc": ("body",), "msg": "invalid request", "type": "value_error"})
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip())
    if not loc:
        return ApiError(400, f"the request body must be a JSON object: {first.get('msg', '')}")
    param = ".".join(loc[:1] if kind != "extra_forbidden" else loc)
    field = ".".join(loc)
    if kind == "extra_forbidden":
        return ApiError(400, f"unknown field '{field}' (extra fields are not permitted)", param)
    if kind == "missing":
        return ApiError(400, f"'{field}' is a required field", param)
    return ApiError(400, f"invalid '{field}': {first.get('msg', 'invalid value')}", param)


class BodySizeLimitMiddleware:
    """413 for a request body over ``max_body_bytes`` (declared or actually sent); buffers the body once."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._reject(scope, receive, send)
            return
        try:
            body = await asyncio.wait_for(self._read_body(receive), httpserver.BODY_TIMEOUT_S)
        except TimeoutError:
            error = ApiError(408, f"the request body took over {httpserver.BODY_TIMEOUT_S:.0f} s to arrive")
            await _error(error)(scope, receive, send)
            return
        if body is None:
            await self._reject(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or None once it grows past the limit (or the client left)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = ApiError(413, f"the request body exceeds the limit of {self.max_body_bytes} bytes")
        await _error(error)(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Callable[[], Awaitable[Message]]:
    """A ``receive`` that yields the buffered body once, then defers to the real one (for disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def _without_native_telemetry() -> dict[str, Any]:
    """FastAPI's own OpenTelemetry spans off (FastAPI 0.16x makes them whenever a tracer provider is set): the
    worker's spans are splitserve.tracing's, the same under every FastAPI version."""
    if "telemetry" not in inspect.signature(FastAPI).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}

"""The router's HTTP app: proxy OpenAI requests to a worker chosen by the routing policy.

Per request: read the body once, ask the policy for a worker among the routable ones, forward the bytes
unchanged, and pass the answer through. Failures before anything reached the client are retried on another
worker (connect errors, timeouts, 429/5xx answers, a worker dying before its first streamed byte or before
a non-streamed answer is complete), with jittered exponential back-off, at most ``max_retries`` times; the
worker's breaker counts them. A worker dying mid-stream ends that stream with an error event and
``[DONE]``. When no worker can take a request the answer is a 503 with OpenAI's error body. A client's
mistake (invalid JSON, 4xx from the worker) is passed back as such, never retried.

Also: ``/v1/models`` (merged over the workers), ``/health`` (200 while some worker is routable),
``/metrics`` and ``/kv/events`` (the workers' KV events, for ``kvaware``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from splitserve.auth import AuthMiddleware, bearer_header
from splitserve.config import RouterConfig
from splitserve.kv_events import parse_batch
from splitserve.metrics import RouterMetrics
from splitserve.router.disagg import Disaggregator
from splitserve.router.discovery import MAX_WORKERS, Worker, WorkerPool, WorkerRole, checked_worker_url
from splitserve.router.health import HealthChecker, worker_breaker
from splitserve.router.kv_index import KVIndex
from splitserve.router.policies import Decision, RoutingPolicy, RoutingRequest, build_policy

logger = logging.getLogger("splitserve.router")

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
# not forwarded to workers: hop-by-hop headers, and the client's key (the router sends its own credential)
NOT_FORWARDED = frozenset(
    {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade", "proxy-connection",
     "authorization"}
)  # fmt: skip
Tokenize = Callable[[str, dict[str, Any]], list[int] | None]
"""(path, body) -> the prompt's token ids as the workers would see them, or None when it cannot tell."""


class RouterError(Exception):
    """An answer with OpenAI's error body."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 503:
            kind = "service_unavailable"
        body = {"error": {"message": str(self), "type": kind, "param": None, "code": self.code or self.status}}
        return JSONResponse(body, status_code=self.status)


@dataclass
class Call:
    """One client request as the router forwards it."""

    path: str
    body: dict[str, Any]
    raw: bytes  # the body as sent to workers (the client's bytes, or a re-encoding of ``body``)
    headers: dict[str, str]
    is_stream: bool
    routing: RoutingRequest
    start_s: float
    observe_ttft: bool = True  # False when the client already got its first token (disaggregated streams)


class _Attempt:
    """One try on one worker; ``failure`` is set when another worker should be tried."""

    def __init__(self) -> None:
        self.failure: str | None = None
        self.response: Response | None = None


class Router:
    """Routing state and the proxy. Every method runs on the event loop."""

    def __init__(
        self,
        config: RouterConfig,
        tokenize: Tokenize | None = None,
        *,
        metrics: RouterMetrics | None = None,
    ) -> None:
        config.validate()
        self.config = config
        self._tokenize = tokenize
        self.pool = WorkerPool.from_urls(
            config.backends,
            config.prefill,
            config.decode,
            failure_threshold=config.breaker_failure_threshold,
            cooldown_s=config.breaker_cooldown_s,
        )
        self.kv_index = KVIndex(config.block_size, config.kv_chunk_size, config.kv_index_max_blocks)
        self.disagg = Disaggregator(self) if config.decode else None
        self.policy: RoutingPolicy = build_policy(config, lambda: self._routing_pool(), self.kv_index)
        self.metrics = metrics or RouterMetrics(config.routing_strategy.value)
        self.metrics.bind(self)
        self._session: aiohttp.ClientSession | None = None
        self.health = HealthChecker(
            lambda: self.pool,
            lambda: self.session,
            interval_s=config.health_interval_s,
            timeout_s=config.health_timeout_s,
            failure_threshold=config.health_failure_threshold,
            success_threshold=config.health_success_threshold,
        )
        self._rng = random.Random()

    @property
    def session(self) -> aiohttp.ClientSession:
        """The HTTP client to the workers, made on first use (it must be made on the running loop)."""
        if self._session is None:
            timeout = aiohttp.ClientTimeout(
                total=None, connect=self.config.connect_timeout_s, sock_read=self.config.read_timeout_s
            )
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=timeout,
                auto_decompress=False,
                trust_env=False,
                headers=bearer_header(self.config.cluster_secret),  # the router's own credential
            )
        return self._session

    # -- state for metrics --------------------------------------------------------------------------------

    def worker_states(self) -> list[tuple[str, int, int, bool]]:
        return [(w.url, w.in_flight, int(w.breaker.state), w.healthy is not False) for w in self.pool]

    def index_sizes(self) -> dict[str, int]:
        sizes = {"kv": len(self.kv_index)}
        index = getattr(self.policy, "index", None)
        if index is not None and index is not self.kv_index:
            sizes["prefix"] = len(index)
        return sizes

    def _routing_pool(self) -> list[Worker]:
        """The workers the policy picks among: the backends, or the decode pool of a disaggregated endpoint."""
        return self.pool.by_role(WorkerRole.DECODE if self.disagg is not None else WorkerRole.BACKEND)

    # -- the proxy ----------------------------------------------------------------------------------------

    async def proxy(self, request: Request) -> Response:
        start_s = time.perf_counter()
        path = request.url.path
        raw = await request.body()
        if len(raw) > self.config.max_request_body_bytes:
            limit = self.config.max_request_body_bytes
            return RouterError(413, f"the request body exceeds the limit of {limit} bytes").response()
        try:
            body = json.loads(raw)
        except ValueError as exc:
            return RouterError(400, f"the request body is not valid JSON: {exc}").response()
        if not isinstance(body, dict):
            return RouterError(400, "the request body must be a JSON object").response()
        routing = await self._routing_request(request, path, body)
        call = Call(path, body, raw, {k: v for k, v in request.headers.items() if k.lower() not in NOT_FORWARDED},
                    body.get("stream") is True, routing, start_s)  # fmt: skip
        if self.disagg is not None:
            return await self.disagg.proxy(call)
        return await self.forward(call, self._routing_pool)

    async def forward(self, call: Call, pool: Callable[[], list[Worker]], first: Decision | None = None) -> Response:
        """Send ``call`` to a worker of ``pool`` chosen by the policy (``first``, when given, is the first
        choice), retrying on others for failures before the client got anything."""
        tried: set[str] = set()
        last_failure = "no worker is available"
        for attempt in range(self.config.max_retries + 1):
            candidates = [w for w in pool() if w.is_routable and w.url not in tried]
            if not candidates:
                break
            if attempt:
                await asyncio.sleep(self._backoff_s(attempt))
            decision = first if first is not None and attempt == 0 else self.policy.select(call.routing, candidates)
            self._log_decision(decision, call.routing)
            result = await self._try(decision.worker, call)
            if result.failure is None:
                assert result.response is not None
                return result.response
            tried.add(decision.worker.url)
            last_failure = f"{decision.worker.name}: {result.failure}"
            self.metrics.retries.labels(result.failure.split(":", 1)[0]).inc()
            if result.response is not None and not any(w.is_routable and w.url not in tried for w in pool()):
                return result.response  # the last worker's own error answer (e.g. its 503)
        self.metrics.decision("no_worker")
        return RouterError(503, f"no worker could take the request ({last_failure})", "no_worker_available").response()

    async def _routing_request(self, request: Request, path: str, body: dict[str, Any]) -> RoutingRequest:
        session = request.headers.get(self.config.session_key) or body.get("user")
        routing = RoutingRequest(path, str(session) if session else None, block_size=self.config.block_size)
        if (self.policy.needs_tokens or self.disagg is not None) and self._tokenize is not None:
            routing.token_ids = await asyncio.get_running_loop().run_in_executor(None, self._tokenize, path, body)
        return routing

    def _backoff_s(self, attempt: int) -> float:
        base = self.config.retry_backoff_s * 2 ** (attempt - 1)
        return base * (0.5 + self._rng.random())

    async def _try(self, worker: Worker, call: Call) -> _Attempt:
        path, raw, headers, is_stream, routing, start_s = (
            call.path,
            call.raw,
            call.headers,
            call.is_stream,
            call.routing,
            call.start_s,
        )
        attempt = _Attempt()
        worker.in_flight += 1
        worker.breaker.on_attempt()
        handed_over = False
        try:
            try:
                upstream = await self.session.post(worker.url + path, data=raw, headers=headers)
            except (aiohttp.ClientError, TimeoutError) as exc:
                self._failed(worker, attempt, f"connect: {type(exc).__name__}")
                return attempt
            if upstream.status in RETRYABLE_STATUS:
                content = await _read_quietly(upstream)
                if upstream.status != 429:
                    self._failed(worker, attempt, f"status: {upstream.status}")
                else:  # alive but full: try another worker, but it is no fault of this one
                    worker.breaker.record_success()
                    attempt.failure = "status: 429"
                attempt.response = Response(content, upstream.status, media_type="application/json")
                return attempt
            media_type = upstream.headers.get("content-type", "application/json")
            if upstream.status != 200 or not is_stream:
                try:
                    content = await upstream.read()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    self._failed(worker, attempt, f"read: {type(exc).__name__}")
                    return attempt
                finally:
                    upstream.release()
                worker.breaker.record_success()
                self._answered(worker, upstream.status, routing, start_s)
                attempt.response = Response(content, upstream.status, media_type=media_type)
                return attempt
            chunks = upstream.content.iter_any()
            try:
                first = await anext(chunks)
            except (aiohttp.ClientError, TimeoutError, StopAsyncIteration) as exc:
                upstream.close()
                self._failed(worker, attempt, f"read: {type(exc).__name__}")
                return attempt
            worker.breaker.record_success()
            if call.observe_ttft:
                self.metrics.ttft_s.observe(time.perf_counter() - start_s)
            self.policy.on_routed(routing, worker)
            attempt.response = StreamingResponse(
                self._relay(worker, upstream, first, chunks, start_s),
                media_type=media_type,
                headers={"Cache-Control": "no-cache"},
            )
            handed_over = True  # _relay now owns in_flight and the upstream response
            return attempt
        finally:
            if not handed_over:
                worker.in_flight -= 1

    async def _relay(
        self,
        worker: Worker,
        upstream: aiohttp.ClientResponse,
        first: bytes,
        chunks: AsyncIterator[bytes],
        start_s: float,
    ) -> AsyncIterator[bytes]:
        status = "200"
        try:
            yield first
            last_s = time.perf_counter()
            try:
                async for chunk in chunks:
                    now_s = time.perf_counter()
                    self.metrics.itl_s.observe(now_s - last_s)
                    last_s = now_s
                    yield chunk
            except (aiohttp.ClientError, TimeoutError) as exc:
                status = "stream_error"
                worker.breaker.record_failure()
                logger.warning("worker %s failed mid-stream: %s: %s", worker.name, type(exc).__name__, exc)
                message = f"the worker failed mid-stream ({type(exc).__name__})"
                error = {"error": {"message": message, "type": "server_error", "param": None, "code": 502}}
                yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        finally:
            worker.in_flight -= 1
            upstream.close()  # a client that left early also drops the worker's connection: the worker aborts
            self.metrics.requests.labels(worker.url, status).inc()
            self.metrics.e2e_s.observe(time.perf_counter() - start_s)

    def _failed(self, worker: Worker, attempt: _Attempt, reason: str) -> None:
        attempt.failure = reason
        if worker.breaker.record_failure():
            logger.warning("circuit breaker opened for worker %s after: %s", worker.name, reason)
        self.metrics.requests.labels(worker.url, reason.split(":", 1)[0]).inc()

    def _answered(self, worker: Worker, status: int, routing: RoutingRequest, start_s: float) -> None:
        if status == 200:
            self.policy.on_routed(routing, worker)
            elapsed_s = time.perf_counter() - start_s
            self.metrics.ttft_s.observe(elapsed_s)
            self.metrics.e2e_s.observe(elapsed_s)
        self.metrics.requests.labels(worker.url, str(status)).inc()

    def _log_decision(self, decision: Decision, routing: RoutingRequest) -> None:
        self.metrics.decision(decision.outcome)
        if decision.matched_tokens:
            self.metrics.index_hit_tokens.inc(decision.matched_tokens)
        strategy = self.policy.name
        if decision.outcome == "matched":
            logger.info(
                "Routing request to %s found by %s router (%d of %d prompt tokens held)",
                decision.worker.name, strategy, decision.matched_tokens, len(routing.token_ids or []),
            )  # fmt: skip
        elif strategy in ("prefixaware", "kvaware"):
            logger.info("Routing request to %s by %s router: %s", decision.worker.name, strategy, decision.outcome)

    # -- other endpoints ----------------------------------------------------------------------------------

    async def models(self, _: Request) -> Response:
        workers = [w for w in self.pool if w.is_routable]
        answers = await asyncio.gather(*(self.get_json(f"{w.url}/v1/models") for w in workers))
        cards: dict[str, Any] = {}
        for answer in answers:
            for card in answer.get("data", []) if isinstance(answer, dict) else []:
                cards.setdefault(card.get("id"), card)
        if not cards:
            return RouterError(503, "no worker answered /v1/models", "no_worker_available").response()
        return JSONResponse({"object": "list", "data": list(cards.values())})

    async def get_json(self, url: str) -> Any:
        """The JSON of a 200 answer, or None for anything else."""
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=self.config.health_timeout_s)) as r:
                return await r.json() if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    async def health_endpoint(self, _: Request) -> Response:
        if any(w.healthy is True and w.breaker.allows() for w in self._routing_pool()):  # decode, when split
            return Response(status_code=200)
        return RouterError(503, "no healthy worker", "no_worker_available").response()

    async def render_metrics(self, _: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def kv_events(self, request: Request) -> Response:
        try:
            body = json.loads(await request.body())
            worker_id, worker_url, reset, events = parse_batch(body)
            url = checked_worker_url(worker_url)
        except ValueError as exc:
            return RouterError(400, f"invalid KV events: {exc}").response()
        if reset and not self.kv_index.is_registered(url) and self.kv_index.num_workers >= MAX_WORKERS:
            return RouterError(429, f"the KV index already tracks {MAX_WORKERS} workers", "too_many_workers").response()
        meta = body.get("meta") if isinstance(body.get("meta"), dict) else None
        if not self.kv_index.apply(url, worker_id, reset, events, meta):
            return RouterError(409, f"worker {worker_id} is not registered; send a reset", "unknown_worker").response()
        if reset:
            self._register(url, worker_id, meta or {})
        return Response(status_code=200)

    async def workers_endpoint(self, request: Request) -> Response:
        """``GET /admin/workers``: every worker's state. ``PUT``: replace the lists (the supervisor's and a
        cluster watch's discovery feed); workers that stay keep their health, breaker and load."""
        if request.method == "PUT":
            try:
                lists = _worker_lists(json.loads(await request.body()))
            except ValueError as exc:
                return RouterError(400, f"invalid worker list: {exc}").response()
            is_split = bool(self.config.decode)
            if is_split != bool(lists[WorkerRole.DECODE]) or (not is_split and not lists[WorkerRole.BACKEND]):
                return RouterError(400, "the router's mode (backends, or prefill and decode) cannot change").response()
            self.pool.update(
                Worker(url, role, worker_breaker(self.config.breaker_failure_threshold, self.config.breaker_cooldown_s))
                for role, urls in lists.items() for url in urls  # each url came through checked_worker_url
            )  # fmt: skip
            logger.info("workers updated: %s", ", ".join(f"{w.role.value} {w.url}" for w in self.pool))
        states = [
            {"url": w.url, "role": w.role.value, "healthy": w.healthy, "in_flight": w.in_flight,
             "breaker": w.breaker.state.name.lower(), "worker_id": w.worker_id}
            for w in self.pool
        ]  # fmt: skip
        return JSONResponse({"workers": states})

    def _register(self, url: str, worker_id: str, meta: dict[str, Any]) -> None:
        worker = self.pool.get(url)
        if worker is not None:
            worker.worker_id = worker_id
        note = "" if worker is not None else " - not one of this router's workers"
        logger.info("Worker registered: %s (%s)%s", worker_id, url, note)
        for key, ours in (("block_size", self.config.block_size), ("chunk_size", self.config.kv_chunk_size)):
            if key in meta and meta[key] != ours:
                logger.warning(
                    "worker %s uses %s %s, the router %s: kvaware matches will be off", worker_id, key, meta[key], ours
                )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def _worker_lists(body: Any) -> dict[WorkerRole, list[str]]:
    """``{"backend": [url...], "prefill": [...], "decode": [...]}`` checked; ValueError otherwise."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    lists = {role: body.get(role.value, []) for role in WorkerRole}
    if any(not isinstance(urls, list) for urls in lists.values()):
        raise ValueError("'backend', 'prefill' and 'decode' must be lists of http(s)://host:port URLs")
    if sum(len(urls) for urls in lists.values()) > MAX_WORKERS:
        raise ValueError(f"at most {MAX_WORKERS} workers")
    return {role: [checked_worker_url(url) for url in urls] for role, urls in lists.items()}


async def _read_quietly(response: aiohttp.ClientResponse) -> bytes:
    try:
        return await response.read()
    except (aiohttp.ClientError, TimeoutError):
        return b""
    finally:
        response.release()


def build_router_app(router: Router, *, probe: bool = True) -> Starlette:
    """The Starlette app over ``router``; its lifespan runs the health checker (unless ``probe`` is off)."""

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        task = None
        if probe:
            await router.health.probe_all()
            task = asyncio.create_task(router.health.run())
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await router.aclose()

    routes = [
        Route("/v1/completions", router.proxy, methods=["POST"]),
        Route("/v1/chat/completions", router.proxy, methods=["POST"]),
        Route("/v1/models", router.models, methods=["GET"]),
        Route("/health", router.health_endpoint, methods=["GET"]),
        Route("/metrics", router.render_metrics, methods=["GET"]),
        Route("/kv/events", router.kv_events, methods=["POST"]),
        Route("/admin/workers", router.workers_endpoint, methods=["GET", "PUT"]),
    ]
    config = router.config
    keys = Middleware(
        AuthMiddleware, keys=config.api_keys, cluster_secret=config.cluster_secret, secret_opens_client_routes=False
    )
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers=_EXCEPTION_HANDLERS, middleware=[keys])


async def _on_http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return RouterError(exc.status_code, str(exc.detail), "not_found" if exc.status_code == 404 else None).response()


async def _on_unexpected(_: Request, exc: Exception) -> Response:
    logger.exception("unexpected error in the router")
    return RouterError(500, f"internal error: {type(exc).__name__}: {exc}").response()


_EXCEPTION_HANDLERS: dict[Any, Callable[[Request, Exception], Any]] = {
    HTTPException: _on_http_error,
    Exception: _on_unexpected,
}

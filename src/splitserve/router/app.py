"""The router's HTTP app: proxy OpenAI requests to a worker chosen by the routing policy.

Per request (:meth:`Router.proxy`): read the body once (413 past the limit, 400 for bad JSON), check
``cache_salt``, map SageMaker's ``/invocations`` to the route its body is for, salt per client key when asked,
tokenize for the cache-aware policies, then hand the call to the disaggregator (a prefill/decode endpoint) or
straight to the :class:`~splitserve.router.forward.Forwarder`, which picks the worker, retries, relays and
resumes streams. When no worker can take a request the answer is a 503 with OpenAI's error body.

Also: ``/v1/models`` (merged over the workers), ``/health`` and ``/ping`` (200 while some worker is
routable), ``/version``, ``/tokenize`` and ``/detokenize`` (the least busy worker answers), ``/metrics``,
``/kv/events`` (the workers' KV events, for ``kvaware``) and ``/admin/workers``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from splitserve import __version__, httpserver
from splitserve.auth import AuthMiddleware, client_key_of, tenant_salt
from splitserve.config import RouterConfig
from splitserve.keys import MAX_CACHE_SALT_CHARS, is_valid_cache_salt
from splitserve.metrics import RouterMetrics, WorkerRow
from splitserve.protocol.kv_events import parse_batch
from splitserve.protocol.sagemaker import INVOCATIONS_PATH, MISSING_SHAPE, openai_path
from splitserve.router.cost import PrefillCostModel
from splitserve.router.disagg import Disaggregator
from splitserve.router.discovery import MAX_WORKERS, Worker, WorkerPool, WorkerRole, checked_worker_url
from splitserve.router.events import EventSubscriber
from splitserve.router.forward import NOT_FORWARDED, RETRYABLE_STATUS, Call, Forwarder, RouterError
from splitserve.router.health import HealthChecker, worker_breaker
from splitserve.router.hit_check import HitPredictionCheck
from splitserve.router.kv_index import KVIndex
from splitserve.router.migrate import is_migratable
from splitserve.router.policies import RoutingPolicy, RoutingRequest
from splitserve.router.scrape import WorkerStatsScraper
from splitserve.router.transport import Transport, TransportError

logger = logging.getLogger("splitserve.router")

Tokenize = Callable[[str, dict[str, Any]], list[int] | None]
"""(path, body) -> the prompt's token ids as the workers would see them, or None when it cannot tell."""


@dataclass(frozen=True, slots=True)
class RouterParts:
    """What a :class:`Router` serves over, each built once by :func:`splitserve.router.build.build_router`."""

    pool: WorkerPool
    routing_pool: Callable[[], list[Worker]]  # the workers the policy picks among: backends, or the decode pool
    kv_index: KVIndex
    policy: RoutingPolicy
    metrics: RouterMetrics
    transport: Transport  # every request to a worker: forwarded, probed, scraped, polled
    forwarder: Forwarder
    health: HealthChecker
    scraper: WorkerStatsScraper
    cost: PrefillCostModel  # seconds per prefill token per worker, from its streams' TTFT
    hit_check: HitPredictionCheck
    disagg: Disaggregator | None = None  # a prefill/decode endpoint's
    events: EventSubscriber | None = None  # kvaware's: the router pulls every worker's KV events itself


class Router:
    """Routing state and the proxy. Every method runs on the event loop."""

    def __init__(self, config: RouterConfig, parts: RouterParts, tokenize: Tokenize | None = None) -> None:
        """The router over ``parts`` (see :func:`~splitserve.router.build.build_router`, which checks
        ``config``); ``tokenize`` gives the cache-aware policies and the disaggregator a prompt's token ids."""
        self.config = config
        self._tokenize = tokenize
        self.pool = parts.pool
        self._routing_pool = parts.routing_pool
        self.kv_index = parts.kv_index
        self.policy = parts.policy
        self.metrics = parts.metrics
        self.transport = parts.transport
        self.forwarder = parts.forwarder
        self.health = parts.health
        self.scraper = parts.scraper
        self.cost = parts.cost
        self.hit_check = parts.hit_check
        self.disagg = parts.disagg
        self.events = parts.events
        self._limiter = (
            _Limiter(config.max_concurrent_requests, config.queue_timeout_s) if config.max_concurrent_requests else None
        )
        self.metrics.bind(self)

    # -- state for metrics --------------------------------------------------------------------------------

    def worker_states(self) -> list[WorkerRow]:
        return [
            WorkerRow(w.url, w.in_flight, w.num_streaming, int(w.breaker.state), w.healthy is not False)
            for w in self.pool
        ]

    def index_sizes(self) -> dict[str, int]:
        sizes = {"kv": len(self.kv_index)} | {f"kv_{tier}": n for tier, n in self.kv_index.sizes().items()}
        index = getattr(self.policy, "index", None)
        if index is not None and index is not self.kv_index:
            sizes["prefix"] = len(index)
        prefix = getattr(self.policy, "prefix", None)  # kvaware's own prefix index
        if prefix is not None:
            sizes["prefix"] = len(prefix.index)
        return sizes

    # -- the proxy ----------------------------------------------------------------------------------------

    async def proxy(self, request: Request) -> Response:
        """One client request, within ``--max-concurrent-requests`` when set: past it a request waits up to
        ``--queue-timeout`` for a slot (as many may wait as run), else gets a 429 with ``Retry-After``."""
        limiter = self._limiter
        if limiter is None:
            return await self._proxy(request)
        if not await limiter.acquire():
            self.metrics.decision("overloaded")
            error = RouterError(429, "the router is at its concurrency limit; retry shortly", "router_overloaded")
            refused = error.response()
            refused.headers["Retry-After"] = "1"
            return refused
        try:
            response = await self._proxy(request)
        except BaseException:
            limiter.release()
            raise
        if isinstance(response, StreamingResponse):  # the slot is held until the stream ends
            response.background = _chain_tasks(response.background, limiter.release)
        else:
            limiter.release()
        return response

    async def _proxy(self, request: Request) -> Response:
        start_s = time.perf_counter()
        path = request.url.path
        try:
            body, raw = await self._json_body(request)
        except RouterError as exc:
            return exc.response()
        if not isinstance(body, dict):
            return RouterError(400, "the request body must be a JSON object").response()
        if path == INVOCATIONS_PATH:  # SageMaker's route: a chat or a completion, by the body's shape
            path = openai_path(body) or ""
            if not path:
                return RouterError(400, MISSING_SHAPE).response()
        self.metrics.observe_incoming(body.get("model"))
        if "kv_transfer_params" in body:  # the router's to set (signed), never a client's
            body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
            raw = json.dumps(body).encode()
        salt = body.get("cache_salt")
        if salt is not None and not is_valid_cache_salt(salt):
            return RouterError(400, f"cache_salt must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters").response()
        key = client_key_of(request.scope.get("state", {})) if self.config.salt_per_api_key else None
        if key is not None:  # each key a tenant: the workers see the cluster secret and take this salt as given
            body = body | {"cache_salt": tenant_salt(key, salt)}
            raw = json.dumps(body).encode()
        routing = await self._routing_request(request, path, body)
        call = Call(path, body, raw, {k: v for k, v in request.headers.items() if k.lower() not in NOT_FORWARDED},
                    body.get("stream") is True, routing, start_s)  # fmt: skip
        if self.disagg is not None:
            return await self.disagg.proxy(call)
        if self.config.stream_migration and is_migratable(path, body):
            self.forwarder.track(call)
        return await self.forwarder.forward(call, self._routing_pool)

    async def _json_body(self, request: Request) -> tuple[Any, bytes]:
        """The request's JSON and bytes; a :class:`RouterError` 413 as soon as the body passes the limit
        (declared or sent, never buffered past it), 400 when it is not JSON or nests too deep."""
        limit = self.config.max_request_body_bytes
        too_large = RouterError(413, f"the request body exceeds the limit of {limit} bytes", "body_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        parts: list[bytes] = []
        size = 0

        async def read() -> None:
            nonlocal size
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise too_large
                parts.append(part)

        try:
            await asyncio.wait_for(read(), httpserver.BODY_TIMEOUT_S)
        except TimeoutError as exc:
            raise RouterError(408, f"the request body took over {httpserver.BODY_TIMEOUT_S:.0f} s to arrive") from exc
        raw = b"".join(parts)
        try:
            return json.loads(raw), raw
        except ValueError as exc:
            raise RouterError(400, f"the request body is not valid JSON: {exc}") from exc
        except RecursionError as exc:
            raise RouterError(400, "the request body nests too deeply") from exc

    async def _routing_request(self, request: Request, path: str, body: dict[str, Any]) -> RoutingRequest:
        session = request.headers.get(self.config.session_key) or body.get("user")
        salt = body.get("cache_salt")
        routing = RoutingRequest(path, str(session) if session else None, block_size=self.config.block_size,
                                 cache_salt=salt if isinstance(salt, str) else None)  # fmt: skip
        if (self.policy.needs_tokens or self.disagg is not None) and self._tokenize is not None:
            routing.token_ids = await asyncio.get_running_loop().run_in_executor(None, self._tokenize, path, body)
        return routing

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
        return await self.forwarder.get_json(url)

    async def health_endpoint(self, _: Request) -> Response:
        """``/health`` and SageMaker's ``/ping``: 200 while a worker can take requests, else 503."""
        if any(w.healthy is True and w.breaker.allows() for w in self._routing_pool()):  # decode, when split
            return Response(status_code=200)
        return RouterError(503, "no healthy worker", "no_worker_available").response()

    async def version(self, _: Request) -> Response:
        return JSONResponse({"version": __version__})

    async def tokenizer_endpoint(self, request: Request) -> Response:
        """``/tokenize`` and ``/detokenize``: answered by the least busy worker that answers at all (every
        worker serves the same model), with no routing decision, no retry on a client error."""
        try:
            _, raw = await self._json_body(request)
        except RouterError as exc:
            return exc.response()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in NOT_FORWARDED}
        for worker in sorted((w for w in self._routing_pool() if w.is_routable), key=lambda w: w.in_flight):
            try:
                upstream = await self.transport.post(worker.url + request.url.path, raw, headers)
                content = await upstream.read()
            except TransportError:
                continue
            if upstream.status not in RETRYABLE_STATUS:
                return Response(content, upstream.status, media_type="application/json")
        return RouterError(503, "no worker answered", "no_worker_available").response()

    async def render_metrics(self, _: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def kv_events(self, request: Request) -> Response:
        try:
            body, _ = await self._json_body(request)
            worker_id, worker_url, reset, events = parse_batch(body)
            url = checked_worker_url(worker_url)
        except RouterError as exc:
            return exc.response()
        except ValueError as exc:
            return RouterError(400, f"invalid KV events: {exc}").response()
        if reset and not self.kv_index.is_registered(url) and self.kv_index.num_workers >= MAX_WORKERS:
            return RouterError(429, f"the KV index already tracks {MAX_WORKERS} workers", "too_many_workers").response()
        meta = body.get("meta") if isinstance(body.get("meta"), dict) else None
        if self.events is not None and self.events.has_events(url):
            return Response(status_code=200)  # the router pulls this worker's events: a push could only lag them
        if not self.kv_index.apply(url, worker_id, reset, events, meta):
            return RouterError(409, f"worker {worker_id} is not registered; send a reset", "unknown_worker").response()
        if reset:
            register_worker(self.pool, self.config, url, worker_id, meta or {})
        return Response(status_code=200)

    async def workers_endpoint(self, request: Request) -> Response:
        """``GET /admin/workers``: every worker's state. ``PUT``: replace the lists (the supervisor's and a
        cluster watch's discovery feed); workers that stay keep their health, breaker and load."""
        if request.method == "PUT":
            try:
                lists = _worker_lists((await self._json_body(request))[0])
            except RouterError as exc:
                return exc.response()
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
            if self.events is not None:
                self.events.sync(self.pool)
        states = [
            {"url": w.url, "role": w.role.value, "healthy": w.healthy, "in_flight": w.in_flight,
             "breaker": w.breaker.state.name.lower(), "worker_id": w.worker_id}
            for w in self.pool
        ]  # fmt: skip
        return JSONResponse({"workers": states})

    async def aclose(self) -> None:
        if self.events is not None:
            await self.events.aclose()
        await self.transport.aclose()


def register_worker(pool: WorkerPool, config: RouterConfig, url: str, worker_id: str, meta: dict[str, Any]) -> None:
    """A worker sent its KV events' reset (pushed, or pulled by the subscriber): name it in ``pool``, and warn
    when its block or chunk size is not the router's (``config``)."""
    worker = pool.get(url)
    if worker is not None:
        worker.worker_id = worker_id
    note = "" if worker is not None else " - not one of this router's workers"
    logger.info("Worker registered: %s (%s)%s", worker_id, url, note)
    for key, ours in (("block_size", config.block_size), ("chunk_size", config.kv_chunk_size)):
        if key in meta and meta[key] != ours:
            logger.warning(
                "worker %s uses %s %s, the router %s: kvaware matches will be off", worker_id, key, meta[key], ours
            )


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


class _Limiter:
    """At most ``limit`` requests at once; as many more wait, each up to ``timeout_s``."""

    def __init__(self, limit: int, timeout_s: float) -> None:
        self.limit = limit
        self.timeout_s = timeout_s
        self.running = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self) -> bool:
        if self.running < self.limit and not self._waiters:
            self.running += 1
            return True
        if len(self._waiters) >= self.limit:
            return False
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.timeout_s)
            return True  # release() handed its slot over
        except TimeoutError:
            if waiter.done():  # handed over just as the wait ran out: keep it
                return True
            self._waiters.remove(waiter)
            waiter.cancel()
            return False
        except asyncio.CancelledError:  # the client left while waiting: give back what it may have been handed
            if waiter.done() and not waiter.cancelled():
                self.release()
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
                waiter.cancel()
            raise

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes to the oldest waiter
                return
        self.running -= 1


def _chain_tasks(first: BackgroundTask | None, then: Callable[[], None]) -> BackgroundTask:
    if first is None:
        return BackgroundTask(then)

    async def both() -> None:
        try:
            await first()
        finally:
            then()

    return BackgroundTask(both)


def build_router_app(router: Router, *, probe: bool = True, with_admin: bool = True) -> Starlette:
    """The Starlette app over ``router``; its lifespan runs the health checker (unless ``probe`` is off).

    ``with_admin`` serves ``/admin/*`` here too (tests, embedding); ``splitserve router`` serves them on a
    separate loopback listener instead (:func:`build_admin_app`).
    """

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        task = None
        if probe:
            await router.health.probe_all()
            task = asyncio.ensure_future(asyncio.gather(router.health.run(), router.scraper.run()))
        if router.events is not None:
            router.events.sync(router.pool)
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
        Route(INVOCATIONS_PATH, router.proxy, methods=["POST"]),
        Route("/health", router.health_endpoint, methods=["GET"]),
        Route("/ping", router.health_endpoint, methods=["GET", "POST"]),
        Route("/version", router.version, methods=["GET"]),
        Route("/tokenize", router.tokenizer_endpoint, methods=["POST"]),
        Route("/detokenize", router.tokenizer_endpoint, methods=["POST"]),
        Route("/metrics", router.render_metrics, methods=["GET"]),
        Route("/kv/events", router.kv_events, methods=["POST"]),
    ]
    if with_admin:
        routes += admin_routes(router)
    return Starlette(
        routes=routes, lifespan=lifespan, exception_handlers=_EXCEPTION_HANDLERS, middleware=[_keys(router)]
    )


def admin_routes(router: Router) -> list[Route]:
    """The routes that change where traffic goes (``/admin/*``): the cluster secret's only."""
    return [Route("/admin/workers", router.workers_endpoint, methods=["GET", "PUT"])]


def build_admin_app(router: Router) -> Starlette:
    """The admin listener's app (``--admin-host``/``--admin-port``, loopback by default): ``/admin/*`` and
    ``/health``. It shares ``router`` with the public app, whose lifespan starts and stops it."""
    routes = [*admin_routes(router), Route("/health", router.health_endpoint, methods=["GET"])]
    return Starlette(routes=routes, exception_handlers=_EXCEPTION_HANDLERS, middleware=[_keys(router)])


def _keys(router: Router) -> Middleware:
    config = router.config
    return Middleware(
        AuthMiddleware, keys=config.api_keys, cluster_secret=config.cluster_secret, secret_opens_client_routes=False
    )


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

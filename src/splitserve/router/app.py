"""The router's HTTP app: proxy OpenAI requests to a worker chosen by the routing policy.

Per request: read the body once, ask the policy for a worker among the routable ones, forward the bytes
unchanged, and pass the answer through. Failures before anything reached the client are retried on another
worker (connect errors, timeouts, 429/5xx answers, a worker dying before its first streamed byte or before
a non-streamed answer is complete), with jittered exponential back-off, at most ``max_retries`` times; the
worker's breaker counts them (a 429, or a 503 ``draining``, is no fault: the second takes the worker out of
rotation until its ``/health`` answers 200 again). A worker dying mid-stream has its stream resumed on
another worker (``router/migrate.py``); a stream that cannot be resumed ends with an error event and
``[DONE]``. When no worker can take a request the answer is a 503 with OpenAI's error body. A client's
mistake (invalid JSON, 4xx from the worker) is passed back as such, never retried.

Also: ``/v1/models`` (merged over the workers), ``/health`` (200 while some worker is routable),
``/metrics`` and ``/kv/events`` (the workers' KV events, for ``kvaware``).
"""

from __future__ import annotations

import asyncio
import collections
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
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from splitserve import __version__, httpserver
from splitserve.auth import AuthMiddleware, bearer_header, client_key_of, tenant_salt
from splitserve.config import RouterConfig, RoutingStrategy
from splitserve.keys import MAX_CACHE_SALT_CHARS, is_valid_cache_salt
from splitserve.kv_events import parse_batch
from splitserve.metrics import RouterMetrics, WorkerRow
from splitserve.router.cost import PrefillCostModel
from splitserve.router.disagg import Disaggregator
from splitserve.router.discovery import MAX_WORKERS, Worker, WorkerPool, WorkerRole, checked_worker_url
from splitserve.router.events import EventSubscriber
from splitserve.router.health import HealthChecker, worker_breaker
from splitserve.router.hit_check import HitPredictionCheck
from splitserve.router.kv_index import KVIndex
from splitserve.router.migrate import (
    PROMPT_CONTEXT_TOKENS,
    SSEBuffer,
    StreamTracker,
    WorkerStreamFailed,
    held_back_text,
    is_migratable,
    resume_body,
    sse_event,
    stream_error_end,
)
from splitserve.router.policies import Decision, RoutingPolicy, RoutingRequest, build_policy
from splitserve.router.scrape import WorkerStatsScraper
from splitserve.router.vllm_events import VLLMSource
from splitserve.sagemaker import INVOCATIONS_PATH, MISSING_SHAPE, invocation_path

logger = logging.getLogger("splitserve.router")

MAX_PARTIAL_CHARACTER_TOKENS = 4  # a UTF-8 character spans at most 4 byte-level tokens
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
    tracker: StreamTracker | None = None  # a stream the router can resume on another worker


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
        self.cost = PrefillCostModel()  # seconds per prefill token per worker, from its streams' TTFT
        cost = self.cost if config.routing_cost_model else None
        self.policy: RoutingPolicy = build_policy(config, lambda: self._routing_pool(), self.kv_index, cost)
        self.metrics = metrics or RouterMetrics(config.routing_strategy.value)
        self.metrics.bind(self)
        self._session: aiohttp.ClientSession | None = None
        self.hit_check = HitPredictionCheck(self.metrics)
        self.scraper = WorkerStatsScraper(lambda: self.pool, lambda: self.session, self.metrics,
                                          timeout_s=config.health_timeout_s, hit_check=self.hit_check)  # fmt: skip
        self.health = HealthChecker(
            lambda: self.pool,
            lambda: self.session,
            interval_s=config.health_interval_s,
            timeout_s=config.health_timeout_s,
            failure_threshold=config.health_failure_threshold,
            success_threshold=config.health_success_threshold,
        )
        self._rng = random.Random()
        # kvaware: the router pulls every worker's KV events itself (workers may also push them)
        self.events = (
            EventSubscriber(
                self.kv_index, lambda: self.session, self._register, config.backend_kind, VLLMSource.from_config(config)
            )
            if config.routing_strategy == RoutingStrategy.KVAWARE
            else None
        )
        self._limiter = (
            _Limiter(config.max_concurrent_requests, config.queue_timeout_s) if config.max_concurrent_requests else None
        )

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

    def worker_states(self) -> list[WorkerRow]:
        return [
            WorkerRow(w.url, w.in_flight, w.num_streaming, int(w.breaker.state), w.healthy is not False)
            for w in self.pool
        ]

    def index_sizes(self) -> dict[str, int]:
        sizes = {"kv": len(self.kv_index)}
        index = getattr(self.policy, "index", None)
        if index is not None and index is not self.kv_index:
            sizes["prefix"] = len(index)
        prefix = getattr(self.policy, "prefix", None)  # kvaware's own prefix index
        if prefix is not None:
            sizes["prefix"] = len(prefix.index)
        return sizes

    def _routing_pool(self) -> list[Worker]:
        """The workers the policy picks among: the backends, or the decode pool of a disaggregated endpoint."""
        return self.pool.by_role(WorkerRole.DECODE if self.disagg is not None else WorkerRole.BACKEND)

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
            path = invocation_path(body) or ""
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
            self.track(call)
        return await self.forward(call, self._routing_pool)

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

    def track(self, call: Call, sent_text: str = "") -> None:
        """Follow ``call``'s stream so that it can be resumed elsewhere: ask the worker for token ids.
        ``sent_text``: what the client already got of the answer (a disaggregated stream's first token)."""
        body = call.body
        options = body.get("stream_options")
        wants_usage = isinstance(options, dict) and options.get("include_usage") is True
        wants_ids = body.get("return_token_ids") is True
        call.tracker = StreamTracker(call.path.endswith("/chat/completions"), wants_ids, wants_usage, text=sent_text)
        if not wants_ids:
            call.raw = json.dumps(body | {"return_token_ids": True}).encode()

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
            result = await self._try(decision.worker, call, decision.uncached_tokens)
            if result.failure is None:
                assert result.response is not None
                if result.response.status_code == 200:
                    self.hit_check.predicted(decision.worker.url, decision.matched_tokens)
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
        salt = body.get("cache_salt")
        routing = RoutingRequest(path, str(session) if session else None, block_size=self.config.block_size,
                                 cache_salt=salt if isinstance(salt, str) else None)  # fmt: skip
        if (self.policy.needs_tokens or self.disagg is not None) and self._tokenize is not None:
            routing.token_ids = await asyncio.get_running_loop().run_in_executor(None, self._tokenize, path, body)
        return routing

    def _backoff_s(self, attempt: int) -> float:
        base = self.config.retry_backoff_s * 2 ** (attempt - 1)
        return base * (0.5 + self._rng.random())

    async def _try(self, worker: Worker, call: Call, uncached_tokens: int = 0) -> _Attempt:
        """Send ``call`` to ``worker``; its ``uncached_tokens`` count as queued there until it answers."""
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
        self.metrics.observe_sent(worker.url)
        worker.breaker.on_attempt()
        handed_over = False
        queued = _QueuedPrefill(worker, uncached_tokens)
        try:
            try:
                upstream = await self.session.post(worker.url + path, data=raw, headers=headers)
            except (aiohttp.ClientError, TimeoutError) as exc:
                self._failed(worker, attempt, f"connect: {type(exc).__name__}")
                return attempt
            if upstream.status in RETRYABLE_STATUS:
                content = await _read_quietly(upstream)
                if upstream.status == 429:  # alive but full: try another worker, but it is no fault of this one
                    worker.breaker.record_success()
                    attempt.failure = "status: 429"
                elif upstream.status == 503 and _error_code(content) == "draining":
                    self._draining(worker)
                    attempt.failure = "status: draining"
                else:
                    self._failed(worker, attempt, f"status: {upstream.status}")
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
            # a completion's first chunk carries its first token; a chat's may be the role alone, sent at once
            queued.answered(self.cost if not path.endswith("/chat/completions") else None)
            if call.observe_ttft:
                self.metrics.ttft_s.observe(time.perf_counter() - start_s)
            self.policy.on_routed(routing, worker)
            lease = _Lease(worker, upstream)  # released by the relay, or after the response if it never ran
            relay = (
                self._relay(lease, first, chunks, start_s)
                if call.tracker is None
                else self._relay_tracked(lease, _prepend(first, chunks), call)
            )
            headers = {"Cache-Control": "no-cache"}
            background = BackgroundTask(lease.release)
            attempt.response = StreamingResponse(relay, media_type=media_type, headers=headers, background=background)
            handed_over = True  # the lease now owns in_flight and the upstream response
            return attempt
        finally:
            queued.release()
            if not handed_over:
                worker.in_flight -= 1

    async def _relay(
        self, lease: _Lease, first: bytes, chunks: AsyncIterator[bytes], start_s: float
    ) -> AsyncIterator[bytes]:
        status = "200"
        worker = lease.worker
        try:
            yield first
            last_s = time.perf_counter()
            try:
                async for chunk in chunks:
                    now_s = time.perf_counter()
                    self.metrics.observe_itl(worker.url, now_s - last_s)
                    last_s = now_s
                    yield chunk
            except (aiohttp.ClientError, TimeoutError) as exc:
                status = "stream_error"
                worker.breaker.record_failure()
                logger.warning("worker %s failed mid-stream: %s: %s", worker.name, type(exc).__name__, exc)
                yield stream_error_end(f"the worker failed mid-stream ({type(exc).__name__})")
        finally:
            lease.release()  # a client that left early also drops the worker's connection: the worker aborts
            self.metrics.requests.labels(worker.url, status).inc()
            self.metrics.observe_e2e(worker.url, time.perf_counter() - start_s)

    def _draining(self, worker: Worker) -> None:
        """The worker is shutting down: no new requests until its /health says it is back."""
        if worker.healthy is not False:
            logger.info("worker %s is draining: no new requests go to it", worker.name)
        worker.healthy = False

    async def _relay_tracked(self, lease: _Lease, pieces: AsyncIterator[bytes], call: Call) -> AsyncIterator[bytes]:
        """Relay a followed stream event by event; when its worker fails before the answer finished, resume it
        on another worker (at most ``max_retries`` times) and go on relaying that one."""
        tracker = call.tracker
        assert tracker is not None
        status = "200"
        worker = lease.worker
        tried = {worker.url}
        last_s = time.perf_counter()
        try:
            while True:
                buffer = SSEBuffer()
                failure = None
                try:
                    async for piece in pieces:
                        for data in buffer.feed(piece):
                            out = tracker.on_event(data)
                            if out:
                                now_s = time.perf_counter()
                                self.metrics.observe_itl(worker.url, now_s - last_s)
                                last_s = now_s
                                yield out
                        if tracker.done:
                            break
                    if not tracker.done:
                        failure = "the stream ended before [DONE]"
                except (aiohttp.ClientError, TimeoutError) as exc:
                    failure = f"{type(exc).__name__}: {exc}"
                except WorkerStreamFailed as exc:
                    failure = f"error event: {exc}"
                except (KeyError, TypeError, AttributeError, ValueError) as exc:  # an event of another shape
                    failure = f"a malformed event: {type(exc).__name__}: {exc}"
                if failure is None:
                    return
                lease.release()
                worker.breaker.record_failure()
                self.metrics.requests.labels(worker.url, "stream_error").inc()
                logger.warning("worker %s failed mid-stream: %s", worker.name, failure)
                if tracker.finished:  # only [DONE] was lost
                    yield b"data: [DONE]\n\n"
                    return
                resumed = await self._resume(call, tried, lease) if tracker.can_resume else None
                if resumed is None:
                    status = "stream_error"
                    self.metrics.migrations.labels("failed").inc()
                    yield stream_error_end(
                        f"the worker failed mid-stream ({failure}) and no other worker could resume it"
                    )
                    return
                pieces, catch_up = resumed
                worker = lease.worker
                self.metrics.migrations.labels("resumed").inc()
                logger.info(
                    "stream %s resumed on worker %s after %d tokens", tracker.id, worker.name, len(tracker.output_ids)
                )
                if catch_up:  # already in tracker.text
                    yield sse_event(tracker.chunk(catch_up))
        finally:
            lease.release()
            self.metrics.requests.labels(worker.url, status).inc()
            self.metrics.observe_e2e(worker.url, time.perf_counter() - call.start_s)

    async def _resume(self, call: Call, tried: set[str], lease: _Lease) -> tuple[AsyncIterator[bytes], str] | None:
        """Open the rest of ``call``'s answer on a worker not in ``tried`` (``lease`` then holds it): its
        stream and the text the failed worker held back; None when no worker could take it."""
        tracker = call.tracker
        assert tracker is not None and tracker.prompt_ids is not None
        if tracker.num_migrations >= self.config.max_retries + 1:
            return None
        for attempt in range(self.config.max_retries + 1):
            candidates = [w for w in self._routing_pool() if w.is_routable and w.url not in tried]
            if not candidates:
                return None
            if attempt:
                await asyncio.sleep(self._backoff_s(attempt))
            worker = self.policy.select(call.routing, candidates).worker
            tried.add(worker.url)
            catch_up = await self._held_back_text(worker, tracker)  # may drop a half character's tokens
            body = resume_body(tracker, call.body, await self._max_model_len(worker))
            if body is None:
                return None
            worker.in_flight += 1
            self.metrics.observe_sent(worker.url)
            worker.breaker.on_attempt()
            upstream: aiohttp.ClientResponse | None = None
            handed_over = False
            try:
                upstream = await self.session.post(
                    worker.url + "/v1/completions", data=json.dumps(body).encode(), headers=call.headers
                )
                if upstream.status != 200:
                    reason = _error_code(await _read_quietly(upstream)) or str(upstream.status)
                    raise _Refused(f"status {upstream.status} ({reason})", upstream.status)
                chunks = upstream.content.iter_any()
                first = await anext(chunks)
                worker.breaker.record_success()
                lease.hold(worker, upstream)
                handed_over = True
            except (aiohttp.ClientError, TimeoutError, StopAsyncIteration, _Refused) as exc:
                if not isinstance(exc, _Refused) or exc.status >= 500:
                    worker.breaker.record_failure()
                logger.warning("resuming a stream on worker %s failed: %s", worker.name, exc)
                if isinstance(exc, _Refused) and 400 <= exc.status < 500 and exc.status != 429:
                    return None  # the worker refuses the request itself: another would too
                continue
            finally:
                if not handed_over:  # failed, or cancelled (the client left): undo the count, drop the answer
                    worker.in_flight -= 1
                    if upstream is not None:
                        upstream.close()
            tracker.resume()
            if catch_up:
                tracker.text += catch_up
            return _prepend(first, chunks), catch_up
        return None

    async def _held_back_text(self, worker: Worker, tracker: StreamTracker) -> str:
        """Text of the tokens generated so far that the failed worker had not sent (see migrate.py). Tokens that
        end in half a character are dropped from ``tracker.output_ids`` first: the new worker generates them
        again, and the character comes out whole."""
        assert tracker.prompt_ids is not None
        tail = tracker.prompt_ids[-PROMPT_CONTEXT_TOKENS:]
        model = tracker.model
        context = await self._detokenize(worker, tail, model)
        for _ in range(MAX_PARTIAL_CHARACTER_TOKENS + 1):
            full = await self._detokenize(worker, tail + tracker.output_ids, model)
            if context is None or full is None:
                return ""
            if not full.endswith("\ufffd") or not tracker.output_ids:
                return held_back_text(tracker, context, full)
            tracker.output_ids.pop()
        return ""

    async def _max_model_len(self, worker: Worker) -> int | None:
        """The worker's context length, from its ``/v1/models`` card (splitserve's and vLLM's carry it)."""
        answer = await self.get_json(f"{worker.url}/v1/models")
        cards = answer.get("data") if isinstance(answer, dict) else None
        lengths = [c.get("max_model_len") for c in cards or [] if isinstance(c, dict)]
        return next((n for n in lengths if isinstance(n, int) and n > 0), None)

    async def _detokenize(self, worker: Worker, ids: list[int], model: str | None) -> str | None:
        try:
            timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
            body = {"tokens": ids} | ({"model": model} if model else {})
            async with self.session.post(f"{worker.url}/detokenize", json=body, timeout=timeout) as response:
                answer = await response.json() if response.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        text = answer.get("prompt") if isinstance(answer, dict) else None
        return text if isinstance(text, str) else None

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
            self.metrics.observe_e2e(worker.url, elapsed_s)
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
                async with self.session.post(worker.url + request.url.path, data=raw, headers=headers) as upstream:
                    content = await upstream.read()
            except (aiohttp.ClientError, TimeoutError):
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
            self._register(url, worker_id, meta or {})
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
        if self.events is not None:
            await self.events.aclose()
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


class _Lease:
    """A worker's in-flight count and its open response, released once: by the relay, or after the response
    when the client left before the relay ran."""

    def __init__(self, worker: Worker, upstream: aiohttp.ClientResponse) -> None:
        self.worker = worker
        self._upstream: aiohttp.ClientResponse | None = upstream
        worker.num_streaming += 1

    def hold(self, worker: Worker, upstream: aiohttp.ClientResponse) -> None:
        """Take over another worker's (already counted) request, after this one was released."""
        self.release()
        self.worker, self._upstream = worker, upstream
        worker.num_streaming += 1

    def release(self) -> None:
        if self._upstream is not None:
            self.worker.in_flight -= 1
            self.worker.num_streaming -= 1
            self._upstream.close()
            self._upstream = None


class _Refused(Exception):
    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _error_code(content: bytes) -> str | None:
    """The ``error.code`` of an OpenAI error body, if it is one."""
    try:
        error = json.loads(content).get("error")
    except (ValueError, AttributeError, RecursionError):
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return str(code) if code is not None else None


class _QueuedPrefill:
    """A request's uncached tokens, counted in its worker's queued prefill until the worker answers (or fails).
    The first answer of a stream also teaches the cost model the worker's seconds per prefill token."""

    def __init__(self, worker: Worker, tokens: int) -> None:
        self.worker = worker
        self.tokens = tokens
        self.ahead = worker.pending_prefill_tokens
        self.sent_s = time.perf_counter()
        worker.pending_prefill_tokens += tokens

    def answered(self, cost: PrefillCostModel | None) -> None:
        if self.tokens and cost is not None:
            cost.observe(self.worker.url, time.perf_counter() - self.sent_s, self.ahead + self.tokens)
        self.release()

    def release(self) -> None:
        self.worker.pending_prefill_tokens -= self.tokens
        self.tokens = 0


async def _prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for piece in rest:
        yield piece


async def _read_quietly(response: aiohttp.ClientResponse) -> bytes:
    try:
        return await response.read()
    except (aiohttp.ClientError, TimeoutError):
        return b""
    finally:
        response.release()


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

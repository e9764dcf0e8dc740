"""Sending a request to a worker and its answer back: the part of the router that both the plain proxy and the
disaggregator use (:class:`Forwarder`).

``forward`` asks the policy for a worker of a pool, sends the request's bytes unchanged through the
:class:`~splitserve.router.transport.Transport`, and passes the answer through. An answer is one of three
cases (``_try``): refused (a 429, a 5xx, a 503 ``draining``: try another worker), whole (a non-streamed answer,
or any answer that is not a 200 stream: passed back once read), or a stream (relayed as it comes). Failures
before anything reached the client are retried on another worker with jittered exponential back-off, at most
``max_retries`` times; the worker's breaker counts them (a 429, or a 503 ``draining``, is no fault: the second
takes the worker out of rotation until its ``/health`` answers 200 again). A stream the router follows
(:meth:`Forwarder.track`) is resumed on another worker when its worker dies mid-answer (``router/migrate.py``);
any other stream that breaks ends with an error event and ``[DONE]``. When no worker can take a request the
answer is a 503 with OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response, StreamingResponse

from splitserve import tracing
from splitserve.config import BackendKind, RouterConfig
from splitserve.errors import SplitserveError
from splitserve.httpserver import RESUMED_PROMPT_TOKENS_HEADER
from splitserve.metrics import RouterMetrics
from splitserve.protocol.errors import error_body
from splitserve.protocol.openai import sse_event, stream_error_end
from splitserve.router.cost import PrefillCostModel, QueuedPrefill
from splitserve.router.discovery import Worker, WorkerLease
from splitserve.router.hit_check import HitPredictionCheck
from splitserve.router.migrate import (
    PROMPT_CONTEXT_TOKENS,
    ChoiceTrack,
    SSEBuffer,
    StreamTracker,
    WorkerStreamFailed,
    calls_tools,
    echoed_text,
    held_back_text,
    requested_logprobs,
    resume_body,
    resume_chat_body,
    sends_prompt_logprobs,
)
from splitserve.router.policies import Decision, RoutingPolicy, RoutingRequest
from splitserve.router.transport import Transport, TransportError, Upstream

logger = logging.getLogger("splitserve.router")

MAX_PARTIAL_CHARACTER_TOKENS = 4  # a UTF-8 character spans at most 4 byte-level tokens
RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
# not forwarded to workers: hop-by-hop headers, and the client's key (the router sends its own credential)
NOT_FORWARDED = frozenset(
    {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade", "proxy-connection",
     "authorization"}
)  # fmt: skip


class RouterError(SplitserveError):
    """An answer with OpenAI's error body."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(str(self), self.status, code=self.code or self.status), status_code=self.status)


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


class Forwarder:
    """Sends calls to workers: retries, relays, and resumes followed streams. Every method runs on the loop.

    ``resume_pool`` gives the workers a broken stream may go on on (the backends, or the decode pool).
    """

    def __init__(
        self,
        config: RouterConfig,
        transport: Transport,
        metrics: RouterMetrics,
        policy: RoutingPolicy,
        resume_pool: Callable[[], list[Worker]],
        *,
        cost: PrefillCostModel | None = None,
        hit_check: HitPredictionCheck | None = None,
    ) -> None:
        self.config = config
        self.transport = transport
        self.metrics = metrics
        self.policy = policy
        self.resume_pool = resume_pool
        self.cost = cost
        self.hit_check = hit_check
        self._rng = random.Random()

    def track(self, call: Call, sent_text: str = "", sent_logprobs: int = 0) -> None:
        """Follow ``call``'s stream so that it can be resumed elsewhere: ask the worker for token ids.
        ``sent_text``: what the client already got of the answer (a disaggregated stream's first token), and
        ``sent_logprobs`` how many tokens' logprobs."""
        body = call.body
        options = body.get("stream_options")
        wants_usage = isinstance(options, dict) and options.get("include_usage") is True
        wants_ids = body.get("return_token_ids") is True
        n = body["n"] if isinstance(body.get("n"), int) else 1
        call.tracker = StreamTracker(
            call.path.endswith("/chat/completions"), wants_ids, wants_usage, num_choices=n,
            logprobs=requested_logprobs(call.path, body), echo=echoed_text(call.path, body),
            calls_tools=calls_tools(call.path, body), prompt_logprobs=sends_prompt_logprobs(call.path, body),
        )  # fmt: skip
        call.tracker.choices[0].text = call.tracker.answer_text(call.tracker.choices[0], sent_text)
        call.tracker.choices[0].num_logprobs = sent_logprobs
        if not wants_ids:
            call.raw = json.dumps(body | {"return_token_ids": True}).encode()

    async def get_json(self, url: str) -> Any:
        """The JSON of a 200 answer, or None for anything else (within ``--health-timeout``)."""
        return await self.transport.get_json(url, self.config.health_timeout_s)

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
            if first is not None and attempt == 0:
                decision = first  # the caller's span holds its choice
            else:
                with tracing.span("route") as span:
                    decision = self.policy.select(call.routing, candidates)
                    tracing.set_attributes(span, _decision_attributes(decision, attempt, self.config.routing_strategy))
            self._log_decision(decision, call.routing)
            result = await self._try(decision.worker, call, decision.uncached_tokens)
            if result.failure is None:
                assert result.response is not None
                if result.response.status_code == 200 and self.hit_check is not None:
                    self.hit_check.predicted(decision.worker.url, decision.matched_tokens)
                return result.response
            tried.add(decision.worker.url)
            last_failure = f"{decision.worker.name}: {result.failure}"
            self.metrics.retries.labels(result.failure.split(":", 1)[0]).inc()
            if result.response is not None and not any(w.is_routable and w.url not in tried for w in pool()):
                return result.response  # the last worker's own error answer (e.g. its 503)
        self.metrics.decision("no_worker")
        return RouterError(503, f"no worker could take the request ({last_failure})", "no_worker_available").response()

    def _backoff_s(self, attempt: int) -> float:
        base = self.config.retry_backoff_s * 2 ** (attempt - 1)
        return base * (0.5 + self._rng.random())

    # ---- one try: refused, whole, or streamed -------------------------------------------------------------

    async def _try(self, worker: Worker, call: Call, uncached_tokens: int = 0) -> _Attempt:
        """Send ``call`` to ``worker``; its ``uncached_tokens`` count as queued there until it answers."""
        attempt = _Attempt()
        lease = worker.lease(uncached_tokens)
        self.metrics.observe_sent(worker.url)
        queued = QueuedPrefill(lease)
        handed_over = False
        span_name = "decode" if "kv_transfer_params" in call.body else "upstream"
        try:
            with tracing.span(span_name, {"splitserve.worker": worker.url}, client=True) as span:
                try:
                    upstream = await self.transport.post(worker.url + call.path, call.raw, tracing.inject(call.headers))
                except TransportError as exc:
                    self._failed(worker, attempt, str(exc))
                    tracing.set_attributes(span, {"splitserve.failure": attempt.failure})
                    return attempt
                if upstream.status in RETRYABLE_STATUS:
                    await self._refused(worker, upstream, attempt)
                elif upstream.status != 200 or not call.is_stream:
                    await self._whole(worker, upstream, call, attempt)
                else:
                    handed_over = await self._stream(worker, upstream, call, queued, attempt)
                tracing.set_attributes(span, {"http.response.status_code": upstream.status,
                                              "splitserve.failure": attempt.failure})  # fmt: skip
            return attempt
        finally:
            queued.release()
            if not handed_over:
                lease.release()

    async def _refused(self, worker: Worker, upstream: Upstream, attempt: _Attempt) -> None:
        """A 429, 5xx or 503 ``draining``: another worker is tried; the answer is kept in case none can."""
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

    async def _whole(self, worker: Worker, upstream: Upstream, call: Call, attempt: _Attempt) -> None:
        """A non-streamed answer (or an error to a streamed request): read it, pass it back."""
        try:
            content = await upstream.read()
        except TransportError as exc:
            self._failed(worker, attempt, str(exc))
            return
        worker.breaker.record_success()
        self._answered(worker, upstream.status, call.routing, call.start_s)
        attempt.response = Response(content, upstream.status, media_type=upstream.content_type)

    async def _stream(
        self, worker: Worker, upstream: Upstream, call: Call, queued: QueuedPrefill, attempt: _Attempt
    ) -> bool:
        """A 200 stream: wait for its first chunk, then relay it (True: the relay now holds the worker)."""
        chunks = upstream.chunks()
        try:
            first = await anext(chunks)
        except (TransportError, StopAsyncIteration) as exc:
            upstream.close()
            self._failed(worker, attempt, f"read: {type(exc).__name__}")
            return False
        worker.breaker.record_success()
        # a completion's first chunk carries its first token; a chat's may be the role alone, sent at once
        queued.answered(self.cost if not call.path.endswith("/chat/completions") else None)
        if call.observe_ttft:
            self.metrics.ttft_s.observe(time.perf_counter() - call.start_s)
        self.policy.on_routed(call.routing, worker)
        lease = _Lease(queued.lease, upstream)  # released by the relay, or after the response if it never ran
        relay = (
            self._relay(lease, first, chunks, call.start_s)
            if call.tracker is None
            else self._relay_tracked(lease, _prepend(first, chunks), call)
        )
        headers = {"Cache-Control": "no-cache"}
        background = BackgroundTask(lease.release)
        attempt.response = StreamingResponse(
            relay, media_type=upstream.content_type, headers=headers, background=background
        )
        return True

    # ---- relays ----------------------------------------------------------------------------------------------

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
            except TransportError as exc:
                status = "stream_error"
                worker.breaker.record_failure()
                logger.warning("worker %s failed mid-stream: %s", worker.name, exc)
                yield stream_error_end(f"the worker failed mid-stream ({exc})")
        finally:
            lease.release()  # a client that left early also drops the worker's connection: the worker aborts
            self.metrics.requests.labels(worker.url, status).inc()
            self.metrics.observe_e2e(worker.url, time.perf_counter() - start_s)

    async def _relay_tracked(self, lease: _Lease, pieces: AsyncIterator[bytes], call: Call) -> AsyncIterator[bytes]:
        """Relay a followed stream event by event; when its worker fails before the answer finished, resume it
        on another worker (at most ``max_retries`` times) and go on relaying that one."""
        tracker = call.tracker
        assert tracker is not None
        status = "200"
        worker = lease.worker
        tried = {worker.url}
        last_s = time.perf_counter()
        events = _events(pieces)
        try:
            while True:
                failure = None
                try:
                    async for index, data in events:
                        out = tracker.on_event(data, index)
                        if out:
                            now_s = time.perf_counter()
                            self.metrics.observe_itl(worker.url, now_s - last_s)
                            last_s = now_s
                            yield out
                        if tracker.done:
                            break
                    if not tracker.done:
                        failure = "the stream ended before [DONE]"
                except TransportError as exc:
                    failure = str(exc)
                except WorkerStreamFailed as exc:
                    failure = f"error event: {exc}"
                except (KeyError, TypeError, AttributeError, ValueError) as exc:  # an event of another shape
                    failure = f"a malformed event: {type(exc).__name__}: {exc}"
                if failure is None:
                    return
                await events.aclose()  # stops the pumps of a merged stream
                lease.release()
                worker.breaker.record_failure()
                self.metrics.requests.labels(worker.url, "stream_error").inc()
                logger.warning("worker %s failed mid-stream: %s", worker.name, failure)
                if tracker.finished:  # only [DONE] was lost
                    yield tracker.end()
                    return
                resumed = await self._resume(call, tried, lease) if tracker.can_resume else None
                if resumed is None:
                    status = "stream_error"
                    self.metrics.migrations.labels("failed").inc()
                    yield stream_error_end(
                        f"the worker failed mid-stream ({failure}) and no other worker could resume it"
                    )
                    return
                events, preamble = resumed
                worker = lease.worker
                self.metrics.migrations.labels("resumed").inc()
                logger.info(
                    "stream %s resumed on worker %s after %d tokens (%d choices)",
                    tracker.id, worker.name, sum(len(c.output_ids) for c in tracker.choices), len(tracker.pending),
                )  # fmt: skip
                for out in preamble:  # held-back text, finishes that were lost
                    yield out
                if tracker.finished:
                    yield tracker.end()
                    return
        finally:
            lease.release()
            self.metrics.requests.labels(worker.url, status).inc()
            self.metrics.observe_e2e(worker.url, time.perf_counter() - call.start_s)

    # ---- migration -------------------------------------------------------------------------------------------

    async def _resume(
        self, call: Call, tried: set[str], lease: _Lease
    ) -> tuple[AsyncGenerator[tuple[int | None, str], None], list[bytes]] | None:
        """Open the rest of ``call``'s answer on a worker not in ``tried`` (``lease`` then holds it), one request
        per unfinished choice: their events, merged, and the chunks to send first (the text the failed worker held
        back, and the finish of a choice that has every token already); None when no worker could take it."""
        tracker = call.tracker
        assert tracker is not None and tracker.prompt_ids is not None
        if tracker.num_migrations >= self.config.max_retries + 1:
            return None
        for attempt in range(self.config.max_retries + 1):
            candidates = [w for w in self.resume_pool() if w.is_routable and w.url not in tried]
            if not candidates:
                return None
            if attempt:
                await asyncio.sleep(self._backoff_s(attempt))
            worker = self.policy.select(call.routing, candidates).worker
            tried.add(worker.url)
            attributes = {"splitserve.worker": worker.url, "splitserve.choices": len(tracker.unfinished()),
                          "splitserve.migration": tracker.num_migrations + 1}  # fmt: skip
            with tracing.span("resume", attributes, client=True):
                resumed = await self._resume_on(call, worker, tracker, lease)
            if isinstance(resumed, _Refused):
                return None  # the worker refuses the request itself: another would too
            if resumed is not None:
                return resumed
        return None

    async def _resume_on(
        self, call: Call, worker: Worker, tracker: StreamTracker, lease: _Lease
    ) -> tuple[AsyncGenerator[tuple[int | None, str], None], list[bytes]] | _Refused | None:
        """``_resume`` on one worker: the merged events and the preamble; a :class:`_Refused` when the worker
        refuses the request itself; None when another worker may do better."""
        unfinished = tracker.unfinished()
        assert tracker.prompt_ids is not None
        as_chat = tracker.is_chat and await self._is_splitserve(worker)
        if as_chat:  # the worker replays what the client has: nothing held back to recover here
            path = "/v1/chat/completions"
            catch_ups = {c.index: "" for c in unfinished}
            bodies = {c.index: resume_chat_body(tracker, c, call.body) for c in unfinished}
        elif tracker.calls_tools:
            return None  # tool calls are not text: a splitserve worker may take it
        else:
            path = "/v1/completions"
            tail = tracker.prompt_ids[-PROMPT_CONTEXT_TOKENS:]
            context = await self._detokenize(worker, tail, tracker.model)  # once: every choice follows it
            catch_ups = {c.index: await self._held_back_text(worker, tracker, c, context) for c in unfinished}
            max_model_len = await self._max_model_len(worker)
            bodies = {c.index: resume_body(tracker, c, call.body, max_model_len) for c in unfinished}
        resumed = {**tracing.inject(call.headers), RESUMED_PROMPT_TOKENS_HEADER: str(len(tracker.prompt_ids))}
        opened: dict[int, AsyncIterator[bytes]] = {}
        for index, body in bodies.items():
            if body is None:  # every token was generated; only the finish was lost
                continue
            stream = await self._open_resumed(worker, path, body, resumed, lease, keep=bool(opened))
            if stream is None or isinstance(stream, _Refused):
                lease.release()
                return stream
            opened[index] = stream
        preamble = []
        for choice in unfinished:
            choice.text += catch_ups[choice.index]
            if catch_ups[choice.index] or bodies[choice.index] is None:
                finish = "length" if bodies[choice.index] is None else None
                preamble.append(sse_event(tracker.chunk(catch_ups[choice.index], finish, index=choice.index)))
                choice.finished = finish is not None
        tracker.resume(as_chat)
        return _merged(opened), preamble

    async def _open_resumed(
        self,
        worker: Worker,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        lease: _Lease,
        keep: bool = False,
    ) -> AsyncIterator[bytes] | _Refused | None:
        """The resumed request's stream on ``worker`` (``lease`` now holds it; with ``keep``, beside what it
        holds); a :class:`_Refused` for a client error, which any worker would answer; None for a failure another
        worker may not have."""
        taken = worker.lease()
        self.metrics.observe_sent(worker.url)
        upstream: Upstream | None = None
        handed_over = False
        try:
            upstream = await self.transport.post(worker.url + path, json.dumps(body).encode(), headers)
            if upstream.status != 200:
                reason = _error_code(await _read_quietly(upstream)) or str(upstream.status)
                raise _Refused(f"status {upstream.status} ({reason})", upstream.status)
            chunks = upstream.chunks()
            first = await anext(chunks)
            worker.breaker.record_success()
            lease.hold(taken, upstream, keep=keep)
            handed_over = True
            return _prepend(first, chunks)
        except (TransportError, StopAsyncIteration, _Refused) as exc:
            if not isinstance(exc, _Refused) or exc.status >= 500:
                worker.breaker.record_failure()
            logger.warning("resuming a stream on worker %s failed: %s", worker.name, exc)
            if isinstance(exc, _Refused) and 400 <= exc.status < 500 and exc.status != 429:
                return exc
            return None
        finally:
            if not handed_over:  # failed, or cancelled (the client left): undo the count, drop the answer
                taken.release()
                if upstream is not None:
                    upstream.close()

    async def _held_back_text(
        self, worker: Worker, tracker: StreamTracker, choice: ChoiceTrack, context: str | None
    ) -> str:
        """Text of the tokens generated so far for ``choice`` that the failed worker had not sent (see
        migrate.py); ``context`` is the text of the prompt's last ``PROMPT_CONTEXT_TOKENS`` tokens. Tokens that
        end in half a character are dropped from its ``output_ids`` first: the new worker generates them again,
        and the character comes out whole."""
        assert tracker.prompt_ids is not None
        tail = tracker.prompt_ids[-PROMPT_CONTEXT_TOKENS:]
        for _ in range(MAX_PARTIAL_CHARACTER_TOKENS + 1):
            full = await self._detokenize(worker, tail + choice.output_ids, tracker.model)
            if context is None or full is None:
                return ""
            if not full.endswith("\ufffd") or not choice.output_ids:
                return held_back_text(choice, context, full)
            choice.output_ids.pop()
        return ""

    async def _is_splitserve(self, worker: Worker) -> bool:
        """Whether ``worker`` is a splitserve worker (``--backend-kind``, else its ``GET /version``)."""
        kind = self.config.backend_kind
        if kind == BackendKind.AUTO:
            kind = BackendKind.shown_by(await self.get_json(f"{worker.url}/version")) or BackendKind.AUTO
        return kind == BackendKind.SPLITSERVE

    async def _max_model_len(self, worker: Worker) -> int | None:
        """The worker's context length, from its ``/v1/models`` card (splitserve's and vLLM's carry it)."""
        answer = await self.get_json(f"{worker.url}/v1/models")
        cards = answer.get("data") if isinstance(answer, dict) else None
        lengths = [c.get("max_model_len") for c in cards or [] if isinstance(c, dict)]
        return next((n for n in lengths if isinstance(n, int) and n > 0), None)

    async def _detokenize(self, worker: Worker, ids: list[int], model: str | None) -> str | None:
        body = {"tokens": ids} | ({"model": model} if model else {})
        answer = await self.transport.post_json(f"{worker.url}/detokenize", body, self.config.health_timeout_s)
        text = answer.get("prompt") if isinstance(answer, dict) else None
        return text if isinstance(text, str) else None

    # ---- bookkeeping -----------------------------------------------------------------------------------------

    def _failed(self, worker: Worker, attempt: _Attempt, reason: str) -> None:
        attempt.failure = reason
        if worker.breaker.record_failure():
            logger.warning("circuit breaker opened for worker %s after: %s", worker.name, reason)
        self.metrics.requests.labels(worker.url, reason.split(":", 1)[0]).inc()

    def _draining(self, worker: Worker) -> None:
        """The worker is shutting down: no new requests until its /health says it is back."""
        if worker.healthy is not False:
            logger.info("worker %s is draining: no new requests go to it", worker.name)
        worker.healthy = False

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


class _Lease:
    """A relayed stream: its worker's lease and its open answer, released once: by the relay, or after the
    response when the client left before the relay ran."""

    def __init__(self, lease: WorkerLease, upstream: Upstream) -> None:
        self._lease = lease
        self._held: list[tuple[WorkerLease, Upstream]] = [(lease, upstream)]
        lease.stream()

    @property
    def worker(self) -> Worker:
        return self._lease.worker

    def hold(self, lease: WorkerLease, upstream: Upstream, keep: bool = False) -> None:
        """Take over another worker's (already counted) request, after what this held was released (with
        ``keep``: beside it, the resumed requests of a stream's other choices)."""
        if not keep:
            self.release()
        self._lease = lease
        self._held.append((lease, upstream))
        lease.stream()

    def release(self) -> None:
        held, self._held = self._held, []
        for lease, upstream in held:
            lease.release()
            upstream.close()


class _Refused(Exception):
    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _decision_attributes(decision: Decision, attempt: int, strategy: object) -> dict[str, Any]:
    return {
        "splitserve.strategy": str(strategy),
        "splitserve.worker": decision.worker.url,
        "splitserve.matched_tokens": decision.matched_tokens,
        "splitserve.uncached_tokens": decision.uncached_tokens,
        "splitserve.attempt": attempt,
    }


def _error_code(content: bytes) -> str | None:
    """The ``error.code`` of an OpenAI error body, if it is one."""
    try:
        error = json.loads(content).get("error")
    except (ValueError, AttributeError, RecursionError):
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return str(code) if code is not None else None


async def _prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for piece in rest:
        yield piece


async def _events(pieces: AsyncIterator[bytes]) -> AsyncGenerator[tuple[int | None, str], None]:
    """The SSE events' data of one stream (of every choice: no index)."""
    buffer = SSEBuffer()
    async for piece in pieces:
        for data in buffer.feed(piece):
            yield None, data


async def _merged(streams: dict[int, AsyncIterator[bytes]]) -> AsyncGenerator[tuple[int | None, str], None]:
    """The events of several streams as they come, each with its choice's index, until every stream ended. A
    stream that fails fails them all (the caller resumes what is unfinished); one that ends without its
    ``[DONE]`` leaves its choice pending, so the whole ends before ``[DONE]``, a failure too."""
    if len(streams) == 1:
        [(index, stream)] = streams.items()
        async for _, data in _events(stream):
            yield index, data
        return
    queue: asyncio.Queue[tuple[int, str | None] | BaseException] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[bytes]) -> None:
        try:
            async for _, data in _events(stream):
                await queue.put((index, data))
            await queue.put((index, None))
        except Exception as exc:  # handed to the reader, which raises it
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in streams.items()]
    try:
        for _ in range(len(tasks)):
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                choice, event = item
                if event is None:
                    break
                yield choice, event
    finally:
        for task in tasks:
            task.cancel()


async def _read_quietly(upstream: Upstream) -> bytes:
    try:
        return await upstream.read()
    except TransportError:
        return b""

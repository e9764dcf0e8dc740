"""The asyncio front of the engine: one engine thread, per-request output queues, cancellation -> abort.

The event loop never calls ``LLMEngine`` methods (the engine is not thread-safe). It sends commands (add,
abort, shutdown) through a thread-safe queue; the engine thread drains that queue before each step and
blocks on it when it has no work, so an idle worker uses no CPU. After each step the thread hands the step's
outputs to the loop with ``loop.call_soon_threadsafe``; the loop routes them to per-request
``asyncio.Queue`` s and observes the latency metrics. Torch releases the GIL inside its kernels, so the loop
stays responsive while the engine computes.

Failure contract: if the engine thread raises (while loading or stepping), every in-flight request ends with
:class:`EngineDeadError` instead of hanging, new requests are refused with it, and ``is_healthy`` turns false.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from splitserve import tracing
from splitserve.engine.outputs import FinishReason, RequestOutput
from splitserve.engine.sampling_params import SamplingParams, StructuredOutput
from splitserve.errors import SplitserveError
from splitserve.metrics import FINISHED_ERROR, EngineStatsLike, FinishedRequest, WorkerMetrics
from splitserve.model.tokenizer import TokenizerLike
from splitserve.policy.admission import NO_LIMITS, AdmissionLimits, Backlog, refusal

logger = logging.getLogger(__name__)


class EngineCore(Protocol):
    """The synchronous engine (``splitserve.engine.engine.LLMEngine``); every call from one thread."""

    @property
    def tokenizer(self) -> TokenizerLike | None: ...  # None: a test model without a tokenizer

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def kv_capacity_tokens(self) -> int: ...  # the tokens the KV cache holds

    @property
    def cache_config_info(self) -> Mapping[str, str]: ...  # the labels of vllm:cache_config_info

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def get_stats(self) -> EngineStatsLike: ...

    def check_structured(self, spec: StructuredOutput) -> None: ...  # any thread; ValueError when invalid

    def lookup_prefix(
        self, prompt_token_ids: list[int], cache_salt: str | None = None
    ) -> dict[str, int]: ...  # any thread

    def kv_transfer_info(self) -> dict[str, Any] | None: ...  # decode role: the KV receiver; any thread

    def close(self) -> None: ...  # release what the engine holds outside the process (KV tier connections)


class EngineDeadError(SplitserveError, RuntimeError):
    """The engine thread has stopped (it failed, or the worker is shutting down)."""


class EngineNotReadyError(SplitserveError, RuntimeError):
    """The model is still loading."""


class QueueFullError(SplitserveError, RuntimeError):
    """An admission bound is reached (``policy.admission``): try again shortly, or elsewhere (a 429)."""


@dataclass(slots=True)
class _AddCommand:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    accepted: Future[float]  # result: clock time the engine took it; exception: the engine's ValueError


@dataclass(slots=True)
class _AbortCommand:
    request_id: str


class _ShutdownCommand:
    pass


_Command = _AddCommand | _AbortCommand | _ShutdownCommand


@dataclass(slots=True)
class _RequestState:
    """Loop-side bookkeeping of one in-flight request."""

    arrival_s: float
    max_tokens: int
    outputs: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    first_token_s: float | None = None
    last_token_s: float | None = None
    span: Any = None  # the request's trace span (tracing on), for its engine phases


class RequestStream:
    """The outputs of one accepted request, in order, ending with the finished one.

    Iterate it with ``async for``; raises :class:`EngineDeadError` if the engine dies meanwhile. ``close()``
    (or ``aclose()``) before the last output aborts the request in the engine, freeing its KV blocks; it is
    idempotent and a no-op once finished. Always close it (``try/finally``) when consuming may be cut short.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, state: _RequestState) -> None:
        self.request_id = request_id
        self._engine = engine
        self._state = state
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._state.outputs.get()
        if isinstance(item, BaseException):
            self._done = True
            self._engine.release(self.request_id, abort=False)
            raise item
        if item.finished:
            self._done = True
            self._engine.release(self.request_id, abort=False)
        return item

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._engine.release(self.request_id, abort=True)

    async def aclose(self) -> None:
        self.close()


class AsyncEngine:
    """Owns an engine (built by ``engine_factory`` on the engine thread) and the thread that runs it.

    Call ``start()`` from the event loop that will call ``submit``/``generate``; ``shutdown()`` from anywhere.
    ``clock`` returns seconds (monotonic); tests inject one.
    """

    def __init__(
        self,
        engine_factory: Callable[[], EngineCore],
        metrics: WorkerMetrics,
        clock: Callable[[], float] = time.monotonic,
        limits: AdmissionLimits = NO_LIMITS,
    ) -> None:
        """``limits``: the bounds past which ``admit`` refuses new requests with :class:`QueueFullError`."""
        self._factory = engine_factory
        self.limits = limits
        self.metrics = metrics
        self._clock = clock
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders "dead" against command submission
        self._settled = threading.Event()  # set once the engine is loaded, or the thread died
        self._states: dict[str, _RequestState] = {}
        self._engine: EngineCore | None = None
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # what is ahead of a new request: published by the engine thread (one object, replaced whole), plus what
        # the loop has handed over that the engine has not taken yet
        self._backlog = Backlog()
        self._handing_over = (0, 0)  # requests, prompt tokens

    # ---- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread, which loads the engine and then serves commands. Non-blocking."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() called twice")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._thread_main, name="engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread; in-flight requests end with :class:`EngineDeadError`."""
        self._commands.put(_ShutdownCommand())
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    async def wait_until_ready(self, timeout_s: float | None = None) -> None:
        """Return once the engine is loaded; raise :class:`EngineDeadError` if loading failed."""
        if not await asyncio.to_thread(self._settled.wait, timeout_s):
            raise TimeoutError(f"engine not ready after {timeout_s} s")
        if self._error is not None:
            raise EngineDeadError(f"engine failed: {self._error!r}") from self._error

    def join(self, timeout_s: float | None = None) -> None:
        """Block until the engine thread ended (shut down or died)."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def was_ready(self) -> bool:
        """True once the engine had loaded, even if it died since."""
        return self._engine is not None

    def wait_settled(self, timeout_s: float | None = None) -> bool:
        """Block until the engine loaded or the thread died (check ``error``); False on timeout."""
        return self._settled.wait(timeout_s)

    @property
    def is_started(self) -> bool:
        return self._thread is not None

    @property
    def is_ready(self) -> bool:
        """True once the engine is loaded, until it dies or shuts down."""
        return self._engine is not None and self._error is None

    @property
    def is_healthy(self) -> bool:
        return self.is_ready and self._thread is not None and self._thread.is_alive()

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def engine(self) -> EngineCore:
        """The loaded engine, for its read-only attributes (tokenizer, model_name, max_model_len) only."""
        if self._error is not None:
            raise EngineDeadError(f"engine failed: {self._error!r}")
        if self._engine is None:
            raise EngineNotReadyError("the model is still loading")
        return self._engine

    @property
    def num_in_flight(self) -> int:
        return len(self._states)

    # ---- requests (event loop side) --------------------------------------------------------------------

    @property
    def backlog(self) -> Backlog:
        """What a new request finds ahead of it: the engine's last account plus the requests on their way to it."""
        requests, tokens = self._handing_over
        return self._backlog.added(requests, tokens)

    def admit(self, num_sequences: int = 1) -> None:
        """Raise :class:`QueueFullError` when an admission bound is reached (``policy.admission``); call it once per
        request, before submitting its sequences. Raises as ``submit`` does while the engine loads or is dead."""
        self.engine  # noqa: B018 -- raises when not ready or dead: a 503, not a 429
        refused = refusal(self.limits, self.backlog, num_sequences, time.monotonic())
        if refused is not None:
            self.metrics.observe_admission_rejected(refused.reason)
            raise QueueFullError(refused.message)

    async def submit(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> RequestStream:
        """Add a request and wait until the engine accepted it.

        Raises ``ValueError`` when the engine rejects it (a client mistake: empty or too long prompt, bad
        token id, duplicate id), :class:`EngineNotReadyError` while loading, :class:`EngineDeadError` if the
        engine stopped. If the caller is cancelled while waiting, the request is aborted.
        """
        self.engine  # noqa: B018 -- raises when not ready or dead
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in flight")
        state = _RequestState(arrival_s=self._clock(), max_tokens=params.max_tokens, span=tracing.current())
        accepted: Future[float] = Future()
        self._states[request_id] = state
        to_compute = 0 if params.kv_transfer_expected else len(prompt_token_ids)
        self._hand_over(1, to_compute)
        try:
            self._send(_AddCommand(request_id, list(prompt_token_ids), params, accepted))
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            self.release(request_id, abort=True)
            raise
        except BaseException:
            self.release(request_id, abort=False)
            raise
        finally:
            self._hand_over(-1, -to_compute)
        return RequestStream(self, request_id, state)

    def _hand_over(self, requests: int, tokens: int) -> None:
        held_requests, held_tokens = self._handing_over
        self._handing_over = (held_requests + requests, held_tokens + tokens)

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """``submit`` then yield every output; stopping the iteration early aborts the request."""
        stream = await self.submit(prompt_token_ids, params, request_id)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    async def abort(self, request_id: str) -> None:
        """Abort an in-flight request; its stream ends without a final output. No-op if unknown."""
        if request_id in self._states:
            self.release(request_id, abort=True)

    def _send(self, command: _Command) -> None:
        with self._lock:
            if self._error is not None:
                raise EngineDeadError(f"engine failed: {self._error!r}")
            self._commands.put(command)

    def release(self, request_id: str, *, abort: bool) -> None:
        """Drop a request's stream state; ``abort`` also aborts it in the engine (its stream was cut short)."""
        if self._states.pop(request_id, None) is None or not abort:
            return
        self.metrics.observe_finished(FinishReason.ABORT.value)
        with contextlib.suppress(EngineDeadError):  # a dead engine has nothing left to free
            self._send(_AbortCommand(request_id))

    def _deliver(self, outputs: list[RequestOutput], step_end_s: float) -> None:
        """Loop thread: route one step's outputs to their requests and observe latencies."""
        for output in outputs:
            state = self._states.get(output.request_id)
            if state is None:
                continue  # aborted meanwhile
            self._observe(state, output, step_end_s)
            state.outputs.put_nowait(output)
            if output.finished:  # the stream keeps its state; the engine has already let go of the request
                del self._states[output.request_id]

    def _observe(self, state: _RequestState, output: RequestOutput, now_s: float) -> None:
        m = self.metrics
        num_new = len(output.new_token_ids)
        if num_new > 0:
            if state.first_token_s is None:
                state.first_token_s = now_s
                m.observe_first_token(now_s - state.arrival_s, output.num_prompt_tokens,
                                      dict(output.cached_tokens_by_source))  # fmt: skip
            elif state.last_token_s is not None:
                m.itl_s.observe((now_s - state.last_token_s) / num_new)
            state.last_token_s = now_s
            m.generation_tokens.inc(num_new)
        if output.finished:
            finished = _finished(state, output, now_s)
            m.observe_finished_request(finished)
            if state.span is not None:
                _trace_phases(state.span, output, finished)

    def _fail_all(self, error: BaseException) -> None:
        """Loop thread: end every in-flight request with ``error``."""
        for state in self._states.values():
            state.outputs.put_nowait(error)
            self.metrics.observe_finished(FINISHED_ERROR)
        self._states.clear()

    # ---- engine thread ---------------------------------------------------------------------------------

    def _thread_main(self) -> None:
        try:
            engine = self._factory()
            self.metrics.engine_ready(engine.max_model_len, engine.cache_config_info)
            self._engine = engine
            self._settled.set()
            logger.info("engine ready: model %s, max_model_len %d", engine.model_name, engine.max_model_len)
            try:
                self._serve(engine)
            finally:
                engine.close()
        except BaseException as exc:  # the thread must never die silently
            logger.exception("engine thread failed")
            self._die(exc)
        else:
            self._die(EngineDeadError("the engine was shut down"))

    def _serve(self, engine: EngineCore) -> None:
        """Until shutdown: drain commands (block when idle), step, send outputs to the loop, publish stats."""
        while True:
            commands = self._take_commands(block=not engine.has_unfinished_requests())
            if not self._apply(engine, commands):
                return
            if engine.has_unfinished_requests():
                outputs = engine.step()
                if outputs:
                    self._to_loop(self._deliver, outputs, self._clock())
            stats = engine.get_stats()
            self._backlog = stats.backlog
            self.metrics.set_engine_stats(stats)

    def _take_commands(self, block: bool) -> list[_Command]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, engine: EngineCore, commands: list[_Command]) -> bool:
        """Apply commands in order; False on shutdown (commands after it are dropped by ``_die``)."""
        for command in commands:
            if isinstance(command, _ShutdownCommand):
                return False
            if isinstance(command, _AbortCommand):
                engine.abort_request(command.request_id)
                continue
            try:
                engine.add_request(command.request_id, command.prompt_token_ids, command.params)
            except ValueError as exc:
                command.accepted.set_exception(exc)
            else:  # counted as the engine's before the loop stops counting it as handed over
                pushed = command.params.kv_transfer_expected
                self._backlog = self._backlog.added(1, 0 if pushed else len(command.prompt_token_ids))
                command.accepted.set_result(self._clock())
        return True

    def _die(self, error: BaseException) -> None:
        """Mark the engine dead, refuse queued adds, and end every in-flight request with an error."""
        dead = error if isinstance(error, EngineDeadError) else EngineDeadError(f"engine failed: {error!r}")
        dead.__cause__ = None if dead is error else error
        with self._lock:
            self._error = dead
        self._settled.set()
        for command in self._take_commands(block=False):
            if isinstance(command, _AddCommand) and not command.accepted.done():
                command.accepted.set_exception(dead)
        self._to_loop(self._fail_all, dead)

    def _to_loop(self, callback: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed between the check and the call
            loop.call_soon_threadsafe(callback, *args)


def _trace_phases(span: Any, output: RequestOutput, finished: FinishedRequest) -> None:
    """The request's engine phases as spans under its request span, and what it computed and found cached."""
    cached = {f"splitserve.cached_tokens.{source}": n for source, n in output.cached_tokens_by_source if n}
    tracing.set_attributes(span, {
        "splitserve.request_id": output.request_id,
        "splitserve.prompt_tokens": output.num_prompt_tokens,
        "splitserve.output_tokens": output.num_output_tokens,
        "splitserve.cached_tokens": output.num_cached_tokens,
        "splitserve.finish_reason": finished.finish_reason,
        **cached,
    })  # fmt: skip
    phases = finished.phases
    if phases is None:
        return
    end = time.time_ns()
    decode_start = tracing.ago_ns(phases.decode_s, end)
    prefill_start = tracing.ago_ns(phases.prefill_s, decode_start)
    queue_start = tracing.ago_ns(phases.queued_s, prefill_start)
    tracing.record(span, "queue", queue_start, prefill_start)
    tracing.record(span, "prefill", prefill_start, decode_start,
                   {"splitserve.prompt_tokens": output.num_prompt_tokens, **cached,
                    "splitserve.preemptions": phases.num_preemptions})  # fmt: skip
    tracing.record(span, "decode", decode_start, end, {"splitserve.output_tokens": output.num_output_tokens})


def _finished(state: _RequestState, output: RequestOutput, now_s: float) -> FinishedRequest:
    """The metrics' record of a request the engine finished."""
    return FinishedRequest(
        finish_reason=(output.finish_reason or FinishReason.STOP).value,
        e2e_s=now_s - state.arrival_s,
        num_prompt_tokens=output.num_prompt_tokens,
        num_generation_tokens=output.num_output_tokens,
        num_cached_tokens=output.num_cached_tokens,
        max_tokens=state.max_tokens,
        phases=output.timing,
    )

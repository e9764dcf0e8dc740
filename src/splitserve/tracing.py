"""Traces across every hop (router, prefill worker, KV push, decode worker, resumed streams), as OpenTelemetry spans
exported over OTLP/HTTP when ``--otlp-traces-endpoint`` is set (vLLM's flag), with W3C ``traceparent`` propagated.

- **Off** (the default): nothing of OpenTelemetry is imported; :func:`span` returns one shared
  ``nullcontext`` and :func:`inject` returns the headers it was given. The cost is a global's test per call site.
- **On**: :func:`configure` sets a ``TracerProvider`` (service ``splitserve-router`` or ``splitserve-worker``, its
  instance id) with a batching OTLP/HTTP exporter. :class:`TraceMiddleware` opens a server span for each request,
  a child of the client's ``traceparent`` when it sends one, and makes it current for the whole request,
  streamed body included. Code below it opens child spans with :func:`span` and passes the context on to the next
  hop with :func:`inject`. Spans whose times are known only afterwards (an engine request's queue, prefill and
  decode; a KV push) are written with :func:`record`.

The exporter posts protobuf to ``<endpoint>/v1/traces`` (an endpoint given with that path is used as is), the
OpenTelemetry Collector's default OTLP/HTTP receiver (port 4318). Its batches follow the SDK's ``OTEL_BSP_*``
environment variables.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from contextlib import AbstractContextManager
from typing import Any

_tracer: Any = None  # an opentelemetry Tracer once configure() ran with an endpoint
_NOTHING: AbstractContextManager[None] = contextlib.nullcontext()
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector endpoint (``http://host:4318`` or the full ``.../v1/traces``)."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else f"{endpoint}/v1/traces"


def configure(endpoint: str | None, service: str, instance: str | None = None) -> None:
    """Export spans to ``endpoint`` (None: tracing stays off and costs nothing)."""
    global _tracer
    if endpoint is None:
        return
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {"service.name": service, **({"service.instance.id": instance} if instance else {})}
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
    trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer("splitserve")


def shutdown() -> None:
    """Send the spans still buffered (on the way out)."""
    if _tracer is None:
        return
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()


def enabled() -> bool:
    return _tracer is not None


def span(name: str, attributes: Mapping[str, Any] | None = None, client: bool = False) -> AbstractContextManager[Any]:
    """A child span of the current one, current while the ``with`` block runs (a no-op when tracing is off).
    ``client``: a call to another process, whose context :func:`inject` passes on."""
    if _tracer is None:
        return _NOTHING
    from opentelemetry.trace import SpanKind

    kind = SpanKind.CLIENT if client else SpanKind.INTERNAL
    return _tracer.start_as_current_span(name, kind=kind, attributes=_clean(attributes))


def inject(headers: dict[str, str]) -> dict[str, str]:
    """``headers`` with the current span's ``traceparent`` (and ``tracestate``), a copy; the same dict when off."""
    if _tracer is None:
        return headers
    from opentelemetry.propagate import inject as propagate

    out = {k: v for k, v in headers.items() if k.lower() not in ("traceparent", "tracestate")}
    propagate(out)
    return out


def current() -> Any:
    """The current span (to add attributes to, or to :func:`record` children under later), or None when off."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    return trace.get_current_span()


def set_attributes(target: Any, attributes: Mapping[str, Any]) -> None:
    """Add ``attributes`` to the span ``target`` (from :func:`current`); nothing when it is None."""
    if target is not None:
        target.set_attributes(_clean(attributes))


def record(parent: Any, name: str, start_ns: int, end_ns: int, attributes: Mapping[str, Any] | None = None) -> None:
    """A finished span under ``parent`` (from :func:`current`) from ``start_ns`` to ``end_ns`` (``time.time_ns``
    clock); nothing when ``parent`` is None."""
    if parent is None or _tracer is None:
        return
    from opentelemetry import trace

    context = trace.set_span_in_context(parent)
    child = _tracer.start_span(name, context=context, start_time=start_ns, attributes=_clean(attributes))
    child.end(end_time=max(end_ns, start_ns))


def ago_ns(seconds: float, now_ns: int | None = None) -> int:
    """``time.time_ns()`` of ``seconds`` ago."""
    return (time.time_ns() if now_ns is None else now_ns) - int(seconds * 1e9)


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """What OpenTelemetry takes as attributes: strings, booleans, numbers (None values left out)."""
    if not attributes:
        return None
    return {k: v if isinstance(v, str | bool | int | float) else str(v) for k, v in attributes.items() if v is not None}


class TraceMiddleware:
    """ASGI: each HTTP request under a server span named ``<method> <path>``, a child of the client's
    ``traceparent``; the span is current for the whole request (its streamed body included) and carries its
    status. Add it only when tracing is on. Only the inference routes are traced (``/v1/...``, SageMaker's
    ``/invocations``): probes, metrics, the KV event polls and the admin routes are not."""

    TRACED = ("/v1/", "/invocations")

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _tracer is None or not str(scope.get("path", "")).startswith(self.TRACED):
            await self.app(scope, receive, send)
            return
        from opentelemetry.propagate import extract
        from opentelemetry.trace import SpanKind, Status, StatusCode

        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
        name = f"{scope.get('method', 'GET')} {scope.get('path', '')}"
        with _tracer.start_as_current_span(name, context=extract(carrier), kind=SpanKind.SERVER) as server:

            async def traced_send(message: MutableMapping[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                    server.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        server.set_status(Status(StatusCode.ERROR))
                await send(message)

            await self.app(scope, receive, traced_send)


def with_tracing(app: ASGIApp) -> ASGIApp:
    """``app`` under :class:`TraceMiddleware` when tracing is on, else ``app`` itself."""
    return TraceMiddleware(app) if _tracer is not None else app

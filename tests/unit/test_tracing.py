"""Tracing off costs nothing and changes nothing; the exporter's URL is the collector's OTLP/HTTP traces path (with
tracing on, against a real receiver: tests/e2e/test_tracing_e2e.py)."""

from __future__ import annotations

import subprocess
import sys

from splitserve import tracing


def test_off_every_call_is_a_no_op_that_returns_what_it_was_given() -> None:
    assert not tracing.enabled()
    headers = {"authorization": "Bearer k"}
    assert tracing.inject(headers) is headers
    with tracing.span("route", {"a": 1}) as span:
        assert span is None
    assert tracing.span("a") is tracing.span("b")  # one shared null context: nothing is built per call
    assert tracing.current() is None
    tracing.set_attributes(None, {"a": 1})
    tracing.record(None, "queue", 0, 1)
    app = object()
    assert tracing.with_tracing(app) is app  # type: ignore[arg-type]


def test_off_nothing_of_opentelemetry_is_imported() -> None:
    code = (
        "import sys; from splitserve import tracing; tracing.configure(None, 'x'); "
        "import splitserve.router.app, splitserve.router.forward; "
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_endpoint_is_the_collectors_otlp_http_traces_path() -> None:
    assert tracing.traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert tracing.traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert tracing.traces_url("https://c.example/v1/traces") == "https://c.example/v1/traces"

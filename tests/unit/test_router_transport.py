"""The router's one transport and its composition root: the aiohttp transport and the in-memory one answer
alike (status, body, cut-off, timeouts, refusals, streams, small JSON); the health checker and the scraper
read workers through it; ``build_router`` builds the parts the config asks for, and every request the built
router makes goes through the transport it was given."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import ExitStack

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from splitserve.config import RouterConfig, RoutingStrategy
from splitserve.metrics import WorkerMetrics, sum_samples
from splitserve.router.build import build_router
from splitserve.router.discovery import Worker
from splitserve.router.health import HealthChecker
from splitserve.router.transport import AiohttpTransport, Transport, TransportError
from tests.support.fake_engine import FakeStats, ServerThread
from tests.support.router import MemoryWorker, completion, start_router_in_memory
from tests.support.transport import InMemoryTransport, handler_app, no_sockets
from tests.support.waiting import wait_until
from tests.support.workers import free_port

W = "http://worker:8000"
PAGE_BYTES = 64 * 1024  # a streamed page, in 1 KiB parts


async def _page(_: Request) -> Response:
    async def parts() -> AsyncIterator[bytes]:
        for i in range(64):
            yield bytes([65 + i % 26]) * 1024
            await asyncio.sleep(0)

    return StreamingResponse(parts(), media_type="text/plain")


async def _slow(_: Request) -> Response:
    await asyncio.sleep(1)  # past every timeout asked for here
    return Response()


async def _stream(_: Request) -> Response:
    async def events() -> AsyncIterator[bytes]:
        for i in range(3):
            yield f"data: {i}\n\n".encode()

    return StreamingResponse(events(), media_type="text/event-stream")


async def _echo(request: Request) -> Response:
    return JSONResponse({"got": await request.json()})


WORKER = Starlette(
    routes=[
        Route("/json", lambda _: JSONResponse({"a": 1})),
        Route("/text", lambda _: PlainTextResponse("not json")),
        Route("/page", _page),
        Route("/slow", _slow),
        Route("/stream", _stream, methods=["POST"]),
        Route("/echo", _echo, methods=["POST"]),
    ]
)


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


@pytest.fixture(params=["aiohttp", "in-memory"])
def served(request: pytest.FixtureRequest, stack: ExitStack) -> tuple[Callable[[], Transport], str, str]:
    """A transport maker (made on the test's loop), the worker's URL, and a URL where nothing answers."""
    if request.param == "in-memory":
        return (lambda: InMemoryTransport({W: WORKER})), W, "http://nobody:8000"
    url = stack.enter_context(ServerThread(WORKER)).url
    return (lambda: AiohttpTransport(1.0, 5.0, {})), url, f"http://127.0.0.1:{free_port()}"


def run_with(make: Callable[[], Transport], test: Callable[[Transport], Awaitable[None]]) -> None:
    async def main() -> None:
        transport = make()
        try:
            await test(transport)
        finally:
            await transport.aclose()

    asyncio.run(main())


class TestEitherTransport:
    def test_a_get_gives_the_status_and_the_body_cut_off_at_max_bytes(
        self, served: tuple[Callable[[], Transport], str, str]
    ) -> None:
        make, url, _ = served

        async def test(transport: Transport) -> None:
            answer = await transport.get(f"{url}/json", 2.0)
            assert (answer.status, answer.json()) == (200, {"a": 1})
            assert answer.content_type.startswith("application/json")
            assert (await transport.get(f"{url}/missing", 2.0)).status == 404
            whole = await transport.get(f"{url}/page", 2.0)
            assert len(whole.body) == PAGE_BYTES
            cut = await transport.get(f"{url}/page", 2.0, max_bytes=PAGE_BYTES // 2 + 10)
            assert cut.body == whole.body[: PAGE_BYTES // 2 + 10]  # every part up to the cap, not only the first
            with pytest.raises(ValueError):
                (await transport.get(f"{url}/text", 2.0)).json()

        run_with(make, test)

    def test_a_worker_that_is_not_there_or_too_slow_is_a_transport_error(
        self, served: tuple[Callable[[], Transport], str, str]
    ) -> None:
        make, url, nobody = served

        async def test(transport: Transport) -> None:
            with pytest.raises(TransportError) as refused:
                await transport.get(f"{nobody}/health", 2.0)
            assert refused.value.kind == "ClientConnectorError"
            assert str(refused.value).startswith("ClientConnectorError: ")
            with pytest.raises(TransportError) as slow:
                await transport.get(f"{url}/slow", 0.2)
            assert slow.value.kind == "TimeoutError"
            with pytest.raises(TransportError, match=r"^connect: "):
                await transport.post(f"{nobody}/v1/completions", b"{}", {})
            assert await transport.get_json(f"{nobody}/v1/models", 2.0) is None

        run_with(make, test)

    def test_a_post_streams_and_small_json_questions_take_json_answers_only(
        self, served: tuple[Callable[[], Transport], str, str]
    ) -> None:
        make, url, _ = served

        async def test(transport: Transport) -> None:
            upstream = await transport.post(f"{url}/stream", b"{}", {})
            assert (upstream.status, upstream.content_type) == (200, "text/event-stream; charset=utf-8")
            assert b"".join([part async for part in upstream.chunks()]) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
            upstream.close()
            assert await transport.get_json(f"{url}/json", 2.0) == {"a": 1}
            assert await transport.get_json(f"{url}/text", 2.0) is None  # not a JSON answer
            assert await transport.post_json(f"{url}/echo", {"tokens": [1]}, 2.0) == {"got": {"tokens": [1]}}

        run_with(make, test)


# ---- the router's clients over the in-memory transport (no socket) --------------------------------------------


@pytest.fixture
def _no_sockets(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with no_sockets(monkeypatch):
        yield


@pytest.mark.usefixtures("_no_sockets")
def test_probes_mark_a_worker_down_and_back_up(caplog: pytest.LogCaptureFixture) -> None:
    answers = [200]

    async def health(_: Request) -> Response:
        return Response(status_code=answers[-1])

    transport = InMemoryTransport({W: handler_app(health)})
    worker = Worker(W)
    checker = HealthChecker(lambda: [worker], transport, failure_threshold=2, success_threshold=1)

    async def probes() -> list[bool | None]:
        seen = []
        for answer in (200, 503, 503, 200):
            answers.append(answer)
            await checker.probe_all()
            seen.append(worker.healthy)
        transport.apps.clear()  # the worker is gone: its connection is refused
        for _ in range(2):
            await checker.probe_all()
            seen.append(worker.healthy)
        await transport.aclose()
        return seen

    with caplog.at_level(logging.INFO, logger="splitserve.router"):
        assert asyncio.run(probes()) == [True, True, False, True, True, False]
    assert f"worker {W} is unhealthy: HTTP 503" in caplog.messages
    assert caplog.messages.count(f"worker {W} is healthy") == 2
    assert caplog.messages[-1].startswith(f"worker {W} is unhealthy: ClientConnectorError")


@pytest.mark.usefixtures("_no_sockets")
def test_the_scrape_reads_each_workers_metrics_page_and_forgets_a_silent_one() -> None:
    page = WorkerMetrics("m")
    page.set_engine_stats(FakeStats(prefix_cache_queries=100, prefix_cache_hits=40))

    async def metrics(_: Request) -> Response:
        return Response(page.render(), media_type="text/plain")

    transport = InMemoryTransport({W: handler_app(metrics)})
    router = build_router(RouterConfig(model="m", backends=(W,)), transport=transport)

    async def scrapes() -> tuple[str, str]:
        await router.scraper.scrape_all()
        scraped = router.metrics.render().decode()
        transport.apps.clear()
        await router.scraper.scrape_all()
        await router.aclose()
        return scraped, router.metrics.render().decode()

    scraped, after = asyncio.run(scrapes())
    assert sum_samples(scraped, "vllm:gpu_prefix_cache_hits_total", server=W) == 40
    assert sum_samples(scraped, "vllm:gpu_prefix_cache_queries_total", server=W) == 100
    assert "vllm:gpu_prefix_cache_hits_total{" not in after


# ---- build_router ----------------------------------------------------------------------------------------------


def test_build_router_builds_the_parts_the_config_asks_for() -> None:
    transport = InMemoryTransport()
    plain = build_router(RouterConfig(model="m", backends=(W,)), transport=transport)
    assert plain.transport is transport and plain.forwarder.transport is transport
    assert plain.events is None and plain.disagg is None
    assert [w.url for w in plain.forwarder.resume_pool()] == [W]
    kvaware = build_router(RouterConfig(model="m", backends=(W,), routing_strategy=RoutingStrategy.KVAWARE))
    assert kvaware.events is not None and isinstance(kvaware.transport, AiohttpTransport)
    split = build_router(RouterConfig(model="m", prefill=("http://p:8000",), decode=("http://d:8000",)))
    assert split.disagg is not None and [w.url for w in split.forwarder.resume_pool()] == ["http://d:8000"]
    with pytest.raises(ValueError, match="--backend"):
        build_router(RouterConfig(model="m"))


@pytest.mark.usefixtures("_no_sockets")
def test_every_request_the_built_router_makes_goes_through_its_transport(stack: ExitStack) -> None:
    worker = MemoryWorker(W, "w")
    router, client = start_router_in_memory(
        stack, [W], {W: worker.app}, routing_strategy=RoutingStrategy.KVAWARE, health_interval_s=60
    )
    assert completion(client).status_code == 200
    transport = router.transport
    assert isinstance(transport, InMemoryTransport)
    paths = lambda: {(method, url.split("?")[0]) for method, url in transport.requests}  # noqa: E731
    wanted = {("GET", f"{W}/health"), ("GET", f"{W}/metrics"), ("GET", f"{W}/kv/events"),
              ("POST", f"{W}/v1/completions")}  # fmt: skip
    wait_until(lambda: wanted <= paths(), timeout_s=10)

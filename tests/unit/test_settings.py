"""Each setting is declared once (``splitserve.settings``), and the worker's command line, the resource file's flag
rules and the environment variables all come from that declaration. These tests run both ways: every flag a
resource may set reaches the real ``splitserve worker`` command as the same value, every flag it may not is
refused with its reason, and every option the commands have is a declared setting."""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from splitserve import settings
from splitserve.bench.cli import SERVE_SECTIONS, SWEEP_SECTIONS
from splitserve.cli import app
from splitserve.config import (
    ROUTER_SECTIONS,
    WORKER_SECTIONS,
    CacheConfig,
    EngineConfig,
    KVCacheDtype,
    KVTierConfig,
    ModelConfig,
    PDConfig,
    SchedulerConfig,
    SchedulingPolicy,
    ServerConfig,
    SpeculativeConfig,
)
from splitserve.configdoc import every_variable, reference
from splitserve.deploy.plan import plan
from splitserve.endpoint import EndpointError, parse_endpoint
from splitserve.planner.options import PlanOptions
from splitserve.settings import Section, Use

SRC = Path(__file__).parents[2] / "src" / "splitserve"
WORKER = settings.by_flag(WORKER_SECTIONS)

# A value other than the default for every flag a resource's args may set, and what the config then holds
# (None as the value: a bare boolean flag). Adding a setting that args may carry means adding it here.
EXAMPLES: dict[str, tuple[str | None, Any]] = {
    "served-model-name": ("my-model", "my-model"),
    "dtype": ("bfloat16", "bfloat16"),
    "device": ("cpu", "cpu"),
    "max-model-len": ("512", 512),
    "seed": ("7", 7),
    "num-threads": ("3", 3),
    "quantization": ("none", "none"),
    "tensor-parallel-size": ("1", 1),  # the only value that works
    "pipeline-parallel-size": ("1", 1),
    "max-num-seqs": ("8", 8),
    "max-num-batched-tokens": ("512", 512),
    "enable-chunked-prefill": ("false", False),
    "scheduling-policy": ("fcfs", SchedulingPolicy.FCFS),
    "scheduling-max-wait": ("2.5", 2.5),
    "step-time-target": ("0.1", 0.1),
    "verify-sample-rate": ("0.5", 0.5),
    "speculative-config": (
        '{"method": "ngram", "num_speculative_tokens": 5}',
        SpeculativeConfig(num_speculative_tokens=5),
    ),
    "block-size": ("32", 32),
    "kv-cache-memory": ("256MiB", "256MiB"),
    "gpu-memory-utilization": ("0.5", 0.5),
    "kv-cache-dtype": ("int8", KVCacheDtype.INT8),
    "enable-prefix-caching": ("false", False),
    "l1-cache-bytes": ("64MiB", 64 << 20),
    "l2-key-prefix": ("team-a:", "team-a:"),
    "l2-max-bytes": ("2GiB", 2 << 30),
    "kv-chunk-size": ("128", 128),
    "save-decode-cache": (None, True),
    "pd-buffer-size": ("64MiB", 64 << 20),
    "kv-transfer-timeout": ("3.5", 3.5),
    "max-tokens-limit": ("100", 100),
    "max-logprobs": ("5", 5),
    "tool-call-parser": ("hermes", "hermes"),
    "reasoning-parser": ("qwen3", "qwen3"),
    "chat-template": ("examples/chat_templates/chatml_tools.jinja", "examples/chat_templates/chatml_tools.jinja"),
    "max-queued-requests": ("5", 5),
    "max-num-queued-reqs": ("7", 7),
    "max-num-queued-tokens": ("4096", 4096),
    "max-queue-delay": ("12.5", 12.5),
    "otlp-traces-endpoint": ("http://collector:4318", "http://collector:4318"),
    "shutdown-timeout": ("12", 12.0),
    "salt-per-api-key": (None, True),
    "uvicorn-log-level": ("warning", "warning"),
}


def resource(args: list[str]) -> Any:
    return parse_endpoint({
        "apiVersion": "splitserve.io/v1alpha1", "kind": "InferenceEndpointConfig", "metadata": {"name": "t"},
        "spec": {"modelName": "smollm2", "worker": {"args": args}},
    })  # fmt: skip


def worker_configs_of(flags: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[EngineConfig, ServerConfig]:
    """What the real ``splitserve worker`` command builds from ``flags`` (its server is not started)."""
    import splitserve.worker.run

    seen: list[tuple[EngineConfig, ServerConfig]] = []
    monkeypatch.setattr(splitserve.worker.run, "run_worker", lambda e, s, *_: seen.append((e, s)) or 0)
    result = CliRunner().invoke(app, ["worker", *flags], env={})
    assert result.exit_code == 0, result.output
    return seen[0]


def field_of(configs: tuple[EngineConfig, ServerConfig], item: settings.Declared) -> Any:
    engine, server = configs
    owner = {ModelConfig: engine.model, CacheConfig: engine.cache, SchedulerConfig: engine.scheduler,
             KVTierConfig: engine.kv_tiers, PDConfig: engine.pd, ServerConfig: server}[item.config]  # fmt: skip
    return getattr(owner, item.name)


def command_options(name: str) -> set[str]:
    command: Any = typer.main.get_command(app)
    for part in name.split():
        command = command.commands[part]
    return {opt for p in command.params for opt in (*p.opts, *p.secondary_opts) if opt.startswith("--")} - {"--help"}


def declared_options(sections: Any) -> set[str]:
    found = set()
    for item in settings.declared_in(sections):
        found.add(item.option)
        if item.is_bool and item.setting.negatable:
            found.add(f"--no-{item.flag}")
    return found


@pytest.mark.parametrize(
    ("name", "sections"),
    [
        ("worker", WORKER_SECTIONS),
        ("router", ROUTER_SECTIONS),
        ("plan", (Section(PlanOptions),)),
        ("bench serve", SERVE_SECTIONS),
        ("bench sweep", SWEEP_SECTIONS),
    ],
)
def test_every_option_of_the_commands_is_a_declared_setting_and_back(name: str, sections: Any) -> None:
    assert command_options(name) == declared_options(sections)


def test_the_examples_cover_exactly_the_flags_a_resource_may_set() -> None:
    assert set(EXAMPLES) == {flag for flag, item in WORKER.items() if item.setting.use == Use.ARGS}


@pytest.mark.parametrize("flag", sorted(EXAMPLES))
def test_a_flag_in_args_reaches_the_worker_as_the_same_value(flag: str, monkeypatch: pytest.MonkeyPatch) -> None:
    value, expected = EXAMPLES[flag]
    item = WORKER[flag]
    assert item.to_field(value if value is not None else True) != item.default or flag.endswith("parallel-size")
    written = [f"--{flag}"] + ([value] if value is not None else [])
    planned = plan(resource(written)).roles[0].flags
    assert field_of(worker_configs_of(list(planned), monkeypatch), item) == expected


@pytest.mark.parametrize("flag", sorted(f for f, item in WORKER.items() if item.setting.use != Use.ARGS))
def test_a_flag_args_may_not_set_is_refused_with_its_reason_or_dropped(flag: str) -> None:
    item = WORKER[flag]
    value = "8000" if flag == "port" else "1" if item.kind in (int, float) else "x"  # a port: the container's
    config = resource([f"--{flag}"] if item.is_bool else [f"--{flag}", value])
    if item.setting.use == Use.PLANNED:
        planned = plan(config).roles[0].flags
        assert (f"--{flag}", value) not in itertools.pairwise(planned)
        return
    with pytest.raises(EndpointError) as info:
        plan(config)
    reason = {Use.INSTANCE: "set per instance"}.get(item.setting.use, item.setting.why)
    assert reason and reason in str(info.value)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dtype", "int3"], "--dtype must be one of"),
        (["--scheduling-policy", "fifo"], "must be one of fcfs, lpm"),
        (["--tensor-parallel-size", "2"], "not supported"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be positive"),
        (["--long-prefill-token-threshold", "64"], "--step-time-target"),
        (["--running-prefill-cap", "256"], "--step-time-target"),
        (["--l1-cache-bytes", "lots"], "byte size"),
    ],
)
def test_a_bad_value_fails_the_plan_as_the_worker_would(args: list[str], message: str) -> None:
    with pytest.raises(EndpointError, match=re.escape(message)):
        plan(resource(args))


def test_the_defaults_of_the_command_are_the_configs() -> None:
    import splitserve.worker.run

    seen: list[Any] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(splitserve.worker.run, "run_worker", lambda e, s, *_: seen.append((e, s)) or 0)
        assert CliRunner().invoke(app, ["worker"], env={}).exit_code == 0
    engine, server = seen[0]
    assert (engine.model, engine.cache, engine.scheduler) == (ModelConfig(), CacheConfig(), SchedulerConfig())
    assert engine.kv_tiers == KVTierConfig() and engine.pd == PDConfig() and server == ServerConfig()


# ---------------------------------------------------------------------------------------------- environment


def test_only_envs_reads_the_environment() -> None:
    """No module but ``splitserve.envs`` reads ``os.environ`` (or ``os.getenv``) for a value."""
    readers = []
    for path in SRC.rglob("*.py"):
        if path.name == "envs.py" and path.parent == SRC:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            is_os = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"
            if is_os and node.attr in ("environ", "getenv", "environb"):  # type: ignore[attr-defined]
                readers.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert readers == []


def test_every_splitserve_variable_in_the_source_is_declared() -> None:
    declared = {v.name for v in every_variable()}
    named = set()  # in string constants (identifiers such as WORKER_ONLY_FLAGS are not variables)
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                named |= set(re.findall(r"\b(SPLITSERVE_[A-Z0-9_]*[A-Z0-9])\b", node.value))
    assert named - declared == set()


def test_the_configuration_reference_lists_every_flag_and_variable() -> None:
    text = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()

    assert reference() in text, "docs/configuration.md is stale: python -m splitserve.configdoc > the reference"

"""The planner's candidates, ranking and written resource, the cost model's fit and cache, and `splitserve plan`
end to end on a calibration made by hand (no engine: the calibration itself is test_planner_calibrate's)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from splitserve.cli import app
from splitserve.config import CacheConfig, Role, RoutingStrategy, SchedulerConfig
from splitserve.deploy.plan import plan
from splitserve.endpoint import load_endpoint, loads_endpoint
from splitserve.planner.calibrate import calibration_key
from splitserve.planner.command import parse_slo
from splitserve.planner.costs import (
    CalibrationKey,
    fit_nonnegative,
    load_cached,
    save_cached,
)
from splitserve.planner.options import parse_choices
from splitserve.planner.recommend import (
    Layout,
    allowed_cores,
    current_layout,
    engine_limits,
    enumerate_layouts,
    planned_manifest,
    recommend,
    thread_counts,
    write_planned,
)
from splitserve.planner.simulate import Slo
from splitserve.planner.workload import WorkloadShape, generate
from tests.support.paths import EXAMPLES
from tests.support.planner import calibration

ALL_STRATEGIES = tuple(RoutingStrategy)


# ---------------------------------------------------------------------------------------------- the cost model


def test_the_fit_recovers_known_coefficients() -> None:
    rows = [[1.0, n, n * n] for n in (128, 512, 1024, 2048, 4096)]
    ys = [0.01 + 6e-4 * n + 2.6e-7 * n * n for _, n, _ in rows]
    assert fit_nonnegative(rows, ys) == pytest.approx([0.01, 6e-4, 2.6e-7], rel=1e-6)


def test_the_fit_never_returns_a_negative_coefficient() -> None:
    rows = [[1.0, n] for n in (1, 2, 3, 4)]
    ys = [-0.5 + 2.0 * n for _, n in rows]  # the best line has a negative intercept
    base, slope = fit_nonnegative(rows, ys)
    assert base == 0.0 and slope > 0
    with pytest.raises(ValueError, match="need at least 2 samples"):
        fit_nonnegative([[1.0, 2.0]], [1.0])


def test_a_calibration_round_trips_through_its_cache(tmp_path: Path) -> None:
    made = calibration()
    path = save_cached(made, tmp_path)
    assert path.parent == tmp_path and path.name == made.key.file_name
    assert load_cached(made.key, tmp_path) == made
    other = CalibrationKey("test cpu", "000000000000", "smollm2", "float32", "auto")
    assert load_cached(other, tmp_path) is None
    assert other.file_name != made.key.file_name


def test_the_cache_file_name_is_stable_across_processes() -> None:
    code = (
        "from splitserve.planner.costs import CalibrationKey;"
        "print(CalibrationKey('cpu', 'abc', 'smollm2', 'auto', 'auto').file_name)"
    )
    names = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}  # fmt: skip
    assert len(names) == 1


def test_more_threads_divide_the_variable_costs_by_the_measured_speedup_and_serving_scales_all() -> None:
    two = calibration().step_cost(2)  # served scale: prefill 1.2, decode 1.1
    assert two.prefill.per_token_s == pytest.approx(6.0e-4 / 1.6 * 1.2)
    assert two.decode.per_seq_s == pytest.approx(0.0036 / 1.45 * 1.1)
    assert two.decode.base_s == pytest.approx(0.017 * 1.1)
    assert calibration().step_cost(1).prefill.per_token_pair_s == pytest.approx(2.6e-7 * 1.2)
    with pytest.raises(KeyError, match="4 threads"):
        calibration().step_cost(4)


# ---------------------------------------------------------------------------------------------- candidates


def test_two_cores_give_colocated_one_or_two_and_one_prefill_one_decode() -> None:
    layouts = enumerate_layouts(2, (1024, 4096), ALL_STRATEGIES, RoutingStrategy.PREFIXAWARE)
    names = sorted({(layout.name, layout.num_workers, layout.num_threads) for layout in layouts})
    assert names == [("1P1D", 2, 1), ("colocated", 1, 2), ("colocated", 2, 1)]
    one_worker = [layout for layout in layouts if layout.num_workers == 1]
    assert [layout.strategy for layout in one_worker] == [RoutingStrategy.PREFIXAWARE]  # one worker routes alike
    assert {layout.strategy for layout in layouts if layout.num_colocated == 2} == set(ALL_STRATEGIES)
    assert sorted(layout.routing_threshold for layout in layouts if layout.name == "1P1D") == [1024, 4096]


def test_four_cores_add_the_uneven_splits() -> None:
    layouts = enumerate_layouts(4, (2048,), (RoutingStrategy.ROUNDROBIN,), RoutingStrategy.ROUNDROBIN)
    assert {layout.name for layout in layouts} >= {"1P1D", "2P1D", "1P2D", "1P3D", "3P1D", "2P2D"}
    assert thread_counts(4) == [1, 2, 4]


@pytest.mark.parametrize(("example", "cores"), [("dpd.yaml", 2), ("colocated.yaml", 2), ("kvaware.yaml", 2)])
def test_the_cores_a_resource_allows(example: str, cores: int) -> None:
    assert allowed_cores(load_endpoint(EXAMPLES / example)) == cores


def test_the_current_layout_is_the_resource_as_written() -> None:
    dpd = current_layout(load_endpoint(EXAMPLES / "dpd.yaml"), 2)
    assert (dpd.name, dpd.num_threads, dpd.routing_threshold, dpd.strategy) == ("1P1D", 1, 4096, "prefixaware")
    kvaware = current_layout(load_endpoint(EXAMPLES / "kvaware.yaml"), 2)
    assert (kvaware.num_colocated, kvaware.num_threads, kvaware.strategy) == (2, 1, "kvaware")


def test_each_role_keeps_its_engine_flags() -> None:
    config = load_endpoint(EXAMPLES / "dpd.yaml")
    assert engine_limits(config, Role.PREFILL, 23040).max_num_seqs == 16
    assert engine_limits(config, Role.DECODE, 23040).max_num_seqs == 32
    assert engine_limits(config, Role.COLOCATED, 23040).max_num_seqs == 64  # worker.args only
    assert engine_limits(config, Role.DECODE, 23040).cache_tokens == (2 << 30) // 23040
    kvaware = load_endpoint(EXAMPLES / "kvaware.yaml")
    assert engine_limits(kvaware, Role.COLOCATED, 23040).l1_tokens == (1 << 30) // 23040


def test_a_worker_without_flags_is_simulated_with_the_worker_defaults() -> None:
    manifest = yaml.safe_load((EXAMPLES / "colocated.yaml").read_text())
    manifest["spec"]["worker"]["args"] = []
    limits = engine_limits(loads_endpoint(json.dumps(manifest)), Role.COLOCATED, 23040)
    scheduler, cache = SchedulerConfig(), CacheConfig()
    assert (limits.max_num_seqs, limits.max_num_batched_tokens, limits.block_size) == (
        scheduler.max_num_seqs,
        scheduler.max_num_batched_tokens,
        cache.block_size,
    )
    assert (limits.step_time_target_s, limits.max_wait_s) == (scheduler.step_time_target, scheduler.max_wait_s)
    manifest["spec"]["worker"]["args"] = ["--scheduling-max-wait", "2.5", "--step-time-target", "0"]
    limits = engine_limits(loads_endpoint(json.dumps(manifest)), Role.COLOCATED, 23040)
    assert (limits.step_time_target_s, limits.max_wait_s) == (0.0, 2.5)


# ---------------------------------------------------------------------------------------------- recommending


def test_candidates_are_ranked_by_goodput_then_ttft_and_the_current_one_is_among_them() -> None:
    config = load_endpoint(EXAMPLES / "dpd.yaml")
    requests = generate(WorkloadShape.CHAT, num_requests=120, rate=0.6)
    result = recommend(config, calibration(), requests, Slo(2.0, 0.2), strategies=ALL_STRATEGIES)
    keys = [c.sort_key() for c in result.candidates]
    assert keys == sorted(keys)
    assert sum(c.layout.is_current for c in result.candidates) == 1
    # colocated x1, colocated x2 by strategy, 1P1D by threshold (4096 with prefixaware: the resource as written)
    assert len(result.candidates) == 1 + 4 + 4
    assert result.pick.prediction.goodput_requests_per_s >= result.current.prediction.goodput_requests_per_s  # type: ignore[union-attr]
    assert result.reason.startswith(result.pick.layout.describe())


def test_long_prompts_at_a_low_rate_are_predicted_differently_from_chat() -> None:
    config = load_endpoint(EXAMPLES / "dpd.yaml")
    chat = recommend(config, calibration(), generate("chat", num_requests=120), Slo(2.0, 0.2))
    long = recommend(config, calibration(), generate("long-context", num_requests=60), Slo(15.0, 0.3))
    assert chat.pick.prediction.ttft_p50_s < long.pick.prediction.ttft_p50_s
    for result in (chat, long):
        for candidate in result.candidates:
            assert candidate.prediction.num_requests in (120, 60)


# ---------------------------------------------------------------------------------------------- the written resource


@pytest.mark.parametrize("example", ["dpd.yaml", "colocated.yaml", "kvaware.yaml"])
@pytest.mark.parametrize(
    "layout",
    [
        Layout(2, 0, 0, 1, None, RoutingStrategy.KVAWARE),
        Layout(1, 0, 0, 2, None, RoutingStrategy.ROUNDROBIN),
        Layout(0, 1, 1, 1, 1024, RoutingStrategy.PREFIXAWARE),
        Layout(0, 2, 1, 1, 2048, RoutingStrategy.SESSION),
    ],
    ids=lambda layout: layout.describe(),
)
def test_the_written_resource_loads_plans_and_says_the_pick(tmp_path: Path, example: str, layout: Layout) -> None:
    config = load_endpoint(EXAMPLES / example)
    path = tmp_path / "planned.yaml"
    write_planned(str(path), config, layout, note="because")
    planned = load_endpoint(path)
    endpoint = plan(planned)
    assert endpoint.warnings == plan(config).warnings or not set(endpoint.warnings) - set(plan(config).warnings)
    assert endpoint.router.strategy == layout.strategy
    assert planned.metadata.annotations["splitserve.io/planned"] == "because"
    if layout.num_colocated:
        assert not planned.is_disaggregated
        role = endpoint.role(Role.COLOCATED)
        assert (role.replicas, role.num_threads) == (layout.num_colocated, layout.num_threads)
        assert endpoint.router.routing_threshold is None
    else:
        prefill, decode = endpoint.role(Role.PREFILL), endpoint.role(Role.DECODE)
        assert (prefill.replicas, decode.replicas) == (layout.num_prefill, layout.num_decode)
        assert prefill.num_threads == decode.num_threads == layout.num_threads
        assert endpoint.router.routing_threshold == layout.routing_threshold
    assert endpoint.model == plan(config).model


def test_the_written_resource_keeps_the_memory_asked_for() -> None:
    config = load_endpoint(EXAMPLES / "dpd.yaml")
    manifest = planned_manifest(config, Layout(2, 0, 0, 1, None, RoutingStrategy.ROUNDROBIN))
    assert manifest["spec"]["worker"]["resources"] == {
        "requests": {"cpu": "1", "memory": "3Gi"},
        "limits": {"cpu": "1", "memory": "6Gi"},
    }
    assert "pdSpec" not in manifest["spec"]


def test_a_disaggregated_pick_seeds_the_prefill_pools_decode_ratio_and_a_colocated_one_takes_the_targets() -> None:
    """An autoscaled resource planned onto 1P2D: decode scales by the colocated pool's concurrency target within
    the resource's bounds, prefill follows it by the pick's ratio; planned back onto colocated workers, the
    concurrency target returns to them."""
    config = load_endpoint(EXAMPLES / "autoscaling.yaml")
    assert config.spec.autoscaling is not None and config.spec.autoscaling.colocated is not None
    colocated = config.spec.autoscaling.colocated
    planned = loads_endpoint(json.dumps(planned_manifest(config, Layout(0, 1, 2, 1, 1024, RoutingStrategy.KVAWARE))))
    scaling, pd = planned.spec.autoscaling, planned.spec.pd_spec
    assert scaling is not None and scaling.decode is not None and scaling.prefill is not None and pd is not None
    assert scaling.decode.target_concurrency == colocated.target_concurrency
    assert scaling.decode.max_replicas == max(2, colocated.max_replicas)
    assert (scaling.prefill.decode_ratio, scaling.prefill.target_concurrency) == (0.5, None)
    assert scaling.prefill.max_replicas == math.ceil(scaling.decode.max_replicas / 2)
    assert (pd.prefill_spec.replicas, pd.decoding_spec.replicas) == (1, 2)  # the pick starts the pools
    back = planned_manifest(planned, Layout(3, 0, 0, 1, None, RoutingStrategy.KVAWARE))
    again = loads_endpoint(json.dumps(back)).spec.autoscaling
    assert again is not None and again.colocated is not None and again.prefill is None
    assert again.colocated.target_concurrency == colocated.target_concurrency and again.colocated.max_replicas >= 3


def test_a_disaggregated_pick_keeps_the_roles_args() -> None:
    config = load_endpoint(EXAMPLES / "dpd.yaml")
    manifest = planned_manifest(config, Layout(0, 1, 1, 1, 1024, RoutingStrategy.KVAWARE))
    planned = loads_endpoint(json.dumps(manifest))
    assert planned.spec.pd_spec is not None
    assert planned.spec.pd_spec.decoding_spec.args == ["--max-num-seqs", "32"]


# ---------------------------------------------------------------------------------------------- the command


def test_slo_and_option_lists_parse_with_clear_errors() -> None:
    default = Slo(5.0, 0.2)
    assert parse_slo("ttft_p99=2s,itl_p99=150ms", default) == Slo(2.0, 0.15)
    assert parse_slo("itl_p99=0.1", default) == Slo(5.0, 0.1)
    assert parse_slo("", default) == default
    with pytest.raises(ValueError, match="expected ttft_p99=DURATION or itl_p99=DURATION"):
        parse_slo("tpot=2s", default)
    with pytest.raises(ValueError, match="not a duration"):
        parse_slo("ttft_p99=fast", default)
    assert parse_choices("--thresholds", "512, 1024", int) == (512, 1024)
    with pytest.raises(ValueError, match="--strategies: 'random' is not valid; one of roundrobin, session"):
        parse_choices("--strategies", "random", RoutingStrategy)


def test_splitserve_plan_writes_the_table_the_resource_and_the_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    save_cached(calibration(calibration_key("smollm2")))  # what the command looks up for this machine
    out, report = tmp_path / "planned.yaml", tmp_path / "plan.json"
    args = ["plan", "-f", str(EXAMPLES / "dpd.yaml"), "--workload", "long-context", "--num-requests", "40",
            "--out", str(out), "--json", str(report)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "pick: " in result.output and "why: " in result.output and "1P1D" in result.output
    document = json.loads(report.read_text())
    assert {c["layout"] for c in document["candidates"]} == {"colocated", "1P1D"}
    assert document["pick"] == document["candidates"][0]
    assert document["calibration"]["key"]["model"] == "smollm2"
    assert document["workload"]["shape"] == "long-context"
    picked = load_endpoint(out)
    plan(picked)
    assert picked.is_disaggregated == (document["pick"]["layout"] != "colocated")


def test_splitserve_plan_names_a_bad_option_or_trace(tmp_path: Path) -> None:
    dpd = str(EXAMPLES / "dpd.yaml")
    result = CliRunner().invoke(app, ["plan", "-f", dpd, "--workload", "batch"])
    assert result.exit_code == 2 and "--workload: 'batch' is not valid; one of chat, rag, mixed" in result.output
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "prompt_tokens": 5}\n')
    result = CliRunner().invoke(app, ["plan", "-f", dpd, "--trace", str(trace)])
    assert result.exit_code == 2 and f"{trace}:1: output_tokens is missing" in result.output


def test_the_planner_outside_calibration_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "import splitserve.planner.command, splitserve.planner.recommend\n"
        "from splitserve.cli import app\n"
        "result = CliRunner().invoke(app, ['plan', '--help'])\n"
        "assert result.exit_code == 0 and '--workload' in result.output, result.output\n"
        "assert 'torch' not in sys.modules and 'splitserve.engine' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

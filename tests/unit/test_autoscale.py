"""The autoscaler's decisions (``deploy/autoscale.py``): a role's replicas follow its requests in flight and the
time to first token, up at once, down only as far as the stabilization window agrees, within the bounds; and the
resource's rules for ``spec.autoscaling``."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest

from splitserve.deploy.autoscale import Autoscaler, RoleLoad, quantile_of, recommend
from splitserve.deploy.supervisor import Supervisor
from splitserve.endpoint import AutoscalingSpec, EndpointError, RoleScaling, parse_endpoint
from tests.support.paths import EXAMPLES
from tests.support.workers import free_port


def scaling(**fields: Any) -> RoleScaling:
    return RoleScaling.model_validate({"minReplicas": 1, "maxReplicas": 4, **fields})


def test_concurrency_asks_for_a_replica_per_target_of_requests_in_flight() -> None:
    rule = scaling(targetConcurrency=4)
    assert [recommend(rule, RoleLoad(2, in_flight)) for in_flight in (0, 3, 4, 5, 12, 100)] == [1, 1, 1, 2, 3, 4]


def test_the_ttft_scales_in_proportion_outside_a_tenth_of_its_target() -> None:
    rule = scaling(targetTtftSeconds=2.0)
    assert recommend(rule, RoleLoad(2, 0, ttft_p90_s=2.1)) == 2  # within 10%: no change
    assert recommend(rule, RoleLoad(2, 0, ttft_p90_s=3.0)) == 3  # ceil(2 x 1.5)
    assert recommend(rule, RoleLoad(2, 0, ttft_p90_s=0.5)) == 1
    assert recommend(rule, RoleLoad(3, 0)) == 1  # no first token in the interval: idle


def test_either_target_missed_is_a_reason_to_scale_up() -> None:
    rule = scaling(targetConcurrency=4, targetTtftSeconds=2.0)
    assert recommend(rule, RoleLoad(1, 2, ttft_p90_s=5.0)) == 3  # the TTFT asks for 3, the concurrency for 1
    assert recommend(rule, RoleLoad(1, 14, ttft_p90_s=0.3)) == 4  # and the other way round


def test_up_at_once_down_only_as_far_as_the_window_agrees() -> None:
    now = [0.0]
    spec = AutoscalingSpec.model_validate(
        {"colocated": {"minReplicas": 1, "maxReplicas": 3, "targetConcurrency": 4}, "scaleDownStabilizationSeconds": 30}
    )
    scaler = Autoscaler(spec, clock=lambda: now[0])
    assert scaler.decide("colocated", RoleLoad(1, 10)) == 3  # at once
    now[0] = 5
    assert scaler.decide("colocated", RoleLoad(3, 1)) == 3  # a lull: the window still holds the burst's 3
    now[0] = 20
    assert scaler.decide("colocated", RoleLoad(3, 6)) == 3  # 2 now, 3 within 30 s
    now[0] = 36
    assert scaler.decide("colocated", RoleLoad(3, 1)) == 2  # the 3 left the window; the 2 at 20 s has not
    now[0] = 51
    assert scaler.decide("colocated", RoleLoad(2, 0)) == 1
    assert scaler.decide("colocated", RoleLoad(1, 40)) == 3  # never past the maximum


def test_the_quantile_is_the_bound_of_the_bucket_that_reaches_it() -> None:
    buckets = {0.1: 50.0, 0.5: 80.0, 1.0: 95.0, 5.0: 100.0, math.inf: 100.0}
    assert quantile_of(buckets, 0.9) == 1.0 and quantile_of(buckets, 0.5) == 0.1
    assert quantile_of({0.1: 0.0, 1.0: 0.0, math.inf: 3.0}, 0.9) == 1.0  # past every bound: the largest
    assert quantile_of({}, 0.9) is None and quantile_of({1.0: 0.0, math.inf: 0.0}, 0.9) is None


def example(**autoscaling: Any) -> dict[str, Any]:
    import yaml

    data: dict[str, Any] = yaml.safe_load((EXAMPLES / "autoscaling.yaml").read_text())
    data["spec"]["autoscaling"] = autoscaling
    return data


@pytest.mark.parametrize(
    ("autoscaling", "message"),
    [
        ({"colocated": {"minReplicas": 3, "maxReplicas": 2, "targetConcurrency": 4}}, "minReplicas (3) exceeds"),
        ({"colocated": {"maxReplicas": 2}}, "needs a target"),
        ({"prefill": {"maxReplicas": 2, "targetConcurrency": 4}}, "a colocated endpoint scales colocated, not prefill"),
        ({}, "names no role to scale"),
        ({"colocated": {"maxReplicas": 2, "targetConcurrency": 0}}, "greater than 0"),
        ({"colocated": {"maxReplicas": 2, "decodeRatio": 0.5}}, "only the prefill pool follows the decode pool"),
    ],
)
def test_a_bad_autoscaling_section_is_one_precise_error(autoscaling: dict[str, Any], message: str) -> None:
    with pytest.raises(EndpointError, match=re.escape(message)):
        parse_endpoint(example(**autoscaling))


def test_decode_scales_by_concurrency_not_by_the_prefill_pools_ttft() -> None:
    data = example(decode={"maxReplicas": 2, "targetTtftSeconds": 1.0})
    data["spec"]["pdSpec"] = {}
    with pytest.raises(EndpointError, match="scale decode by targetConcurrency"):
        parse_endpoint(data)


def test_a_prefill_pool_with_a_decode_ratio_follows_the_decode_pool_and_has_no_targets_of_its_own() -> None:
    follows = scaling(decodeRatio=0.5)
    assert [recommend(follows, RoleLoad(1, 50.0, 2.0, decode_replicas=d)) for d in (1, 2, 3, 4, 9)] == [1, 1, 2, 2, 4]
    # down at once with decode, whose own window already held it: no second window
    autoscaler = Autoscaler(AutoscalingSpec(prefill=follows, scale_down_stabilization_seconds=60), clock=lambda: 0.0)
    assert autoscaler.decide("prefill", RoleLoad(1, 0.0, decode_replicas=6)) == 3
    assert autoscaler.decide("prefill", RoleLoad(3, 0.0, decode_replicas=2)) == 1
    data = example(prefill={"maxReplicas": 2, "decodeRatio": 0.5, "targetConcurrency": 4})
    data["spec"]["pdSpec"] = {}
    with pytest.raises(EndpointError, match="give it no targetConcurrency or targetTtftSeconds beside it"):
        parse_endpoint(data)


def test_the_supervisor_keeps_the_prefill_pool_at_its_ratio_of_the_decode_pool(tmp_path: Path) -> None:
    data = example(decode={"minReplicas": 2, "maxReplicas": 6, "targetConcurrency": 8},
                   prefill={"maxReplicas": 3, "decodeRatio": 0.5})  # fmt: skip
    data["spec"]["pdSpec"] = {"prefillSpec": {"replicas": 1}, "decodingSpec": {"replicas": 4}}
    supervisor = Supervisor(tmp_path / "run", router_port=free_port())
    applied = supervisor._with_scaled_replicas(parse_endpoint(data)).spec.pd_spec
    assert applied is not None and (applied.decoding_spec.replicas, applied.prefill_spec.replicas) == (4, 2)
    assert list(parse_endpoint(data).spec.autoscaling.roles()) == ["decode", "prefill"]  # type: ignore[union-attr]


def test_the_supervisor_runs_the_scaled_replicas_and_keeps_them_over_a_reapply(tmp_path: Path) -> None:
    """What the supervisor applies for a disaggregated endpoint: the file's replicas within the bounds at first,
    then the autoscaler's, kept when the file is applied again; a role without bounds keeps the file's."""
    data = example(decode={"minReplicas": 2, "maxReplicas": 4, "targetConcurrency": 8})
    data["spec"]["pdSpec"] = {"prefillSpec": {"replicas": 1}, "decodingSpec": {"replicas": 1}}
    config = parse_endpoint(data)
    supervisor = Supervisor(tmp_path / "run", router_port=free_port())
    applied = supervisor._with_scaled_replicas(config)
    assert applied.spec.pd_spec is not None and config.spec.pd_spec is not None
    assert applied.spec.pd_spec.decoding_spec.replicas == 2  # the file's 1, raised to the minimum
    assert applied.spec.pd_spec.prefill_spec.replicas == 1 and config.spec.pd_spec.decoding_spec.replicas == 1
    supervisor._scaled["decode"] = 3  # what the autoscaler chose
    assert supervisor._with_scaled_replicas(config).spec.pd_spec.decoding_spec.replicas == 3  # type: ignore[union-attr]
    data["spec"]["autoscaling"]["decode"]["maxReplicas"] = 2  # the file now bounds it lower
    assert supervisor._with_scaled_replicas(parse_endpoint(data)).spec.pd_spec.decoding_spec.replicas == 2  # type: ignore[union-attr]
    del data["spec"]["autoscaling"]
    assert supervisor._with_scaled_replicas(parse_endpoint(data)).spec.pd_spec.decoding_spec.replicas == 1  # type: ignore[union-attr]
    assert supervisor._scaled == {}

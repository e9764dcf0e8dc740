"""The planner's calibration on the real engine (SmolLM2-135M, one thread), on a small measurement plan."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from splitserve.planner import calibrate
from splitserve.planner.calibrate import MeasurePlan, build_calibration_engine, calibration_key, ensure_calibration
from splitserve.planner.costs import Calibration, ServedScale, load_cached, save_cached
from tests.support.planner import calibration as hand_made

SMALL = MeasurePlan(
    prefill_lengths=(64, 128, 256, 512),
    cached_prefills=((256, 384),),
    decode_contexts=(128, 512),
    decode_batches=(1, 4),
    decode_steps=3,
    transfer_tokens=(64, 256),
    transfer_repeats=1,
    num_load_records=2,
)


@pytest.fixture(scope="module")
def measured() -> Calibration:
    key = calibration_key("smollm2")
    engine = build_calibration_engine(key, 1024)
    try:
        return calibrate.measure(engine, key, SMALL.fitted_to(1024), thread_counts=(2,))
    finally:
        engine.close()


@pytest.mark.slow
def test_calibration_fits_the_engines_own_step_times(measured: Calibration) -> None:
    samples = measured.samples
    assert len(samples["prefill"]) == 4 + 1 and len(samples["decode"]) == 2 * 2 and len(samples["transfer"]) == 2
    prefill = measured.prefill
    assert 0 < prefill.prompt_s(64) < prefill.prompt_s(512)
    assert prefill.prompt_s(384, num_cached=256) < prefill.prompt_s(384)
    measured_512 = next(t for start, end, t in samples["prefill"] if (start, end) == (0, 512))
    assert prefill.prompt_s(512) == pytest.approx(measured_512, rel=0.5)
    decode = measured.decode
    assert decode.step_s(4, 4 * 512) > decode.step_s(1, 128) > 0
    assert all(v >= 0 for v in (decode.base_s, decode.per_seq_s, decode.per_context_token_s))
    assert measured.kv_bytes_per_token in (30 * 2 * 3 * 64 * 2, 30 * 2 * 3 * 64 * 4)  # SmolLM2: bf16 or fp32
    assert measured.transfer.bytes_per_s > 1e7
    assert measured.transfer_s(4096) > measured.transfer_s(64)
    loads = measured.loads
    assert min(loads.kv_copy_s_per_token, loads.l1_load_s_per_token, loads.l2_fetch_s_per_token) > 0
    assert [s.num_threads for s in measured.scales] == [2]
    assert set(measured.fit_errors) == {"prefill", "decode", "transfer", "mixed_step"}


@pytest.fixture(scope="module")
def served(measured: Calibration) -> Calibration:
    return replace(measured, served=calibrate.measure_served(measured, 1024))


@pytest.mark.slow
def test_a_pinned_served_worker_scales_the_bare_engines_costs(served: Calibration, measured: Calibration) -> None:
    scale = served.served
    assert scale is not None
    assert [what for what, *_ in scale.samples] == ["decode batch 1", "decode batch 8", "decode batch 16",
                                                    "prefill 512", "prefill 1008"]  # fmt: skip
    assert all(s > 0 and b > 0 for _, s, b in scale.samples)
    assert 0.5 <= scale.decode <= 4.0 and 0.5 <= scale.prefill <= 4.0
    one, bare = served.step_cost(1), measured.step_cost(1)
    assert one.decode.step_s(8, 8 * 300) == pytest.approx(bare.decode.step_s(8, 8 * 300) * scale.decode)
    assert one.prefill.prompt_s(512) == pytest.approx(bare.prefill.prompt_s(512) * scale.prefill)
    assert Calibration.from_json(served.to_json()) == served


@pytest.mark.slow
def test_a_cached_calibration_is_used_and_only_what_is_missing_measured(
    served: Calibration, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    measured = served
    save_cached(measured, tmp_path)
    assert load_cached(measured.key, tmp_path) == measured

    def no_engine(*_: object) -> None:
        raise RuntimeError("would measure")

    monkeypatch.setattr(calibrate, "build_calibration_engine", no_engine)
    assert ensure_calibration(measured.key, (1, 2), directory=tmp_path) == measured
    with pytest.raises(RuntimeError, match="would measure"):
        ensure_calibration(measured.key, (1, 4), directory=tmp_path)  # 4 threads: never measured
    with pytest.raises(RuntimeError, match="would measure"):
        ensure_calibration(measured.key, (1,), directory=tmp_path, recalibrate=True)
    # a calibration cached before the served scale existed gets it measured, and nothing else
    save_cached(replace(measured, served=None), tmp_path)
    monkeypatch.setattr(calibrate, "measure_served", lambda c, n, flags: ServedScale(1.5, 1.25))
    assert ensure_calibration(measured.key, (1, 2), directory=tmp_path).served == ServedScale(1.5, 1.25)
    assert load_cached(measured.key, tmp_path) == replace(measured, served=ServedScale(1.5, 1.25))


def test_a_vllm_key_is_served_by_vllm_with_the_resources_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[tuple[list[str], dict[str, str]]] = []

    class Refused(Exception):
        pass

    def popen(command: list[str], **kwargs: object) -> None:
        env = kwargs["env"]
        assert isinstance(env, dict)
        started.append((command, env))
        raise Refused

    monkeypatch.setenv("SPLITSERVE_VLLM_PYTHON", "/bin/sh")  # any executable: the command is not run
    monkeypatch.setattr(calibrate.subprocess, "Popen", popen)
    key = replace(calibration_key("/models/smollm2-hf", "float32"), engine="vllm")
    bare = replace(hand_made(), key=key)
    flags = ["--model", "/models/smollm2-hf", "--enforce-eager", "--served-model-name", "smollm2"]
    with pytest.raises(Refused):
        calibrate.measure_served(bare, 2048, flags)
    command, env = started[0]
    assert command[:3] == ["/bin/sh", "-m", "vllm.entrypoints.openai.api_server"]
    assert command[3:8] == flags and command[8:10] == ["--host", "127.0.0.1"]
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and "SPLITSERVE_VLLM_PYTHON" not in env
    assert key.file_name.startswith("vllm-") and calibrate._served_name(flags) == "smollm2"
    with pytest.raises(ValueError, match="--model"):
        calibrate.measure_served(bare, 2048, [])

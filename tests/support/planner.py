"""A planner calibration made by hand (no engine measured it), for the planner's tests."""

from __future__ import annotations

from splitserve.planner.costs import (
    Calibration,
    CalibrationKey,
    DecodeCost,
    LoadCost,
    PrefillCost,
    ServedScale,
    ThreadScale,
    TransferCost,
)


def calibration(key: CalibrationKey | None = None) -> Calibration:
    """SmolLM2-135M on one core of a 2-core Xeon, as measured (rounded)."""
    return Calibration(
        key=key or CalibrationKey("test cpu", "000000000000", "smollm2", "auto", "auto"),
        kv_bytes_per_token=23040,
        block_size=16,
        prefill=PrefillCost(0.0, 6.0e-4, 2.6e-7),
        decode=DecodeCost(0.017, 0.0036, 1.8e-6),
        transfer=TransferCost(0.0, 9.4e8),
        loads=LoadCost(1.1e-5, 1.3e-5, 8.9e-6),
        scales=(ThreadScale(2, 1.6, 1.45),),
        samples={"prefill": [[0.0, 128.0, 0.09]]},
        fit_errors={"prefill": 0.1},
        measured_at="2026-12-02T00:00:00+00:00",
        duration_s=30.0,
        served=ServedScale(prefill=1.2, decode=1.1, samples=(("decode batch 8", 0.044, 0.040),)),
    )

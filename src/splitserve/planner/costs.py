"""The cost model the simulator runs on: fitted step, transfer and load times, and the calibration record.

Torch-free: :mod:`splitserve.planner.calibrate` measures (with the engine) and builds a :class:`Calibration`;
this module holds its types, the least-squares fit, and the cache of calibrations on disk.

**The model.** One engine step computes some prompt tokens (chunks ``[start, end)`` of prompts) and, for each
running request past its prompt, one token. Its time is

- a pure decode step (no prompt token): ``decode.base_s + decode.per_seq_s * num_seqs +
  decode.per_context_token_s * sum(context lengths)``: the native quantized decode path;
- any other step: ``prefill.base_s + sum over chunks of prefill.chunk_s(start, end)``, where
  ``chunk_s(start, end) = per_token_s * (end - start) + per_token_pair_s * (end**2 - start**2)``. A decode
  token beside prompt chunks runs on the same (``--dtype``) path, so it counts as a chunk ``[ctx, ctx + 1)``.
  A whole prompt of N tokens in one step costs ``base_s + per_token_s * N + per_token_pair_s * N**2``; a
  prompt behind a cached prefix of P tokens costs the chunk ``[P, N)``.

A KV push of N tokens takes ``transfer.base_s + N * kv_bytes_per_token / transfer.bytes_per_s`` (encode and
send, on the prefill worker's sender thread). Loading KV into the paged cache at admission (a PD push on the
decode worker, an L1 hit) costs ``loads.*_s_per_token`` per token, on the engine thread; an L2 hit is fetched
first on the prefetch thread (``loads.l2_fetch_s_per_token``), then copied.

Everything is measured with one engine thread; a worker with more threads divides its prefill and decode
times by the measured speed-up for that thread count (:class:`ThreadScale`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from splitserve import envs

CALIBRATION_VERSION = 1


@dataclass(frozen=True, slots=True)
class PrefillCost:
    """Steps that compute prompt tokens (see the module docstring); seconds."""

    base_s: float
    per_token_s: float
    per_token_pair_s: float

    def chunk_s(self, start: int, end: int) -> float:
        """The tokens ``[start, end)`` of one sequence, without the step's base."""
        return self.per_token_s * (end - start) + self.per_token_pair_s * (end * end - start * start)

    def prompt_s(self, num_tokens: int, num_cached: int = 0) -> float:
        """A whole prompt in one step, ``num_cached`` of its tokens already in the cache."""
        return self.base_s + self.chunk_s(num_cached, num_tokens)


@dataclass(frozen=True, slots=True)
class DecodeCost:
    """Pure decode steps; seconds."""

    base_s: float
    per_seq_s: float
    per_context_token_s: float

    def step_s(self, num_seqs: int, num_context_tokens: int) -> float:
        return self.base_s + self.per_seq_s * num_seqs + self.per_context_token_s * num_context_tokens


@dataclass(frozen=True, slots=True)
class TransferCost:
    """A PD push of one prompt's KV (encode, send, verify); ``bytes_per_s`` past a fixed ``base_s``."""

    base_s: float
    bytes_per_s: float

    def push_s(self, num_bytes: int) -> float:
        return self.base_s + num_bytes / self.bytes_per_s


@dataclass(frozen=True, slots=True)
class LoadCost:
    """Per-token seconds of putting stored KV into the paged cache."""

    kv_copy_s_per_token: float  # a record in memory into the cache (a PD push on the decode worker)
    l1_load_s_per_token: float  # an L1 hit: lookup, checksum, copy
    l2_fetch_s_per_token: float  # an L2 (disk) hit: read and MAC check, on the prefetch thread (then copied)


@dataclass(frozen=True, slots=True)
class ThreadScale:
    """How much faster a worker with ``num_threads`` threads is than one with one thread (>= 1 is faster)."""

    num_threads: int
    prefill_speedup: float
    decode_speedup: float


@dataclass(frozen=True, slots=True)
class ServedScale:
    """How much slower the engine's steps are in a worker as the supervisor runs it (its own process, pinned to
    one core, serving HTTP streams from the same core) than in the calibration's bare engine: measured by
    :func:`~splitserve.planner.calibrate.measure_served` (>= 1 is slower)."""

    prefill: float
    decode: float
    samples: tuple[tuple[str, float, float], ...] = ()  # (what, served seconds, bare-engine prediction)


@dataclass(frozen=True, slots=True)
class StepCost:
    """The step times of one worker (its thread count applied)."""

    prefill: PrefillCost
    decode: DecodeCost

    def step_s(self, chunks: Sequence[tuple[int, int]], decode_contexts: Sequence[int]) -> float:
        """One step computing prompt ``chunks`` (start, end) and one token for each of ``decode_contexts``."""
        if not chunks:
            return self.decode.step_s(len(decode_contexts), sum(decode_contexts))
        total = self.prefill.base_s + sum(self.prefill.chunk_s(start, end) for start, end in chunks)
        return total + sum(self.prefill.chunk_s(ctx, ctx + 1) for ctx in decode_contexts)


@dataclass(frozen=True, slots=True)
class CalibrationKey:
    """What a calibration holds for: this CPU, this model, dtype and quantization, with one engine thread, and
    the engine the workers run (``splitserve``, or ``vllm``: splitserve's engine measured, scaled to a served
    vLLM worker)."""

    cpu_model: str
    cpu_flags_digest: str  # sha256 of the sorted flags, 12 hex digits
    model: str
    dtype: str
    quantization: str
    engine: str = "splitserve"

    @property
    def file_name(self) -> str:
        """A file name for the key: readable parts and a digest of the whole key."""
        fields = asdict(self)
        if self.engine == "splitserve":
            del fields["engine"]  # the default engine's files keep the names they had before engines were named
        text = json.dumps(fields, sort_keys=True)
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        model = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.model)[-40:]
        engine = "" if self.engine == "splitserve" else f"{self.engine}-"
        return f"{engine}{model}-{self.dtype}-{self.quantization}-{digest}.json"


@dataclass(frozen=True, slots=True)
class Calibration:
    """The fitted costs of one machine and model, with the raw measurements they were fitted to."""

    key: CalibrationKey
    kv_bytes_per_token: int
    block_size: int
    prefill: PrefillCost
    decode: DecodeCost
    transfer: TransferCost
    loads: LoadCost
    scales: tuple[ThreadScale, ...]  # thread counts other than 1 measured so far
    samples: dict[str, list[list[float]]]  # name -> rows of raw measurements (see calibrate.py)
    fit_errors: dict[str, float]  # name -> median relative error of the fit on its own samples
    measured_at: str  # ISO time
    duration_s: float  # how long measuring took
    version: int = CALIBRATION_VERSION
    served: ServedScale | None = None  # None: not measured (the bare engine's costs are used as they are)

    def step_cost(self, num_threads: int = 1) -> StepCost:
        """The step times of a served worker with ``num_threads`` threads (the served scale applied, when
        measured); KeyError when that thread count was not measured."""
        p, d = self.prefill, self.decode
        if num_threads != 1:
            scale = next((s for s in self.scales if s.num_threads == num_threads), None)
            if scale is None:
                raise KeyError(f"no thread scale measured for {num_threads} threads")
            p = PrefillCost(p.base_s, p.per_token_s / scale.prefill_speedup, p.per_token_pair_s / scale.prefill_speedup)
            d = DecodeCost(d.base_s, d.per_seq_s / scale.decode_speedup, d.per_context_token_s / scale.decode_speedup)
        if self.served is not None:
            f, g = self.served.prefill, self.served.decode
            p = PrefillCost(p.base_s * f, p.per_token_s * f, p.per_token_pair_s * f)
            d = DecodeCost(d.base_s * g, d.per_seq_s * g, d.per_context_token_s * g)
        return StepCost(p, d)

    def has_threads(self, num_threads: int) -> bool:
        return num_threads == 1 or any(s.num_threads == num_threads for s in self.scales)

    def transfer_s(self, num_tokens: int) -> float:
        return self.transfer.push_s(num_tokens * self.kv_bytes_per_token)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Calibration:
        """The inverse of to_json; ValueError for another version or a malformed record."""
        if data.get("version") != CALIBRATION_VERSION:
            raise ValueError(f"calibration version {data.get('version')!r}, expected {CALIBRATION_VERSION}")
        try:
            return cls(
                key=CalibrationKey(**data["key"]),
                kv_bytes_per_token=int(data["kv_bytes_per_token"]),
                block_size=int(data["block_size"]),
                prefill=PrefillCost(**data["prefill"]),
                decode=DecodeCost(**data["decode"]),
                transfer=TransferCost(**data["transfer"]),
                loads=LoadCost(**data["loads"]),
                scales=tuple(ThreadScale(**s) for s in data["scales"]),
                samples={k: [list(map(float, row)) for row in v] for k, v in data["samples"].items()},
                fit_errors={k: float(v) for k, v in data["fit_errors"].items()},
                measured_at=str(data["measured_at"]),
                duration_s=float(data["duration_s"]),
                served=_served_from_json(data.get("served")),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed calibration: {exc!r}") from None


def _served_from_json(data: Any) -> ServedScale | None:
    if data is None:
        return None
    samples = tuple((str(what), float(s), float(b)) for what, s, b in data.get("samples", ()))
    return ServedScale(float(data["prefill"]), float(data["decode"]), samples)


# ---------------------------------------------------------------------------------------------- the machine


@dataclass(frozen=True, slots=True)
class CpuIdentity:
    model_name: str
    flags_digest: str


def cpu_identity(cpuinfo_path: str = "/proc/cpuinfo") -> CpuIdentity:
    """This CPU's model name and a digest of its feature flags, from /proc/cpuinfo (torch-free; the same
    fields as ``splitserve.model.kernels.detect_cpu``). Without the file: the platform's description."""
    model, flags = "", ""
    try:
        for line in Path(cpuinfo_path).read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("flags", "Features") and not flags:
                flags = " ".join(sorted(value.split()))
            elif key == "model name" and not model:
                model = value.strip()
    except OSError:
        pass
    digest = hashlib.sha256(flags.encode()).hexdigest()[:12]
    return CpuIdentity(model or platform.processor() or platform.machine(), digest)


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/splitserve/plan`` (``~/.cache`` without XDG_CACHE_HOME)."""
    return envs.cache_home() / "splitserve" / "plan"


def load_cached(key: CalibrationKey, directory: Path | None = None) -> Calibration | None:
    """The cached calibration for ``key``, or None (none, unreadable, or of another version)."""
    path = (directory or cache_dir()) / key.file_name
    try:
        calibration = Calibration.from_json(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None
    return calibration if calibration.key == key else None


def save_cached(calibration: Calibration, directory: Path | None = None) -> Path:
    """Write ``calibration`` into the cache (atomically) and return its path."""
    directory = directory or cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / calibration.key.file_name
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(calibration.to_json(), indent=1) + "\n")
    tmp.replace(path)
    return path


# ---------------------------------------------------------------------------------------------- fitting


def fit_nonnegative(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Least squares ``ys ~ rows @ coefficients`` with every coefficient >= 0.

    Exact for a handful of terms: solves the unconstrained problem on every subset of the columns and keeps the
    best feasible one (the columns left out get 0). Each column is scaled to unit norm first, so terms of very
    different magnitude (tokens against tokens squared) fit alike. ValueError with fewer rows than columns.
    """
    num_cols = len(rows[0])
    if len(rows) < num_cols or len(rows) != len(ys):
        raise ValueError(f"need at least {num_cols} samples (and one y each), got {len(rows)} and {len(ys)}")
    norms = [max(sum(r[j] ** 2 for r in rows) ** 0.5, 1e-300) for j in range(num_cols)]
    scaled = [[r[j] / norms[j] for j in range(num_cols)] for r in rows]
    best: tuple[float, list[float]] = (float("inf"), [0.0] * num_cols)
    for size in range(1, num_cols + 1):
        for cols in itertools.combinations(range(num_cols), size):
            solution = _least_squares([[r[j] for j in cols] for r in scaled], ys)
            if solution is None or min(solution) < 0:
                continue
            full = [0.0] * num_cols
            for j, value in zip(cols, solution, strict=True):
                full[j] = value
            residual = sum(
                (sum(a * b for a, b in zip(r, full, strict=True)) - y) ** 2 for r, y in zip(scaled, ys, strict=True)
            )
            if residual < best[0]:
                best = (residual, full)
    return [value / norms[j] for j, value in enumerate(best[1])]


def _least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float] | None:
    """Solve the normal equations by Gaussian elimination with partial pivoting; None when singular."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] + [sum(r[i] * y for r, y in zip(rows, ys, strict=True))]
         for i in range(n)]  # fmt: skip
    for col in range(n):
        pivot = max(range(col, n), key=lambda i: abs(a[i][col]))
        if abs(a[pivot][col]) < 1e-12:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for i in range(n):
            if i != col:
                factor = a[i][col] / a[col][col]
                a[i] = [x - factor * y for x, y in zip(a[i], a[col], strict=True)]
    return [a[i][n] / a[i][i] for i in range(n)]


def median_relative_error(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """The median of ``|predicted - measured| / measured``."""
    errors = sorted(abs(p - m) / m for p, m in zip(predicted, measured, strict=True) if m > 0)
    return errors[len(errors) // 2] if errors else 0.0


@dataclass(slots=True)
class SampleTable:
    """Raw measurements by name, as rows of numbers (what ``Calibration.samples`` keeps)."""

    rows: dict[str, list[list[float]]] = field(default_factory=dict)

    def add(self, name: str, *values: float) -> None:
        self.rows.setdefault(name, []).append([float(v) for v in values])

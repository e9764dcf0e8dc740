"""Measure this machine and model with the engine itself, in this process, and fit the planner's cost model.

:func:`ensure_calibration` returns the cached :class:`~splitserve.planner.costs.Calibration` for the machine and
model, measuring only what is missing: everything (about a minute on a 2-core CPU with SmolLM2-135M), or just the
speed-up of a thread count not yet measured. :func:`measure` does the whole measurement:

- **prefill**: one engine (``--num-threads 1``, like a one-core worker; prefix caching on, a step budget of the
  whole context so a prompt is one step) computes fresh prompts of ``prefill_lengths`` tokens, then prompts that
  extend an earlier one (``cached_prefills``: the cached prefix is skipped). Fitted: ``prefill.base_s +
  per_token_s * n + per_token_pair_s * (end**2 - start**2)`` over the computed span ``[start, end)``.
- **decode**: for each context in ``decode_contexts`` and batch in ``decode_batches``, that many copies of a
  cached prompt decode together; the median of ``decode_steps`` pure decode steps is one sample. Fitted:
  ``decode.base_s + per_seq_s * batch + per_context_token_s * sum(contexts)``.
- **mixed step**: eight decodes beside a 512-token chunk, measured against the model's prediction (kept as
  ``fit_errors["mixed_step"]``, not fitted).
- **KV transfer**: the real PD path: the prompt KV copied out of the engine's cache, encoded
  (``kvcache.serde``) and pushed over loopback TCP (``pd.sender.push``) into a ``pd.receiver.KVReceiver``
  and its ``PDBuffer``. Fitted: ``transfer.base_s + bytes / bytes_per_s``.
- **loads**: a pushed record copied into the paged cache (``kv_copy``); L1: ``kvcache.cpu.CPUTier`` get,
  checksum and copy of 256-token records; L2: ``kvcache.disk.DiskTier`` read and signed-record check, in a
  temporary directory (the page cache is warm: a local disk's best case). Redis is not measured.
- **threads**: for each other thread count a role may get, the same prefill and decode sample with that
  many threads against one thread, back to back (:class:`~splitserve.planner.costs.ThreadScale`).
- **served**: a real worker (``splitserve worker --num-threads 1``), pinned to one core as the supervisor pins
  it, serving streamed completions over HTTP: decode ITLs at batches 1, 8 and 16 and TTFTs of fresh 512- and
  2,048-token prompts against what the bare engine's fit predicts (its chunking included). The medians of the
  ratios scale every prefill and decode cost (:class:`~splitserve.planner.costs.ServedScale`): the HTTP streams,
  the engine thread's hand-offs and the core they share are what a deployed worker pays and the bare engine
  does not (on the project's 2-core Xeon, 1.1x to 1.5x).
- **vLLM workers** (a resource with ``spec.worker.engine: vllm``, ``CalibrationKey.engine`` ``vllm``): the bare
  engine measured is still splitserve's, on the same model folder and dtype (the shape of the costs: how they
  grow with tokens, batch and context; the KV bytes, the push and the loads, which run the same wire and records
  in splitserve's connector). The served worker is vLLM itself, started with the resource's flags, one core
  bound (``VLLM_CPU_OMP_THREADS_BIND``): its ITLs and TTFTs against splitserve's fit scale every step to vLLM's
  speed. vLLM's scheduling is modelled by splitserve's (chunks of the step budget, first come first served),
  and its thread scaling by splitserve's engine's.

Torch and the engine are imported inside the functions: importing this module is cheap and torch-free.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING

from splitserve import envs
from splitserve.planner.costs import (
    Calibration,
    CalibrationKey,
    DecodeCost,
    LoadCost,
    PrefillCost,
    SampleTable,
    ServedScale,
    StepCost,
    ThreadScale,
    TransferCost,
    cpu_identity,
    fit_nonnegative,
    load_cached,
    median_relative_error,
    save_cached,
)

if TYPE_CHECKING:
    from splitserve.engine.engine import LLMEngine

Progress = Callable[[str], None]
RECORD_TOKENS = 256  # the default --kv-chunk-size: one L1/L2 record


@dataclass(frozen=True, slots=True)
class MeasurePlan:
    """What :func:`measure` runs; the defaults take about a minute on a 2-core CPU with SmolLM2-135M."""

    prefill_lengths: tuple[int, ...] = (128, 512, 1024, 2048, 4096)
    cached_prefills: tuple[tuple[int, int], ...] = ((1024, 1536), (2048, 2304), (4096, 4352))  # (cached, total)
    decode_contexts: tuple[int, ...] = (128, 1024, 4096)  # each must be one of prefill_lengths
    decode_batches: tuple[int, ...] = (1, 8, 32)
    decode_steps: int = 6
    transfer_tokens: tuple[int, ...] = (256, 1024, 4096)
    transfer_repeats: int = 3
    num_load_records: int = 8
    block_size: int = 16

    def fitted_to(self, max_model_len: int) -> MeasurePlan:
        """This plan without the lengths a context of ``max_model_len`` cannot hold."""
        room = max_model_len - self.decode_steps - 8
        lengths = tuple(n for n in self.prefill_lengths if n <= room)
        if len(lengths) < 3:
            raise ValueError(f"a context of {max_model_len} tokens is too short to calibrate (needs ~600)")
        return replace(
            self,
            prefill_lengths=lengths,
            cached_prefills=tuple((c, t) for c, t in self.cached_prefills if c in lengths and t <= room),
            decode_contexts=tuple(c for c in self.decode_contexts if c in lengths) or lengths[-1:],
            transfer_tokens=tuple(n for n in self.transfer_tokens if n <= room),
        )


def calibration_key(
    model: str, dtype: str = "auto", quantization: str = "auto", engine: str = "splitserve"
) -> CalibrationKey:
    cpu = cpu_identity()
    return CalibrationKey(cpu.model_name, cpu.flags_digest, model, dtype, quantization, engine)


def ensure_calibration(
    key: CalibrationKey,
    thread_counts: Sequence[int] = (1,),
    *,
    recalibrate: bool = False,
    max_model_len: int = 8192,
    directory: Path | None = None,
    progress: Progress = lambda _: None,
    vllm_flags: Sequence[str] = (),
) -> Calibration:
    """The calibration for ``key`` with a scale for every count in ``thread_counts``: from the cache, measuring
    (and caching) what it lacks; everything when ``recalibrate``. ``vllm_flags``: a vLLM worker's ``vllm serve``
    arguments (``--model`` ... ``--served-model-name``), for a key of engine ``vllm``."""
    cached = None if recalibrate else load_cached(key, directory)
    missing = sorted({t for t in thread_counts if cached is None or not cached.has_threads(t)})
    if cached is not None and not missing and cached.served is not None:
        return cached
    calibration = cached
    if calibration is None or missing:
        engine = build_calibration_engine(key, max_model_len)
        try:
            if calibration is None:
                calibration = measure(engine, key, MeasurePlan().fitted_to(max_model_len), missing, progress)
            else:
                scales = measure_scales(engine, missing, progress, min(1024, max_model_len - 32))
                calibration = replace(calibration, scales=_merged(calibration.scales, scales))
        finally:
            engine.close()
        save_cached(calibration, directory)
    if calibration.served is None:
        progress("a served vLLM worker" if key.engine == "vllm" else "a served worker")
        calibration = replace(calibration, served=measure_served(calibration, max_model_len, vllm_flags))
        save_cached(calibration, directory)
    return calibration


def _merged(old: Sequence[ThreadScale], new: Sequence[ThreadScale]) -> tuple[ThreadScale, ...]:
    by_threads = {s.num_threads: s for s in (*old, *new)}
    return tuple(by_threads[t] for t in sorted(by_threads))


def build_calibration_engine(key: CalibrationKey, max_model_len: int) -> LLMEngine:
    """An engine for ``key`` as a one-core worker would run it, with a step budget of the whole context (so a
    prompt is one step) and 1 GiB of KV cache; loads the model (seconds)."""
    from splitserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from splitserve.worker.build import build_engine

    config = EngineConfig(
        model=ModelConfig(
            model=key.model,
            dtype=key.dtype,
            quantization=key.quantization,
            max_model_len=max_model_len,
            num_threads=1,
        ),
        cache=CacheConfig(kv_cache_memory="1GiB", enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=max_model_len, step_time_target=0),
    )
    return build_engine(config)


def measure(
    engine: LLMEngine,
    key: CalibrationKey,
    plan: MeasurePlan,
    thread_counts: Sequence[int] = (),
    progress: Progress = lambda _: None,
) -> Calibration:
    """Run ``plan`` on ``engine`` (built with one thread, see the module docstring) and fit the model."""
    began = time.perf_counter()
    runner = _Runner(engine, random.Random(0))
    samples = SampleTable()
    runner.run_prompt(64, max_tokens=4)  # warm-up: first-call costs stay out of the samples
    progress("prefill")
    prefill = _measure_prefill(runner, plan, samples)
    progress("decode")
    decode = _measure_decode(runner, plan, samples)
    mixed_error = _measure_mixed(runner, StepCost(prefill, decode), samples)
    progress("KV transfer")
    transfer = _measure_transfer(engine, plan, samples)
    progress("L1/L2 loads")
    loads = _measure_loads(engine, plan, samples)
    scale_tokens = min(1024, max(plan.prefill_lengths))
    scales = measure_scales(engine, [t for t in thread_counts if t != 1], progress, scale_tokens)
    errors = _fit_errors(samples, prefill, decode, transfer) | {"mixed_step": mixed_error}
    return Calibration(
        key=key,
        kv_bytes_per_token=_kv_bytes_per_token(engine),
        block_size=engine.kv.block_size,
        prefill=prefill,
        decode=decode,
        transfer=transfer,
        loads=loads,
        scales=tuple(scales),
        samples=samples.rows,
        fit_errors=errors,
        measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
        duration_s=time.perf_counter() - began,
    )


class _Runner:
    """Drives an engine one request set at a time, timing its steps."""

    def __init__(self, engine: LLMEngine, rng: random.Random) -> None:
        self.engine = engine
        self.rng = rng
        self.prompts: dict[int, list[int]] = {}  # length -> a prompt computed once (its KV is in the prefix cache)
        self._ids = iter(range(1 << 62))

    def new_tokens(self, n: int) -> list[int]:
        high = min(self.engine.vocab_size, 40000)
        return [self.rng.randrange(high // 4, high) for _ in range(n)]

    def run_prompt(self, n: int, max_tokens: int = 1, prefix: list[int] | None = None) -> float:
        """Compute a fresh prompt of ``n`` tokens (after ``prefix``, cached) to its end; seconds it took."""
        tokens = (prefix or []) + self.new_tokens(n)
        self.add(tokens, max_tokens)
        began = time.perf_counter()
        while self.engine.has_unfinished_requests():
            self.engine.step()
        if prefix is None:
            self.prompts[n] = tokens
        return time.perf_counter() - began

    def add(self, tokens: list[int], max_tokens: int) -> str:
        from splitserve.engine.sampling_params import SamplingParams

        request_id = f"calibrate-{next(self._ids)}"
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(request_id, tokens, params)
        return request_id

    def step_s(self) -> float:
        began = time.perf_counter()
        self.engine.step()
        return time.perf_counter() - began

    def decode_s(self, context: int, batch: int, num_steps: int) -> tuple[float, float]:
        """Median pure-decode step of ``batch`` copies of the cached prompt of ``context`` tokens, and the mean
        context length over the timed steps."""
        ids = [self.add(self.prompts[context], max_tokens=num_steps + 8) for _ in range(batch)]
        self.step_s()  # admission: the copies' last tokens
        self.step_s()
        times = [self.step_s() for _ in range(num_steps)]
        for request_id in ids:
            self.engine.abort_request(request_id)
        return statistics.median(times), context + 2 + num_steps / 2


def _measure_prefill(runner: _Runner, plan: MeasurePlan, samples: SampleTable) -> PrefillCost:
    for n in plan.prefill_lengths:
        samples.add("prefill", 0, n, runner.run_prompt(n))
    for cached, total in plan.cached_prefills:
        samples.add("prefill", cached, total, runner.run_prompt(total - cached, prefix=runner.prompts[cached]))
    rows = samples.rows["prefill"]
    base, per_token, pair = fit_nonnegative([[1.0, e - s, e * e - s * s] for s, e, _ in rows], [t for *_, t in rows])
    return PrefillCost(base, per_token, pair)


def _measure_decode(runner: _Runner, plan: MeasurePlan, samples: SampleTable) -> DecodeCost:
    for context in plan.decode_contexts:
        for batch in plan.decode_batches:
            step_s, mean_context = runner.decode_s(context, batch, plan.decode_steps)
            samples.add("decode", batch, batch * mean_context, step_s)
    rows = samples.rows["decode"]
    base, per_seq, per_ctx = fit_nonnegative([[1.0, b, c] for b, c, _ in rows], [t for *_, t in rows])
    return DecodeCost(base, per_seq, per_ctx)


def _measure_mixed(runner: _Runner, cost: StepCost, samples: SampleTable) -> float:
    """Eight decodes at ~128 tokens beside a fresh 512-token prompt: the step's relative prediction error."""
    context = min(runner.prompts)
    ids = [runner.add(runner.prompts[context], max_tokens=16) for _ in range(8)]
    runner.step_s()
    runner.step_s()
    ids.append(runner.add(runner.new_tokens(512), max_tokens=1))
    measured = runner.step_s()
    for request_id in ids:
        runner.engine.abort_request(request_id)
    predicted = cost.step_s([(0, 512)], [context + 2] * 8)
    samples.add("mixed_step", 8, context + 2, 512, measured, predicted)
    return abs(predicted - measured) / measured


def _kv_bytes_per_token(engine: LLMEngine) -> int:
    kv = engine.runner.kv_cache  # [layers, 2, slots, kv_heads, head_dim]
    return int(kv.shape[0] * kv.shape[1] * kv.shape[3] * kv.shape[4] * kv.element_size())


def _layout(engine: LLMEngine) -> str:
    from splitserve.engine.engine import kv_cache_layout

    return kv_cache_layout(engine.runner.model, engine.kv.block_size, engine.config.cache.kv_cache_dtype)


def _prompt_kv(engine: LLMEngine, num_tokens: int) -> object:
    """``[layers, 2, num_tokens, kv_heads, head_dim]``: real KV bytes out of the engine's cache (its first slots)."""
    return engine.runner.kv_cache[:, :, :num_tokens].contiguous()


def _measure_transfer(engine: LLMEngine, plan: MeasurePlan, samples: SampleTable) -> TransferCost:
    import torch

    from splitserve.kvcache import serde
    from splitserve.pd.buffer import PDBuffer
    from splitserve.pd.receiver import KVReceiver
    from splitserve.pd.sender import push

    layout = _layout(engine)
    bytes_per_token = _kv_bytes_per_token(engine)
    receiver = KVReceiver(PDBuffer(2 * bytes_per_token * max(plan.transfer_tokens) + (1 << 20)), layout)
    receiver.start()
    try:
        for n in plan.transfer_tokens:
            for i in range(plan.transfer_repeats):
                kv = _prompt_kv(engine, n)
                assert isinstance(kv, torch.Tensor)
                began = time.perf_counter()
                record = serde.encode(kv, n, layout)
                result = push(receiver.addr, f"calibrate-{n}-{i}", record, n, 0, layout, deadline_s=30.0)
                elapsed_s = time.perf_counter() - began
                receiver.buffer.release(f"calibrate-{n}-{i}")
                if not result.ok:
                    raise RuntimeError(f"the calibration's KV push failed: {result.reason}")
                samples.add("transfer", n, len(record), elapsed_s)
    finally:
        receiver.close()
    rows = samples.rows["transfer"]
    base, per_byte = fit_nonnegative([[1.0, b] for _, b, _ in rows], [t for *_, t in rows])
    return TransferCost(base, 1.0 / max(per_byte, 1e-15))


def _measure_loads(engine: LLMEngine, plan: MeasurePlan, samples: SampleTable) -> LoadCost:
    """Per-token seconds of a PD record copy, an L1 hit and an L2 disk fetch, over ``num_load_records``."""
    import torch

    from splitserve.keys import cache_key
    from splitserve.kvcache import serde
    from splitserve.kvcache.cpu import CPUTier
    from splitserve.kvcache.disk import DiskTier

    layout, n = _layout(engine), RECORD_TOKENS
    kv = _prompt_kv(engine, n)
    assert isinstance(kv, torch.Tensor)
    signer = serde.RecordSigner.for_secret(None, "calibration", layout)
    keys = [cache_key("calibration", layout, i + 1) for i in range(plan.num_load_records)]
    records = [signer.encode(kv, n, key) for key in keys]
    cache = engine.runner.kv_cache
    slots = torch.arange(cache.shape[2] - n, cache.shape[2])  # the cache's last slots: no request holds them

    def copy_in(record: bytes | memoryview, verify: bool) -> None:
        tensor = serde.decode(record, layout, tuple(kv.shape), kv.dtype, verify_checksum=verify)
        with torch.no_grad():
            cache.index_copy_(2, slots, tensor)

    began = time.perf_counter()
    for record in records:
        copy_in(record, verify=False)
    copy_s = (time.perf_counter() - began) / (n * len(records))
    l1 = CPUTier(sum(map(len, records)) * 2)
    for key, record in zip(keys, records, strict=True):
        l1.put(key, record)
    began = time.perf_counter()
    for value in l1.get_many(keys):
        assert value is not None
        copy_in(value, verify=True)
    l1_s = (time.perf_counter() - began) / (n * len(records))
    l2_s = _disk_fetch_s(keys, records, signer, DiskTier) / (n * len(records))
    samples.add("loads", copy_s, l1_s, l2_s)
    return LoadCost(copy_s, l1_s, l2_s)


def _disk_fetch_s(keys: list[str], records: list[bytes], signer: object, tier_class: type) -> float:
    from splitserve.kvcache import serde

    assert isinstance(signer, serde.RecordSigner)
    with tempfile.TemporaryDirectory(prefix="splitserve-calibrate-") as directory:
        tier = tier_class(directory, sum(map(len, records)) * 2)
        for key, record in zip(keys, records, strict=True):
            tier.put(key, record)
        began = time.perf_counter()
        for key, value in zip(keys, tier.get_many(keys), strict=True):
            if value is None:
                raise RuntimeError(f"the calibration's disk tier in {directory} lost a record")
            signer.verify(key, value)
        elapsed_s = time.perf_counter() - began
        tier.close()
    return elapsed_s


def measure_scales(
    engine: LLMEngine, thread_counts: Sequence[int], progress: Progress, num_tokens: int = 1024
) -> list[ThreadScale]:
    """For each count (other than 1): a prefill of ``num_tokens`` and a decode step of 8 at that context, with that
    many threads and with one, back to back; their ratios. Leaves the engine with one thread."""
    from splitserve.engine.engine import set_cpu_threads

    runner = _Runner(engine, random.Random(1))
    runner.run_prompt(num_tokens)
    scales = []
    for num_threads in sorted(set(thread_counts) - {1}):
        progress(f"{num_threads} threads")
        times: dict[int, list[tuple[float, float]]] = {}
        for threads in (1, num_threads, 1):
            set_cpu_threads(threads)
            prefill_s = runner.run_prompt(num_tokens)
            decode_s, _ = runner.decode_s(num_tokens, 8, 6)
            times.setdefault(threads, []).append((prefill_s, decode_s))
        set_cpu_threads(1)
        one_prefill = statistics.mean(p for p, _ in times[1])
        one_decode = statistics.mean(d for _, d in times[1])
        many_prefill, many_decode = times[num_threads][0]
        scales.append(ThreadScale(num_threads, one_prefill / many_prefill, one_decode / many_decode))
    return scales


SERVED_DECODE_BATCHES = (1, 8, 16)
SERVED_PROMPTS = (512, 2048)
SERVED_STEP_BUDGET = 1024  # a worker's default --max-num-batched-tokens: the chunks a served prompt is computed in
SERVED_READY_S = 300.0
VLLM_READY_S = 900.0  # vLLM compiles the model first unless --enforce-eager
SERVED_FACTOR_BOUNDS = {"splitserve": (0.5, 4.0), "vllm": (0.2, 25.0)}  # a served worker against the bare fit


def measure_served(calibration: Calibration, max_model_len: int, vllm_flags: Sequence[str] = ()) -> ServedScale:
    """Run a one-thread worker pinned to one core, as the supervisor runs it, and compare its streamed ITLs and
    TTFTs with what ``calibration``'s bare-engine fit predicts (module docstring). For a key of engine ``vllm``
    the worker is vLLM, started with ``vllm_flags``."""
    from splitserve.deploy.pods import child_setup
    from splitserve.deploy.supervisor import free_port, splitserve_command

    key, port = calibration.key, free_port()
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    # this machine's defaults only: no settings or keys of the user's (the worker serves this process alone)
    env = {k: v for k, v in envs.copy().items() if not k.startswith(("SPLITSERVE_", "VLLM_", "LMCACHE_"))}
    address = ("--host", "127.0.0.1", "--port", str(port))
    if key.engine == "vllm":
        command, model, ready_s = _vllm_command(vllm_flags, address), _served_name(vllm_flags), VLLM_READY_S
        env |= {"VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        if cpus:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpus[-1])
    else:
        command = [*splitserve_command(
            "worker", "--model", key.model, "--dtype", key.dtype, "--quantization", key.quantization,
            "--num-threads", "1", "--max-model-len", str(max_model_len), *address,
        )]  # fmt: skip
        model, ready_s = key.model, SERVED_READY_S
    with tempfile.TemporaryFile() as log:
        worker = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                  preexec_fn=child_setup(cpus[-1:]))  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(worker, url, log, ready_s)
            prompts = sorted({min(n, max_model_len - 16) for n in SERVED_PROMPTS})
            samples = asyncio.run(_served_samples(url, model, bare_step_cost(calibration), prompts))
        finally:
            _stop_group(worker)

    low, high = SERVED_FACTOR_BOUNDS.get(key.engine, SERVED_FACTOR_BOUNDS["splitserve"])

    def factor(kind: str) -> float:
        ratios = [served / bare for what, served, bare in samples if what.startswith(kind) and bare > 0]
        return min(max(statistics.median(ratios), low), high)

    return ServedScale(prefill=factor("prefill"), decode=factor("decode"), samples=tuple(samples))


def _stop_group(worker: subprocess.Popen[bytes]) -> None:
    """SIGTERM the worker's process group (a vLLM server's engine and workers with it), SIGKILL after 30 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(worker.pid, signal.SIGTERM)
    try:
        worker.wait(30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(worker.pid, signal.SIGKILL)  # what outlived the server


def _vllm_command(flags: Sequence[str], address: Sequence[str]) -> list[str]:
    """``vllm serve`` here (``deploy.vllm.local_command``) with a worker's flags, at ``address``."""
    from splitserve.deploy import vllm

    if "--model" not in flags:
        raise ValueError("a vLLM worker's calibration needs its vllm serve flags (--model ...)")
    return [*vllm.local_command(envs.copy()), *flags, *address]


def _served_name(flags: Sequence[str]) -> str:
    """The model name a ``vllm serve`` with ``flags`` answers to: its served name, else its model."""
    from splitserve.endpoint import last_flag, parse_args

    parsed = parse_args(list(flags))
    flag = last_flag(parsed, "served-model-name") or last_flag(parsed, "model")
    assert flag is not None and flag.value  # _vllm_command checked --model
    return flag.value


def _wait_healthy(worker: subprocess.Popen[bytes], url: str, log: IO[bytes], ready_s: float) -> None:
    from splitserve.planner.verify import answers_ok

    deadline = time.monotonic() + ready_s
    while time.monotonic() < deadline:
        if worker.poll() is not None:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-2000:]
            raise RuntimeError(f"the calibration's worker exited with {worker.returncode}:\n{tail}")
        if answers_ok(f"{url}/health"):
            return
        time.sleep(0.5)
    raise RuntimeError(f"the calibration's worker was not healthy after {ready_s:.0f} s")


def bare_step_cost(calibration: Calibration) -> StepCost:
    """One thread's step costs as the bare engine measured them (no served scale)."""
    return StepCost(calibration.prefill, calibration.decode)


async def _served_samples(
    url: str, model: str, bare: StepCost, prompts: Sequence[int]
) -> list[tuple[str, float, float]]:
    """(what, served seconds, bare-engine prediction) for each decode batch and prompt length."""
    import httpx

    from splitserve.bench.client import EndpointKind, OpenAIStreamClient
    from splitserve.bench.datasets import BenchRequest
    from splitserve.planner.verify import token_pool

    pool = await asyncio.to_thread(token_pool, url, model)
    rng = random.Random(2)

    def prompt(n: int) -> list[int]:
        return [rng.choice(pool) for _ in range(n)]

    samples: list[tuple[str, float, float]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits, trust_env=False) as http:
        client = OpenAIStreamClient(http, base_url=url, model=model, kind=EndpointKind.COMPLETIONS)
        await client.send(BenchRequest(max_tokens=8, prompt=prompt(256)))  # warm-up
        context, steps = 256, 48
        for batch in SERVED_DECODE_BATCHES:
            results = await asyncio.gather(
                *(client.send(BenchRequest(max_tokens=steps, prompt=prompt(context))) for _ in range(batch))
            )
            gaps = [gap for r in results for gap in r.itl_s[steps // 4 :]]  # every prompt is done by then
            if gaps:
                predicted = bare.step_s([], [context + steps // 2] * batch)
                samples.append((f"decode batch {batch}", statistics.median(gaps), predicted))
        for n in prompts:
            result = await client.send(BenchRequest(max_tokens=2, prompt=prompt(n)))
            chunks = [(s, min(s + SERVED_STEP_BUDGET, n)) for s in range(0, n, SERVED_STEP_BUDGET)]
            if result.ttft_s is not None:
                predicted = sum(bare.step_s([chunk], []) for chunk in chunks)
                samples.append((f"prefill {n}", result.ttft_s, predicted))
    return samples


def _fit_errors(
    samples: SampleTable, prefill: PrefillCost, decode: DecodeCost, transfer: TransferCost
) -> dict[str, float]:
    rows = samples.rows
    return {
        "prefill": median_relative_error([prefill.prompt_s(int(e), int(s)) for s, e, _ in rows["prefill"]],
                                         [t for *_, t in rows["prefill"]]),
        "decode": median_relative_error([decode.step_s(int(b), int(c)) for b, c, _ in rows["decode"]],
                                        [t for *_, t in rows["decode"]]),
        "transfer": median_relative_error([transfer.push_s(int(b)) for _, b, _ in rows["transfer"]],
                                          [t for *_, t in rows["transfer"]]),
    }  # fmt: skip

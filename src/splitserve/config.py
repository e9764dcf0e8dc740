"""Typed, frozen configuration for every part, validated in one place.

Each field a user can set is declared here once, with its help, flag and environment variable
(``splitserve.settings``): the command line, the resource file's flag rules and ``docs/configuration.md`` are
derived from these declarations. Environment variables, YAML and the command line are read only at the edges
(``cli.py``, ``endpoint.py``, ``envs.py``); everything below them receives these objects.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from splitserve import envs
from splitserve.settings import Section, Use, build, setting

ENGINE_PANEL = "Engine options"
CACHE_PANEL = "KV cache options"
TIERS_PANEL = "KV cache tier options (L1 memory, L2 Redis or disk)"
PD_PANEL = "Disaggregation options (KV transfer)"
SERVER_PANEL = "Server options"
ROUTING_PANEL = "Routing options"
FAULTS_PANEL = "Health and retry options"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
}


def parse_bytes(text: str | int) -> int:
    """Parse ``"2GiB"``, ``"512MB"``, ``"1073741824"`` or an int into a byte count."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a byte size: {text!r} (examples: 2GiB, 512MB, 1073741824)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def redact_url(url: str | None) -> str | None:
    """``url`` with its password replaced by ``***``, for logs."""
    if url is None:
        return None
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


class Role(StrEnum):
    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which model to load and how."""

    model: str = setting(
        "smollm2", "Model: a registry name (smollm2), a GGUF file or a Hugging Face folder.", use=Use.PLANNED,
        why="the plan gives every worker the resource's one model (spec.modelSourceConfig)",
    )  # fmt: skip
    served_model_name: str | None = setting(None, "The model name the API answers to (default: --model).")
    dtype: str = setting("auto", "auto, float32, bfloat16 or float16.")
    device: str = setting("auto", "auto (CUDA if present), cpu or cuda.")
    max_model_len: int | None = setting(None, "Context length (default: the model's).")
    seed: int = setting(0, "Seed of unseeded sampling (and of the random-weight test model).")
    num_threads: int | None = setting(None, "CPU threads for the engine (default: the CPUs this process may use).")
    quantization: str = setting(
        "auto",
        "gguf: every CPU matmul from a quantized GGUF's own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, IQ4_XS, "
        "Q2_K, Q3_K, Q4_K, Q5_K, Q6_K; native kernels); int4: PyTorch's int4 kernel for decode steps (bf16 CPU); "
        "auto: gguf, else int4, where they run; none: always the dequantized --dtype weights.",
    )
    tensor_parallel_size: int = setting(1, "Only 1 is supported (one engine per worker).")
    pipeline_parallel_size: int = setting(1, "Only 1 is supported (one engine per worker).")
    chat_template: str | None = setting(
        None, "A Jinja chat template in place of the model's own: a file, or the template itself (vLLM's "
        "--chat-template). examples/chat_templates/chatml_tools.jinja gives a ChatML model tool calling.",
    )  # fmt: skip

    def validate(self) -> None:
        for flag, size in (
            ("--tensor-parallel-size", self.tensor_parallel_size),
            ("--pipeline-parallel-size", self.pipeline_parallel_size),
        ):
            if size != 1:
                raise ValueError(f"{flag} {size} is not supported: splitserve runs one engine per worker (use 1)")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be one of auto, cpu, cuda; got {self.device!r}")
        if self.quantization not in ("auto", "none", "gguf", "int4"):
            raise ValueError(f"--quantization must be one of auto, none, gguf, int4; got {self.quantization!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"--num-threads must be positive, got {self.num_threads}")
        if self.max_model_len is not None and self.max_model_len < 16:
            raise ValueError(f"--max-model-len must be at least 16, got {self.max_model_len}")


class KVCacheDtype(StrEnum):
    AUTO = "auto"  # the model's dtype
    INT8 = "int8"  # model/kv_format.py
    FP8 = "fp8"  # E4M3, as vLLM's fp8
    FP8_E4M3 = "fp8_e4m3"  # the same


DEFAULT_MAX_NUM_BATCHED_TOKENS = 1024  # --max-num-batched-tokens; the routing score's step, too (policy.balance)
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30  # --kv-cache-memory unset on CPU (less where less memory is available)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV cache held by the engine."""

    block_size: int = setting(16, "Tokens per KV block; also the unit of the KV key scheme.")
    # on CUDA, None is what --gpu-memory-utilization leaves after weights and activations
    kv_cache_memory: str | None = setting(
        None,
        "KV cache size in bytes (2GiB) or as a fraction of free memory (0.3); default 2GiB on CPU, or what the "
        "memory available beside the model leaves when that is less. A size that does not fit is an error at start.",
        env=True,  # as vLLM's VLLM_CPU_KVCACHE_SPACE: every local pod of a small machine sized at once
    )
    gpu_memory_utilization: float = setting(0.9, "CUDA: the fraction of device memory for weights, activations and KV.")
    enable_prefix_caching: bool = setting(True, "Reuse the KV blocks of shared prompt prefixes.")
    kv_cache_dtype: KVCacheDtype = setting(
        KVCacheDtype.AUTO,
        "The KV cache's storage, in the engine, the tiers and PD pushes: auto (the model's dtype), int8 (a "
        "power-of-two scale per 16 values of a token's KV head: about half of bfloat16's bytes), or fp8 / fp8_e4m3 "
        "(E4M3 values with the same scales and bytes, coarser than int8; vLLM's name). README, model/kv_format.py.",
    )
    num_gpu_blocks_override: int | None = None  # tests: an exact number of KV blocks

    def validate(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"--block-size must be one of 8, 16, 32, 64, 128; got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        self.kv_cache_fraction_or_bytes()
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be positive, got {self.num_gpu_blocks_override}")

    def kv_cache_fraction_or_bytes(self) -> tuple[float | None, int | None]:
        """``(fraction, None)`` for a fraction of free memory, ``(None, bytes)`` for a size, or both None."""
        if self.kv_cache_memory is None:
            return None, None
        text = self.kv_cache_memory.strip()
        if re.fullmatch(r"0?\.[0-9]+|1\.0*|1", text):
            fraction = float(text)
            if not 0.0 < fraction <= 1.0:
                raise ValueError(f"--kv-cache-memory fraction must be in (0, 1], got {text}")
            return fraction, None
        num_bytes = parse_bytes(text)
        if num_bytes < 1 << 20:
            raise ValueError(f"--kv-cache-memory must be at least 1 MiB, got {text!r}")
        return None, num_bytes


class SchedulingPolicy(StrEnum):
    FCFS = "fcfs"  # waiting requests in arrival order
    LPM = "lpm"  # fewest uncached tokens first (SGLang's longest prefix match), oldest first past the max wait


SPECULATIVE_METHODS = ("ngram",)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's ``--speculative-config`` JSON shape (its ``ngram`` method's keys).

    Each decoding request proposes up to ``num_speculative_tokens`` draft tokens by prompt lookup: the tokens
    that followed the last earlier occurrence of its context's final n tokens (``prompt_lookup_max`` down to
    ``prompt_lookup_min``). A step computes the last token and the drafts as one chunk, samples every position
    and keeps the drafts up to the first that differs from its sample, plus that sample: the tokens are the ones
    decoding one at a time gives. Speculation pauses while more than ``disable_by_batch_size`` requests run.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int = 4

    @classmethod
    def parse(cls, text: str | None) -> SpeculativeConfig | None:
        """``--speculative-config``'s JSON; None or an empty text: no speculation."""
        if text is None or not text.strip():
            return None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown keys {unknown} (known: {sorted(known)})")
        try:
            config = cls(**raw)
        except TypeError as e:
            raise ValueError(f"--speculative-config: {e}") from None
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"--speculative-config: method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--speculative-config: {name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("--speculative-config: prompt_lookup_min must not exceed prompt_lookup_max")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous batching limits, and who goes first."""

    max_num_seqs: int = setting(64, "Requests running at once.")
    max_num_batched_tokens: int = setting(
        DEFAULT_MAX_NUM_BATCHED_TOKENS, "Tokens computed per engine step (prefill chunks and decodes)."
    )
    enable_chunked_prefill: bool = setting(True, "Split long prompts across steps (off: one step, budget permitting).")
    policy: SchedulingPolicy = setting(
        SchedulingPolicy.LPM,
        "Which waiting request goes first: lpm (fewest tokens left to compute, so cache hits pass cold prompts; "
        "oldest first past --scheduling-max-wait) or fcfs (arrival order).",
        flag="scheduling-policy",
    )
    max_wait_s: float = setting(
        5.0, "lpm: seconds after which a waiting request goes first, in arrival order.", flag="scheduling-max-wait"
    )
    step_time_target: float = setting(
        0.05,
        "Seconds an engine step aims at while a short request (a cached follow-up) waits: the prompts already in "
        "prefill share what it leaves of the step, and it is admitted whole. A step carrying prompt chunks takes "
        "at most 4 targets (or enough tokens that its fixed cost is a fifth of it at most). The tokens that fit "
        "are measured from the engine's own steps (0, or chunked prefill off: no target, every step takes "
        "--max-num-batched-tokens).",
    )
    speculative_config: SpeculativeConfig | None = setting(
        None,
        'Speculative decoding as vLLM\'s JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\': drafts by prompt lookup, verified in one step '
        "(the same tokens as without it); paused while more than disable_by_batch_size (4) requests run.",
        convert=SpeculativeConfig.parse,
        option_type=str | None,
        option_default=None,
        show_default=False,
    )
    verify_sample_rate: float = setting(
        0.001,
        "Fraction of the requests that reused KV (prefix cache, L1/L2, a prefill worker's push, a resumed "
        "stream) that are recomputed cold when nothing else waits and compared token by token; a mismatch "
        "counts in splitserve:exactness_mismatches_total and is logged (0: never).",
    )

    def validate(self) -> None:
        if self.speculative_config is not None:  # also checked as --speculative-config is parsed
            self.speculative_config.validate()
        if not 0.0 <= self.verify_sample_rate <= 1.0:
            raise ValueError(f"--verify-sample-rate must be in [0, 1], got {self.verify_sample_rate}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be positive, got {self.max_num_batched_tokens}")
        if not self.step_time_target >= 0:
            raise ValueError(f"--step-time-target must be >= 0 seconds, got {self.step_time_target}")
        if not self.max_wait_s >= 0:
            raise ValueError(f"--scheduling-max-wait must be >= 0, got {self.max_wait_s}")


class L2Backend(StrEnum):
    NONE = "none"
    REDIS = "redis"  # a Redis server shared by every worker (--l2-url)
    TIEREDSTORAGE = "tieredstorage"  # a directory on a local or mounted disk (--l2-path)


_REDIS_URL_SCHEMES = ("redis://", "rediss://", "unix://")


@dataclass(frozen=True, slots=True)
class KVTierConfig:
    """The tiered KV cache outside the engine: L1 in this process's memory, L2 shared by every worker.

    The engine loads chunks of a prompt (and a prompt's shorter tail of full blocks) from these tiers on
    admission and saves completed ones after each step. Off (the default) when neither tier is enabled.
    """

    l1_cache: bool = setting(
        False, "Keep computed KV chunks in this process's memory (L1, LRU).", env=True, use=Use.RESOURCE,
        why="spec.kvCacheSpec.enableL1Cache",
    )  # fmt: skip
    l1_cache_bytes: int = setting(
        1 << 30, "L1 size (1GiB, 512MB or bytes).", env=True, convert=parse_bytes, option_type=str,
        option_default="1GiB",
    )  # fmt: skip
    l2_backend: L2Backend = setting(
        L2Backend.NONE, "Shared L2 tier: redis (--l2-url) or tieredstorage (a directory, --l2-path).", env=True,
        use=Use.RESOURCE, why="spec.kvCacheSpec.l2CacheSpec.l2CacheBackend",
    )  # fmt: skip
    l2_url: str | None = setting(
        None, "Redis URL, redis://host:port/db (rediss:// for TLS).", env=True, use=Use.RESOURCE,
        why="spec.kvCacheSpec.l2CacheSpec.l2CacheLocalUrl",
    )  # fmt: skip
    l2_username: str | None = None  # Redis ACL user, when the URL names none (envs.REDIS_USERNAME)
    l2_password: str | None = field(default=None, repr=False)  # when the URL has none (envs.REDIS_PASSWORD)
    l2_key_prefix: str = setting(
        "",
        "Prefix of every Redis key (endpoints sharing one Redis stay apart). The Redis password and ACL user "
        f"come from the URL or {envs.REDIS_PASSWORD.name} / {envs.REDIS_USERNAME.name}, never a flag.",
        env=True,
    )
    l2_path: str | None = setting(
        None, "Directory of the tieredstorage tier.", env=True, use=Use.RESOURCE,
        why="spec.kvCacheSpec.l2CacheSpec.l2CachePath",
    )  # fmt: skip
    l2_max_bytes: int = setting(
        10 << 30, "tieredstorage: the directory's byte budget, as this worker sees it (10GiB or bytes).", env=True,
        convert=parse_bytes, option_type=str, option_default="10GiB",
    )  # fmt: skip
    kv_chunk_size: int = setting(256, "Tokens per stored KV chunk (a multiple of --block-size).", env=True)
    save_decode_cache: bool = setting(
        False, "Also store generated tokens' KV (and, on the decode role, store anything at all).", env=True,
        env_aliases=("LMCACHE_SAVE_DECODE_CACHE",),
    )  # fmt: skip

    @property
    def is_enabled(self) -> bool:
        return self.l1_cache or self.l2_backend != L2Backend.NONE

    def validate(self, block_size: int) -> None:
        if self.l1_cache_bytes <= 0:
            raise ValueError(f"--l1-cache-bytes must be positive, got {self.l1_cache_bytes}")
        if self.l2_max_bytes <= 0:
            raise ValueError(f"L2 max bytes must be positive, got {self.l2_max_bytes}")
        if self.kv_chunk_size <= 0 or self.kv_chunk_size % block_size:
            raise ValueError(
                f"--kv-chunk-size must be a positive multiple of --block-size ({block_size}), got {self.kv_chunk_size}"
            )
        self._validate_l2()

    def _validate_l2(self) -> None:
        backend = self.l2_backend
        if backend == L2Backend.REDIS:
            if not self.l2_url:
                raise ValueError("--l2-backend redis needs --l2-url redis://host:port/db (or SPLITSERVE_L2_URL)")
            if not self.l2_url.startswith(_REDIS_URL_SCHEMES):
                raise ValueError(
                    f"--l2-url must start with one of {', '.join(_REDIS_URL_SCHEMES)}; got {self.l2_url!r}"
                )
        elif self.l2_url:
            raise ValueError(f"--l2-url {self.l2_url!r} is only used with --l2-backend redis (got {backend.value})")
        if backend == L2Backend.TIEREDSTORAGE and not self.l2_path:
            raise ValueError("--l2-backend tieredstorage needs --l2-path DIR (or SPLITSERVE_L2_PATH)")
        if backend != L2Backend.TIEREDSTORAGE and self.l2_path:
            raise ValueError(f"--l2-path is only used with --l2-backend tieredstorage (got {backend.value})")


DEFAULT_PD_BUFFER_BYTES = 1 << 30  # ~18 prompts of 2,500 tokens of SmolLM2 KV in bfloat16 (58 MB each)


@dataclass(frozen=True, slots=True)
class PDConfig:
    """KV transfer between prefill (sender) and decode (receiver) workers."""

    kv_transfer_host: str = "127.0.0.1"  # where a decode worker's receiver listens (the worker's --host)
    kv_transfer_advertise_host: str | None = None  # the host prefill workers connect to (default: the bound one)
    kv_transfer_port: int = setting(
        0, "Decode role: port of the KV receiver prefill workers push to (0: any free port, shown at "
        "GET /kv/transfer).", use=Use.INSTANCE,
    )  # fmt: skip
    pd_buffer_size: int = setting(
        DEFAULT_PD_BUFFER_BYTES, "Decode role: bytes of pushed KV held until their requests arrive (1GiB, 512MB or "
        "bytes).", env=True, env_aliases=("PD_BUFFER_SIZE",), convert=parse_bytes, option_type=str,
        option_default="1GiB",
    )  # fmt: skip
    transfer_deadline_s: float = setting(
        10.0, "Prefill role: seconds to keep retrying a KV push (a full PD buffer); then decode recomputes.",
        flag="kv-transfer-timeout",
    )  # fmt: skip

    def validate(self) -> None:
        if not 0 <= self.kv_transfer_port < 65536:
            raise ValueError(f"--kv-transfer-port must be in [0, 65535], got {self.kv_transfer_port}")
        if self.pd_buffer_size <= 0:
            raise ValueError(f"--pd-buffer-size must be positive, got {self.pd_buffer_size}")
        if not self.transfer_deadline_s > 0:
            raise ValueError(f"the transfer deadline must be positive, got {self.transfer_deadline_s}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_tiers: KVTierConfig = field(default_factory=KVTierConfig)
    pd: PDConfig = field(default_factory=PDConfig)

    def validate(self) -> None:
        self.model.validate()
        self.cache.validate()
        self.scheduler.validate()
        self.kv_tiers.validate(self.cache.block_size)
        self.pd.validate()


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config``: the worker also publishes its engine's KV events in vLLM's format over ZMQ
    (``splitserve.worker.vllm_publisher``), for consumers built for vLLM (llm-d's KV indexer, Dynamo's router,
    a splitserve router). The fields and their defaults are vLLM's."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"  # "zmq", or "null": publish nothing
    endpoint: str = "tcp://*:5557"  # the PUB socket: bound where the host is * or ::, else connected to
    replay_endpoint: str | None = None  # a ROUTER socket that answers replay requests (bound); None: none
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark: messages queued per subscriber before dropping
    max_queue_size: int = 100_000  # batches waiting for the sender thread; past it, new ones are dropped
    topic: str = ""  # the first frame of every message (subscribers filter on its prefix)

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse the flag's JSON object; ``ValueError`` for anything but vLLM's keys with the right types."""
        try:
            body = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--kv-events-config must be a JSON object: {exc}") from None
        if not isinstance(body, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        unknown = sorted(set(body) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"--kv-events-config: unknown keys {', '.join(unknown)}")
        config = cls(**body)
        config.validate()
        return config

    @property
    def is_enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def validate(self) -> None:
        types = {"enable_kv_cache_events": bool, "publisher": str, "endpoint": str, "buffer_steps": int,
                 "hwm": int, "max_queue_size": int, "topic": str}  # fmt: skip
        for name, kind in types.items():
            value = getattr(self, name)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ValueError(f"--kv-events-config: {name} must be a {kind.__name__}, got {value!r}")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher must be zmq or null, got {self.publisher!r}")
        for name in ("endpoint", "replay_endpoint"):
            endpoint = getattr(self, name)
            if endpoint is not None and (not isinstance(endpoint, str) or "://" not in endpoint):
                raise ValueError(f"--kv-events-config: {name} must be a ZMQ address (tcp://*:5557), got {endpoint!r}")
        if min(self.buffer_steps, self.hwm, self.max_queue_size) < 1:
            raise ValueError("--kv-events-config: buffer_steps, hwm and max_queue_size must be positive")


def _otlp_traces_endpoint() -> Any:
    """The tracing setting, the same on the worker and the router (``splitserve.tracing``)."""
    return setting(
        None, "Send OpenTelemetry traces over OTLP/HTTP to this collector (http://HOST:4318, or its full "
        ".../v1/traces URL), as vLLM's flag; a client's W3C traceparent is followed (default: no tracing, at no cost).",
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class AccessConfig:
    """Who may call a worker or the router (``splitserve.auth``): client keys, tenants, the cluster secret."""

    api_keys: tuple[str, ...] = setting(
        (), f"A client key /v1/* requires as 'Authorization: Bearer KEY' (repeatable). Also read from "
        f"{envs.API_KEY.name} and {envs.VLLM_API_KEY.name}. Without one, /v1/* is open.", flag="api-key",
        convert=lambda flags: client_keys(flags or ()), use=Use.REFUSED,
        why=f"client keys are credentials: give {envs.API_KEY.name} from a Secret (spec.worker.environmentVariables "
        "with valueFrom)", secret=True,
    )  # fmt: skip
    salt_per_api_key: bool = setting(
        False, "Make each client key a cache tenant: its requests share cached prefixes with no other key's (a "
        "cache_salt derived from the key, then the request's own cache_salt).", env=True,
    )  # fmt: skip
    cluster_secret: str | None = setting(
        None, f"A file holding the cluster secret, the credential of the cluster's own processes: the router sends "
        f"it to workers in place of a client's key (default: the {envs.CLUSTER_SECRET.name} environment variable).",
        flag="cluster-secret-file", option_type=str | None, convert=lambda path: cluster_secret(path),
        use=Use.REFUSED, why="splitserve makes the cluster secret itself and hands it to every worker", secret=True,
    )  # fmt: skip


TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
REASONING_PARSERS = ("deepseek_r1", "qwen3")


@dataclass(frozen=True, slots=True)
class ServerConfig(AccessConfig):
    """The worker's HTTP server."""

    host: str = setting("127.0.0.1", "Address to bind.", use=Use.PLANNED, why="the supervisor or operator binds "
                        "each worker")  # fmt: skip
    port: int = setting(8000, "Port to bind.", use=Use.PLANNED, why="the supervisor or operator binds each worker")
    role: Role = setting(
        Role.COLOCATED, "colocated, prefill (KV sender) or decode (KV receiver).", use=Use.RESOURCE,
        why="spec.pdSpec (its presence and the role)",
    )  # fmt: skip
    max_request_body_bytes: int = 16 << 20
    max_tokens_limit: int | None = setting(
        None, "The most max_tokens a request may ask for, and what it gets when it sets none (default: the "
        "context left).",
    )  # fmt: skip
    tool_call_parser: str | None = setting(
        None, "How tool calls are read from the model's output: hermes (<tool_call> JSON </tool_call>: Qwen, "
        "Hermes, ChatML), llama3_json or mistral ([TOOL_CALLS]); default: the one the chat template writes.",
    )  # fmt: skip
    reasoning_parser: str | None = setting(
        None, "Split the model's reasoning off its answer into reasoning_content: deepseek_r1 or qwen3 (text "
        "up to </think>); default: none.",
    )  # fmt: skip
    max_logprobs: int = setting(
        20, "The most log-probabilities a request may ask for per token (logprobs, top_logprobs, prompt_logprobs), "
        "as vLLM's --max-logprobs; -1: up to the vocabulary.",
    )  # fmt: skip
    max_queued_requests: int | None = setting(
        None, "Requests that may wait to start (not yet running: SGLang's --max-queued-requests); past that, new "
        "ones get a 429 with Retry-After (default: no bound).",
    )  # fmt: skip
    max_num_queued_reqs: int | None = setting(
        None, "Requests that may be in flight, waiting or running (one with n choices counts n), as vLLM's "
        "--max-num-queued-reqs; past that, a 429 (default: no bound).",
    )  # fmt: skip
    max_num_queued_tokens: int | None = setting(
        None, "Prompt tokens still to compute (of the requests waiting or in prefill) past which new requests get "
        "a 429, as vLLM's --max-num-queued-tokens (default: no bound).",
    )  # fmt: skip
    max_queue_delay_s: float = setting(
        30.0, "Seconds of queue past which new requests get a 429: the oldest request waiting to start has waited "
        "this long, or the prompt tokens ahead take this long at the engine's measured rate; 0: no bound.",
        flag="max-queue-delay",
    )  # fmt: skip
    shutdown_timeout_s: float = setting(
        30.0, "On SIGTERM the worker drains: it takes no new requests and lets those in flight finish, for at most "
        "this many seconds.", flag="shutdown-timeout",
    )  # fmt: skip
    kv_events_url: str | None = setting(
        None, "Send KV events (registration, cached blocks and chunks per tier) to this URL, normally the "
        "router's http://HOST:PORT/kv/events, for its kvaware routing.", env=True, use=Use.INSTANCE,
    )  # fmt: skip
    kv_events_config: KVEventsConfig | None = setting(
        None, "Also publish the engine's KV events in vLLM's format over ZMQ, configured as vLLM's flag is: "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}\' (for llm-d, Dynamo, a vLLM-kind router).',
        option_type=str | None, convert=lambda text: None if text is None else KVEventsConfig.from_json(text),
        use=Use.REFUSED, why="its ZMQ ports are one per process, so replicas on one machine would collide; a "
        "splitserve router follows splitserve workers over HTTP (kvaware)",
    )  # fmt: skip
    worker_id: str | None = setting(None, "This worker's name in KV events (default: host:port).", use=Use.INSTANCE)
    otlp_traces_endpoint: str | None = _otlp_traces_endpoint()
    advertise_url: str | None = setting(
        None, "The URL the router reaches this worker at (default: http://host:port).", use=Use.INSTANCE
    )
    log_level: str = setting("info", "debug, info, warning or error.", flag="uvicorn-log-level")

    def validate(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        for flag, url in (("--kv-events-url", self.kv_events_url), ("--advertise-url", self.advertise_url)):
            if url is not None and not url.startswith(("http://", "https://")):
                raise ValueError(f"{flag} must start with http:// or https://, got {url!r}")
        for flag, value in (
            ("--max-tokens-limit", self.max_tokens_limit),
            ("--max-queued-requests", self.max_queued_requests),
            ("--max-num-queued-reqs", self.max_num_queued_reqs),
            ("--max-num-queued-tokens", self.max_num_queued_tokens),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be positive, got {value}")
        if not self.max_queue_delay_s >= 0:
            raise ValueError(f"--max-queue-delay must be at least 0, got {self.max_queue_delay_s}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}; got "
                             f"{self.tool_call_parser!r}")  # fmt: skip
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}; got "
                             f"{self.reasoning_parser!r}")  # fmt: skip
        if self.max_logprobs < -1:
            raise ValueError(f"--max-logprobs must be -1 (the vocabulary) or at least 0, got {self.max_logprobs}")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"--shutdown-timeout must be at least 0, got {self.shutdown_timeout_s}")
        if self.log_level.lower() not in (*LOG_LEVELS, "trace"):
            raise ValueError(f"--uvicorn-log-level must be one of debug, info, warning, error; got {self.log_level!r}")
        if self.kv_events_config is not None:
            self.kv_events_config.validate()

    @property
    def url(self) -> str:
        """The base URL other processes reach this worker at."""
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        host = self.host if self.host not in ("0.0.0.0", "::", "") else socket.gethostname()
        return f"http://{host}:{self.port}"

    @property
    def name(self) -> str:
        """The worker's id in KV events and router logs."""
        return self.worker_id or self.url.split("://", 1)[1]


class RoutingStrategy(StrEnum):
    ROUNDROBIN = "roundrobin"
    SESSION = "session"
    PREFIXAWARE = "prefixaware"
    KVAWARE = "kvaware"


class PDDecision(StrEnum):
    """How the router decides that a request of a disaggregated endpoint is prefilled on the prefill pool."""

    THRESHOLD = "threshold"  # every request whose uncached tokens reach routingThreshold (the reference system)
    COST = "cost"  # from the threshold up, only when prefill plus push beats the decode worker's own prefill
    # and the stall it imposes on the streams that worker runs (router/disagg.py)


class BackendKind(StrEnum):
    """What a worker behind the router is; it decides where ``kvaware`` gets the worker's KV events."""

    AUTO = "auto"  # ask each worker's GET /version: splitserve's answer names its "cpu", vLLM's does not
    SPLITSERVE = "splitserve"  # GET /kv/events, a long poll
    VLLM = "vllm"  # vLLM's ZMQ publisher (vLLM started with --kv-events-config)

    @staticmethod
    def shown_by(version: Any) -> BackendKind | None:
        """The kind a worker's ``GET /version`` answer (its JSON) shows; None without one."""
        if not isinstance(version, dict):
            return None
        return BackendKind.VLLM if "version" in version and "cpu" not in version else BackendKind.SPLITSERVE


@dataclass(frozen=True)
class RouterConfig(AccessConfig):
    """The router: where it listens, its workers, how it picks one, and how it treats failures."""

    backends: tuple[str, ...] = setting((), "A worker's base URL (repeatable).", flag="backend", panel=ROUTING_PANEL)
    prefill: tuple[str, ...] = setting((), "A prefill worker's URL (repeatable; disaggregated).", panel=ROUTING_PANEL)
    decode: tuple[str, ...] = setting((), "A decode worker's URL (repeatable; disaggregated).", panel=ROUTING_PANEL)
    model: str = setting("smollm2", "The model whose tokenizer and chat template routing uses.")
    host: str = setting("127.0.0.1", "Address to bind.")
    port: int = setting(8080, "Port to bind.")
    admin_host: str = setting("127.0.0.1", "Interface of the admin listener (/admin/*: the worker lists).")
    admin_port: int | None = setting(None, "Port of the admin listener (default: --port + 1).", show_default=False)
    routing_strategy: RoutingStrategy = setting(
        RoutingStrategy.ROUNDROBIN, "roundrobin, session, prefixaware or kvaware.", panel=ROUTING_PANEL
    )
    routing_threshold: int = setting(
        4096, "Prompt tokens from which a request is prefilled on the prefill pool.", panel=ROUTING_PANEL
    )
    pd_decision: PDDecision = setting(
        PDDecision.THRESHOLD, "threshold: disaggregate every prompt from --routing-threshold (the reference rule); "
        "cost: from there, only when prefill plus the KV push beats the decode worker prefilling it while stalling "
        "its streams (measured costs).", env=True, panel=ROUTING_PANEL,
    )  # fmt: skip
    session_key: str = setting(
        "x-session-id", "Header naming the session (the body's user field also counts).", convert=str.lower,
        panel=ROUTING_PANEL,
    )  # fmt: skip
    block_size: int = setting(16, "The workers' KV block size (the KV key scheme).", panel=ROUTING_PANEL)
    kv_chunk_size: int = setting(256, "The workers' KV chunk size.", panel=ROUTING_PANEL)
    prefix_index_max_blocks: int = setting(200_000, "prefixaware: block hashes remembered (LRU).", panel=ROUTING_PANEL)
    kv_index_max_blocks: int = setting(
        1_000_000, "kvaware: block hashes kept per worker and tier (and for the shared L2).", panel=ROUTING_PANEL
    )
    l2_weight: float = setting(
        0.5, "kvaware: what a token in the shared L2 counts next to one in a worker (0..1).", flag="kv-l2-weight",
        panel=ROUTING_PANEL,
    )  # fmt: skip
    backend_kind: BackendKind = setting(
        BackendKind.AUTO, "kvaware: what the workers are, hence where their KV events come from: splitserve "
        "(GET /kv/events), vllm (its ZMQ publisher, --kv-events-config) or auto (ask each worker's /version). "
        "session and prefixaware follow the splitserve workers' load the same way (vLLM reports none).",
        panel=ROUTING_PANEL,
    )  # fmt: skip
    vllm_kv_events_port: str | None = setting(
        None, "kvaware: a vLLM worker's KV event port (its --kv-events-config endpoint), reached at "
        "tcp://<worker host>:PORT; +N means the worker's HTTP port plus N (default: what the worker's "
        "/kv_event_sources names, else 5557).", panel=ROUTING_PANEL,
    )  # fmt: skip
    vllm_kv_replay_port: str | None = setting(
        None, "kvaware: a vLLM worker's replay port (its replay_endpoint), the same way (default: as the worker "
        "names it, if it does; without one, missed events make the router forget that worker's blocks).",
        panel=ROUTING_PANEL,
    )  # fmt: skip
    vllm_kv_transfer_port: str | None = setting(
        None, "Disaggregation over vLLM workers: a decode vLLM's KV receiver (splitserve's connector, its "
        "kv-transfer-port), reached at <worker host>:PORT; +N means the worker's HTTP port plus N. Decode workers "
        "that answer GET /kv/transfer (splitserve's) say where theirs is.", panel=ROUTING_PANEL,
    )  # fmt: skip
    routing_cost_model: bool = setting(
        True, "Cache-aware: pick the worker with the lowest estimated TTFT (its uncached tokens plus the prefill "
        "queued there that goes first, times its measured seconds per token); off: the thresholds below (SGLang's).",
        panel=ROUTING_PANEL,
    )  # fmt: skip
    cache_threshold: float = setting(
        0.4, "Cache-aware, without the cost model: a match under this share of the prompt goes to the "
        "least-loaded worker.", panel=ROUTING_PANEL,
    )  # fmt: skip
    balance_abs_threshold: int = setting(
        4, "Load guard: the in-flight gap to the least-loaded worker that counts as skew...", panel=ROUTING_PANEL
    )
    balance_rel_threshold: float = setting(
        1.5, "...when it is also this many times that worker's load + 1.", panel=ROUTING_PANEL
    )
    health_interval_s: float = setting(
        2.0, "Seconds between /health probes.", flag="health-interval", panel=FAULTS_PANEL
    )
    health_timeout_s: float = setting(
        2.0, "Seconds a /health probe may take.", flag="health-timeout", panel=FAULTS_PANEL
    )
    health_failure_threshold: int = setting(
        2, "Failed probes in a row that mark a worker unhealthy.", panel=FAULTS_PANEL
    )
    health_success_threshold: int = setting(1, "Good probes in a row that mark it healthy again.", panel=FAULTS_PANEL)
    connect_timeout_s: float = setting(
        2.0, "Seconds to connect to a worker.", flag="connect-timeout", panel=FAULTS_PANEL
    )
    read_timeout_s: float = setting(
        600.0, "Seconds a worker may stay silent mid-answer.", flag="read-timeout", panel=FAULTS_PANEL
    )
    max_retries: int = setting(
        2, "Other workers to try when one fails before answering (each not yet tried).", panel=FAULTS_PANEL
    )
    retry_backoff_s: float = setting(
        0.05, "Base of the jittered exponential back-off between attempts, in seconds.", flag="retry-backoff",
        panel=FAULTS_PANEL,
    )  # fmt: skip
    breaker_failure_threshold: int = setting(
        3, "Failed requests in a row that open a worker's breaker.", panel=FAULTS_PANEL
    )
    breaker_cooldown_s: float = setting(
        5.0, "Seconds before a tripped breaker lets a trial through (doubling while trials fail, up to 60).",
        flag="breaker-cooldown", panel=FAULTS_PANEL,
    )  # fmt: skip
    stream_migration: bool = setting(
        True, "Resume a stream whose worker fails mid-answer on another worker.", panel=FAULTS_PANEL
    )
    max_concurrent_requests: int | None = setting(
        None, "Client requests handled at once; as many more wait for a slot, the rest get a 429 (default: no "
        "bound).", panel=FAULTS_PANEL,
    )  # fmt: skip
    queue_timeout_s: float = setting(
        10.0, "Seconds a request past --max-concurrent-requests waits for a slot before its 429.",
        flag="queue-timeout", panel=FAULTS_PANEL,
    )  # fmt: skip
    shutdown_timeout_s: int = setting(
        30, "On SIGTERM the router takes no new connections and lets streams in flight finish, for at most this "
        "many seconds.", flag="shutdown-timeout", panel=FAULTS_PANEL,
    )  # fmt: skip
    max_request_body_bytes: int = 16 << 20
    log_level: str = setting("info", "debug, info, warning or error.")
    otlp_traces_endpoint: str | None = _otlp_traces_endpoint()

    @property
    def admin_listen_port(self) -> int:
        """Where ``/admin/*`` is served: ``admin_port``, else the port after ``port`` (any free one if 0)."""
        if self.admin_port is not None:
            return self.admin_port
        return self.port + 1 if 0 < self.port < 65535 else 0

    def validate(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if not 0 <= self.admin_listen_port < 65536 or (self.port and self.admin_listen_port == self.port):
            raise ValueError(f"--admin-port must be in [0, 65535] and differ from --port, got {self.admin_listen_port}")
        if not self.backends and not (self.prefill and self.decode):
            raise ValueError("give at least one --backend, or both --prefill and --decode")
        if self.backends and (self.prefill or self.decode):
            raise ValueError("give either --backend (colocated workers) or --prefill and --decode, not both")
        for url in (*self.backends, *self.prefill, *self.decode):
            checked_worker_url(url)
        if self.block_size < 1 or self.kv_chunk_size < self.block_size or self.kv_chunk_size % self.block_size:
            raise ValueError(
                f"--kv-chunk-size ({self.kv_chunk_size}) must be a positive multiple of --block-size "
                f"({self.block_size})"
            )
        if self.prefix_index_max_blocks < 1 or self.kv_index_max_blocks < 1:
            raise ValueError("index caps must be positive")
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError(f"--cache-threshold must be in [0, 1], got {self.cache_threshold}")
        if not 0 <= self.l2_weight <= 1:
            raise ValueError(f"--kv-l2-weight must be in [0, 1], got {self.l2_weight}")
        if self.health_failure_threshold < 1 or self.health_success_threshold < 1:
            raise ValueError("health thresholds must be at least 1")
        if self.max_retries < 0 or self.breaker_failure_threshold < 1:
            raise ValueError("--max-retries must be >= 0 and the breaker threshold >= 1")
        for name in ("health_interval_s", "health_timeout_s", "connect_timeout_s", "read_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.routing_threshold < 1:
            raise ValueError(f"--routing-threshold must be positive, got {self.routing_threshold}")
        if self.max_concurrent_requests is not None and self.max_concurrent_requests < 1:
            raise ValueError(f"--max-concurrent-requests must be positive, got {self.max_concurrent_requests}")
        if not self.queue_timeout_s >= 0:
            raise ValueError(f"--queue-timeout must be at least 0, got {self.queue_timeout_s}")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of debug, info, warning, error; got {self.log_level!r}")
        for flag, spec in (("--vllm-kv-events-port", self.vllm_kv_events_port),
                           ("--vllm-kv-replay-port", self.vllm_kv_replay_port),
                           ("--vllm-kv-transfer-port", self.vllm_kv_transfer_port)):  # fmt: skip
            if spec is not None:
                port_of(spec, 0, flag)


def port_of(spec: str, http_port: int, flag: str = "port") -> int:
    """The port ``spec`` names for a worker serving HTTP on ``http_port``: ``"5557"``, or ``"+N"`` for
    ``http_port + N``; ``ValueError`` naming ``flag`` otherwise."""
    match = re.fullmatch(r"(\+?)(\d{1,5})", spec.strip())
    port = int(match[2]) + (http_port if match[1] else 0) if match else 0
    if not 0 < port < 65536:
        raise ValueError(f"{flag} must be a port (5557) or an offset from the worker's HTTP port (+1000), got {spec!r}")
    return port


def checked_worker_url(url: object) -> str:
    """A worker's base URL as ``http(s)://host[:port]``, normalized; ``ValueError`` for anything else.

    No credentials, path, query or fragment: a URL from an admin update or a KV event is where the router sends
    clients' prompts, so nothing may ride along with it.
    """
    if not isinstance(url, str):
        raise ValueError("a worker URL must be a string")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{url!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} must be http(s)://host[:port]")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise ValueError(f"{url!r} must not carry credentials")
    if parts.path not in ("", "/") or parts.query or parts.fragment or url.rstrip("/").endswith(("?", "#")):
        raise ValueError(f"{url!r} must be a bare http(s)://host[:port], with no path, query or fragment")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")


def client_keys(flags: Iterable[str]) -> tuple[str, ...]:
    """The client keys from ``--api-key`` flags, then the environment (``envs.API_KEY``, ``envs.VLLM_API_KEY``)."""
    keys = [key.strip() for key in flags]
    keys += [value for variable in (envs.API_KEY, envs.VLLM_API_KEY) if (value := envs.get(variable))]
    if any(not key for key in keys):
        raise ValueError("--api-key must not be empty")
    return tuple(dict.fromkeys(keys))


def cluster_secret(path: str | None) -> str | None:
    """The cluster secret from ``--cluster-secret-file`` (its text, stripped), else ``envs.CLUSTER_SECRET``."""
    if path:
        try:
            secret = Path(path).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"cannot read --cluster-secret-file {path}: {exc.strerror}") from None
        if not secret:
            raise ValueError(f"--cluster-secret-file {path} is empty")
        return secret
    return envs.get(envs.CLUSTER_SECRET) or None


# The settings of `splitserve worker` and `splitserve router`, in --help order (splitserve.settings).
WORKER_SECTIONS = (
    Section(ModelConfig, ENGINE_PANEL),
    Section(SchedulerConfig, ENGINE_PANEL),
    Section(CacheConfig, CACHE_PANEL),
    Section(KVTierConfig, TIERS_PANEL),
    Section(PDConfig, PD_PANEL),
    Section(ServerConfig, SERVER_PANEL),
)
ROUTER_SECTIONS = (Section(RouterConfig),)


def worker_configs(values: dict[str, Any]) -> tuple[EngineConfig, ServerConfig]:
    """The configs of ``splitserve worker`` from its option values (by parameter), validated; ``ValueError``
    names the flag that is wrong."""
    host, advertise_url = values["host"], values["advertise_url"]
    engine = EngineConfig(
        model=build(ModelConfig, values),
        cache=build(CacheConfig, values),
        scheduler=build(SchedulerConfig, values),
        kv_tiers=build(
            KVTierConfig,
            values,
            l2_username=envs.get(envs.REDIS_USERNAME) or None,
            l2_password=envs.get(envs.REDIS_PASSWORD) or None,
        ),
        pd=build(
            PDConfig,
            values,
            kv_transfer_host="0.0.0.0" if host in ("0.0.0.0", "::") else host,
            kv_transfer_advertise_host=urlsplit(advertise_url).hostname if advertise_url else None,
        ),
    )
    server = build(ServerConfig, values)
    engine.validate()
    server.validate()
    return engine, server


def router_config(values: dict[str, Any]) -> RouterConfig:
    """The config of ``splitserve router`` from its option values, validated (``ValueError`` names the flag)."""
    config = build(RouterConfig, values)
    config.validate()
    return config

"""Typed, frozen configuration for every part, validated in one place.

Environment variables, YAML and the command line are read only at the edges (``cli.py``, ``endpoint.py``);
everything below them receives these objects.
"""

from __future__ import annotations

import json
import re
import socket
from dataclasses import dataclass, field, fields
from enum import StrEnum
from urllib.parse import urlsplit, urlunsplit

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

    model: str = "smollm2"  # a registry name or a path to a GGUF file or a Hugging Face folder
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto (CUDA when present, else CPU) | cpu | cuda
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0  # seeds the random-weight test model and unseeded sampling
    served_model_name: str | None = None  # the name the API answers to; None: the model argument
    num_threads: int | None = None  # CPU threads for torch ops; None: the CPUs this process may run on
    # Where matmul weights come from: "gguf" runs every matmul from a Q4_0/Q4_1/Q8_0 GGUF's own blocks in the
    # native CPU kernels; "int4" uses PyTorch's int4 kernel for decode-sized matmuls (bfloat16 on CPU);
    # "auto" takes gguf, else int4, where they can run; "none" always uses the dequantized --dtype weights.
    quantization: str = "auto"

    def validate(self) -> None:
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


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV cache held by the engine."""

    block_size: int = 16  # tokens per KV block; also the unit of the key scheme
    # KV cache size: bytes ("2GiB", "1073741824") or a fraction of free memory ("0.3"). None: 2 GiB on CPU;
    # on CUDA, what --gpu-memory-utilization leaves after weights and activations.
    kv_cache_memory: str | None = None
    gpu_memory_utilization: float = 0.9  # on CUDA: fraction of device memory for weights + activations + KV
    enable_prefix_caching: bool = True
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


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous batching limits, and who goes first."""

    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 1024  # tokens computed per engine step (prefill chunks + decodes)
    enable_chunked_prefill: bool = True  # off: a prompt is prefilled in one step, budget permitting
    policy: SchedulingPolicy = SchedulingPolicy.LPM
    max_wait_s: float = 5.0  # lpm: a request waiting longer than this is admitted first, in arrival order
    # when the next waiting request is short (its uncached tokens fit beside this), the running ones still in
    # prefill take at most this many tokens per step between them, and the rest admits short requests whole:
    # a cached follow-up gets its first token in one short step; 0: no limit
    long_prefill_token_threshold: int = 256
    # the fraction of requests that reused KV (engine cache, L1/L2, a prefill worker's push, a resumed stream)
    # recomputed cold when nothing else waits and compared token by token (engine.verifier); 0: never
    verify_sample_rate: float = 0.001

    def validate(self) -> None:
        if not 0.0 <= self.verify_sample_rate <= 1.0:
            raise ValueError(f"--verify-sample-rate must be in [0, 1], got {self.verify_sample_rate}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be positive, got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"--long-prefill-token-threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if not self.max_wait_s >= 0:
            raise ValueError(f"--scheduling-max-wait must be >= 0, got {self.max_wait_s}")


class L2Backend(StrEnum):
    NONE = "none"
    REDIS = "redis"  # a Redis server shared by every worker (--l2-url)
    TIEREDSTORAGE = "tieredstorage"  # a directory on a local or mounted disk (--l2-path)


_REDIS_URL_SCHEMES = ("redis://", "rediss://", "unix://")
REDIS_PASSWORD_ENV = "SPLITSERVE_REDIS_PASSWORD"
REDIS_USERNAME_ENV = "SPLITSERVE_REDIS_USERNAME"


@dataclass(frozen=True, slots=True)
class KVTierConfig:
    """The tiered KV cache outside the engine: L1 in this process's memory, L2 shared by every worker.

    The engine loads chunks of a prompt (and a prompt's shorter tail of full blocks) from these tiers on
    admission and saves completed ones after each step. Off (the default) when neither tier is enabled.
    """

    l1_cache: bool = False  # keep saved chunks in this process's memory (LRU)
    l1_cache_bytes: int = 1 << 30  # L1 budget in bytes
    l2_backend: L2Backend = L2Backend.NONE
    l2_url: str | None = None  # redis://host:port/db (or rediss:// for TLS), for the redis backend
    l2_username: str | None = None  # Redis ACL user, when the URL names none (SPLITSERVE_REDIS_USERNAME)
    l2_password: str | None = field(default=None, repr=False)  # when the URL has none (SPLITSERVE_REDIS_PASSWORD)
    l2_key_prefix: str = ""  # put before every Redis key, so endpoints can share one Redis apart
    l2_path: str | None = None  # a directory, for the tieredstorage backend
    l2_max_bytes: int = 10 << 30  # tieredstorage: byte budget of the directory (this worker's view)
    kv_chunk_size: int = 256  # tokens per stored chunk; a multiple of the block size
    save_decode_cache: bool = False  # also save generated tokens (and, on the decode role, anything at all)

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

    kv_transfer_host: str = "127.0.0.1"  # where a decode worker's receiver listens
    kv_transfer_advertise_host: str | None = None  # the host prefill workers connect to (default: the bound one)
    kv_transfer_port: int = 0  # 0: a free port, reported at GET /kv/transfer
    pd_buffer_size: int = DEFAULT_PD_BUFFER_BYTES  # bytes of pushed KV a decode worker holds until claimed
    transfer_deadline_s: float = 10.0  # a prefill worker gives up pushing after this (then decode recomputes)

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
    (``splitserve.vllm_publisher``), for consumers built for vLLM (llm-d's KV indexer, Dynamo's router, a
    splitserve router). The fields and their defaults are vLLM's."""

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


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The worker's HTTP server."""

    host: str = "127.0.0.1"
    port: int = 8000
    role: Role = Role.COLOCATED
    max_request_body_bytes: int = 16 << 20
    max_tokens_limit: int | None = None  # cap on max_tokens, and the default when none is set; None: the context
    max_queued_requests: int | None = None  # requests waiting for their first token before a 429; None: no bound
    shutdown_timeout_s: float = 30.0  # SIGTERM: how long requests in flight may run on before they are cut
    kv_events_url: str | None = None  # where KV events go (the router's /kv/events); None: not sent
    kv_events_config: KVEventsConfig | None = None  # vLLM-format KV events over ZMQ; None: not published
    worker_id: str | None = None  # None: host:port
    advertise_url: str | None = None  # how others reach this worker; None: http://host:port
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # client keys for /v1/* (splitserve.auth); none: open
    salt_per_api_key: bool = False  # every client key a cache tenant (auth.tenant_salt)
    cluster_secret: str | None = field(default=None, repr=False)  # the router's credential; accepted like a key

    def validate(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        for flag, url in (("--kv-events-url", self.kv_events_url), ("--advertise-url", self.advertise_url)):
            if url is not None and not url.startswith(("http://", "https://")):
                raise ValueError(f"{flag} must start with http:// or https://, got {url!r}")
        for flag, value in (
            ("--max-tokens-limit", self.max_tokens_limit),
            ("--max-queued-requests", self.max_queued_requests),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be positive, got {value}")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"--shutdown-timeout must be at least 0, got {self.shutdown_timeout_s}")
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


@dataclass(frozen=True)
class RouterConfig:
    """The router: where it listens, its workers, how it picks one, and how it treats failures."""

    model: str = "smollm2"  # names the tokenizer and chat template only
    host: str = "127.0.0.1"
    port: int = 8080
    admin_host: str = "127.0.0.1"  # the admin listener (/admin/*): loopback unless asked otherwise
    admin_port: int | None = None  # None: ``port`` + 1
    backends: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()  # disaggregated endpoints: prefill pool (the DPD issue)
    decode: tuple[str, ...] = ()  # disaggregated endpoints: decode pool
    routing_strategy: RoutingStrategy = RoutingStrategy.ROUNDROBIN
    routing_threshold: int = 4096  # prompt tokens at which a request is prefilled on the prefill pool
    pd_decision: PDDecision = PDDecision.THRESHOLD  # the threshold alone, or the threshold as a floor and costs
    session_key: str = "x-session-id"  # header carrying the session; the body's ``user`` field also counts
    block_size: int = 16  # must match the workers' (the KV key scheme)
    kv_chunk_size: int = 256  # must match the workers'
    prefix_index_max_blocks: int = 200_000  # prefixaware: block hashes remembered (LRU)
    kv_index_max_blocks: int = 1_000_000  # kvaware: block hashes kept per worker and tier (and for the shared L2)
    l2_weight: float = 0.5  # kvaware: a token in the shared L2 counts this much next to one in a worker
    backend_kind: BackendKind = BackendKind.AUTO  # kvaware: what the workers are (their KV events' source)
    # kvaware: a vLLM worker's KV events (its --kv-events-config endpoint, tcp://<worker host>:PORT): "PORT", or
    # "+N" for the worker's HTTP port plus N (several vLLM workers on one host); None: what the worker's
    # GET /kv_event_sources names, else 5557. The replay port likewise (its replay_endpoint; None: as the worker
    # names it, if it does: without one, missed events drop what the router knew of that worker).
    vllm_kv_events_port: str | None = None
    vllm_kv_replay_port: str | None = None
    # cache-aware: pick the lowest estimated TTFT (router/cost.py) instead of the thresholds below. Off by default:
    # on the long-history chat it kept fewer users on their cache than the thresholds do (docs/benchmarks.md)
    routing_cost_model: bool = False
    cache_threshold: float = 0.4  # cache-aware: a match under this share of the prompt goes to the least loaded
    balance_abs_threshold: int = 4  # load guard: in-flight gap to the least-loaded worker that counts as skew...
    balance_rel_threshold: float = 1.5  # ...when also this many times its load (+1)
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    health_failure_threshold: int = 2  # consecutive failed probes that mark a worker unhealthy
    health_success_threshold: int = 1  # consecutive good probes that mark it healthy again
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 600.0  # between bytes from a worker
    max_retries: int = 2  # extra attempts, each on a worker not yet tried
    retry_backoff_s: float = 0.05  # base of the jittered exponential back-off between attempts
    breaker_failure_threshold: int = 3  # consecutive request failures that open a worker's breaker
    breaker_cooldown_s: float = 5.0  # open -> half-open after this (doubles while trials fail, up to 60 s)
    stream_migration: bool = True  # resume a stream whose worker fails mid-answer on another worker
    max_concurrent_requests: int | None = None  # client requests at once; as many more wait; None: no bound
    queue_timeout_s: float = 10.0  # how long a request past max_concurrent_requests waits for a slot
    shutdown_timeout_s: int = 30  # SIGTERM: how long streams in flight may run on before they are cut
    max_request_body_bytes: int = 16 << 20
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # client keys for /v1/* (splitserve.auth); none: open
    salt_per_api_key: bool = False  # every client key a cache tenant (auth.tenant_salt)
    cluster_secret: str | None = field(default=None, repr=False)  # sent to workers instead of the client's key

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
        for flag, spec in (("--vllm-kv-events-port", self.vllm_kv_events_port),
                           ("--vllm-kv-replay-port", self.vllm_kv_replay_port)):  # fmt: skip
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

"""Per-request sampling parameters, validated once at the edge of the engine."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from enum import StrEnum

from splitserve.keys import MAX_CACHE_SALT_CHARS, is_valid_cache_salt
from splitserve.protocol.kv_transfer import KVTransferParams

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 512
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]


class StructuredKind(StrEnum):
    """What constrains a structured output (vLLM's ``structured_outputs`` keys)."""

    JSON = "json"  # a JSON schema
    JSON_OBJECT = "json_object"  # any JSON object
    REGEX = "regex"
    CHOICE = "choice"  # one of a list of strings
    GRAMMAR = "grammar"  # a Lark or GBNF grammar


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the output: ``kind`` and its text (a schema or a list of choices as canonical JSON, a regex,
    a grammar). Requests with the same one share its compiled grammar (``engine.structured``)."""

    kind: StructuredKind
    spec: str = ""

    @property
    def key(self) -> str:
        """A stable cache key (the same in every process)."""
        return hashlib.sha256(f"{self.kind}\0{self.spec}".encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature`` 0 means greedy. ``top_k`` <= 0 and ``top_p`` 1.0 disable those filters. ``seed`` makes a
    sampled request reproducible regardless of batch composition. ``stop`` strings end the output (the
    matched string is removed unless ``include_stop_str_in_output``); ``stop_token_ids`` end it too (the
    token is kept in ``output_token_ids`` but its text is not emitted). EOS ends it unless ``ignore_eos``;
    neither EOS nor stop token ids end it before ``min_tokens`` tokens.

    The logits are changed in vLLM's order before a token is picked (greedy included): ``min_tokens``,
    ``logit_bias`` (token id, value added), then the penalties: ``repetition_penalty`` over the prompt and the
    output (a positive logit divided by it, a negative one multiplied), ``frequency_penalty`` times each
    token's count in the output and ``presence_penalty`` once for each token in it, subtracted. Then
    temperature, ``min_p`` (tokens below ``min_p`` times the most likely's probability dropped), top-k, top-p.
    ``logprobs`` (k): each output token's log-probability, rank and the k most likely tokens', all from the
    model's logits before any of those changes (vLLM's ``raw_logprobs``). ``prompt_logprobs`` (k): the same
    for each prompt token after the first; such a request computes its whole prompt (no cached prefix).
    ``structured``: only tokens that keep the output within it can be drawn (a mask before everything else, as
    vLLM applies it, so the logprobs are of the allowed tokens); the output ends when it is complete.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    min_p: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None  # the output follows this schema, regex, choice or grammar
    kv_transfer: KVTransferParams | None = None  # disaggregated prefill/decode (see ``kv_transfer``)
    cache_salt: str | None = None  # isolates this request's cached prefixes from other salts' (``keys.salt_root``)
    # a stream resumed here after its worker failed (the router's migration): the length of the original
    # prompt, which the prompt continues with the tokens generated before; what --verify-sample-rate replays
    resumed_prompt_tokens: int | None = None
    # with it: the text goes on from the original stream's, its detokenizer having replayed the tokens generated
    # before (``IncrementalDetokenizer.replayed``); without it, the text of the new tokens alone
    replay_output: bool = False

    def __post_init__(self) -> None:
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def kv_transfer_expected(self) -> bool:
        """A decode worker's request: a prefill worker pushes its prompt's KV (nothing to compute if it comes)."""
        return self.kv_transfer is not None and not self.kv_transfer.is_sender

    @property
    def changes_logits(self) -> bool:
        """Whether a bias or a penalty changes the logits before a token is picked."""
        return bool(self.logit_bias) or self.has_penalties

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0

    def validate(self) -> None:
        """Raise ``ValueError`` naming the parameter and its value when something is out of range."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or positive, got {self.top_k}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop strings must have 1 to {MAX_STOP_STRING_CHARS} characters, got {s!r}")
        if self.cache_salt is not None and not is_valid_cache_salt(self.cache_salt):
            raise ValueError(f"cache_salt must have 1 to {MAX_CACHE_SALT_CHARS} characters, all encodable as UTF-8")
        if self.resumed_prompt_tokens is not None and self.resumed_prompt_tokens < 1:
            raise ValueError(f"the resumed prompt's length must be positive, got {self.resumed_prompt_tokens}")
        if self.replay_output and self.resumed_prompt_tokens is None:
            raise ValueError("replaying the output needs the resumed prompt's length")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative, got {list(self.stop_token_ids)}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for token_id, bias in self.logit_bias:
            if token_id < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias takes token ids (non-negative) to values in [-100, 100], got {token_id}: {bias}"
                )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be non-negative, got {value}")

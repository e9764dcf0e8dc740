"""What the engine hands back after each step, one object per request that made progress."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.metrics import RequestPhases
    from splitserve.protocol.kv_transfer import KVTransferResult


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A token's log-probability, its rank in the vocabulary (how many tokens are at least as likely, itself
    included, as vLLM counts: 1 is the most likely), and the ``k`` most likely tokens with theirs, most likely
    first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


class FinishReason(StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # the client went away or the request was cancelled


@dataclass(slots=True)
class RequestOutput:
    """The progress of one request in one engine step.

    ``new_token_ids`` are the tokens sampled this step (usually one); ``new_text`` is the text they add
    after incremental detokenization and stop-string handling (possibly empty while a multi-byte character
    or a possible stop string is held back). When ``finished`` is true this is the request's last output.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache (or a KV tier) instead of computed
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it, if any
    # num_cached_tokens by source, as Request.cached_tokens_by_source: (("engine", n), ("l1", n), ...)
    cached_tokens_by_source: tuple[tuple[str, int], ...] = ()
    timing: RequestPhases | None = None  # on the last output of a request the engine finished
    # on the last output of a prefill-role request: the push of its KV to the decode worker
    kv_transfer_result: Future[KVTransferResult] | None = None
    new_logprobs: list[TokenLogprobs] | None = None  # params.logprobs: one per token of new_token_ids
    # params.prompt_logprobs, on the request's first output: one per prompt token, None for the first
    prompt_logprobs: list[TokenLogprobs | None] | None = None

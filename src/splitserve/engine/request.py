"""A request is ``num_computed_tokens`` catching up with its tokens (prompt + output so far).

There is no separate prefill or decode state: a step schedules ``num_tokens - num_computed_tokens`` new
tokens (capped by the budget), and a token is sampled once the request has caught up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from splitserve.engine.outputs import FinishReason, TokenLogprobs
from splitserve.engine.sampling_params import SamplingParams
from splitserve.keys import hash_blocks, salt_root

if TYPE_CHECKING:
    from splitserve.engine.structured import Grammar


class RequestStatus(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    eos_token_ids: frozenset[int] = frozenset()  # end the output unless params.ignore_eos
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # tokens not computed at first admission (prefix cache + loaded); -1 until then
    # num_cached_tokens split by source, in order: ("engine", n) for the prefix cache, then the connector's
    # (e.g. ("l1", n), ("l2", n)); empty until first admission
    cached_tokens_by_source: tuple[tuple[str, int], ...] = ()
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the full blocks of all_token_ids
    # draft tokens to follow all_token_ids, verified by the next step (``engine.speculative``); [] when none
    spec_token_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # params.prompt_logprobs: entry p is prompt token p + 1's, from the logits at position p
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    grammar: Grammar | None = None  # params.structured: where the output is in its grammar (``engine.structured``)
    # a cold recompute of a finished request, checked against it (``engine.verifier``): no cached or loaded KV,
    # nothing published or saved, admitted only when no client request waits, its output sent to nobody
    is_shadow: bool = False
    # engine clock (time.monotonic), for the metrics: first scheduled (kept over preemptions), first and last token
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    waiting_since: float = 0.0  # engine clock: added, or last preempted (the queue's age, ``policy.admission``)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        if not self.waiting_since:
            self.waiting_since = self.arrival_time

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    @property
    def root_hash(self) -> int:
        """The parent hash of the first block (``keys.salt_root`` of the request's ``cache_salt``)."""
        return salt_root(self.params.cache_salt)

    def update_block_hashes(self, block_size: int) -> list[int]:
        """Extend ``block_hashes`` to every full block of ``all_token_ids``; returns the whole list."""
        parent = self.block_hashes[-1] if self.block_hashes else self.root_hash
        self.block_hashes.extend(
            hash_blocks(self.all_token_ids, block_size, parent, start_block=len(self.block_hashes))
        )
        return self.block_hashes

"""Turn logits into tokens: greedy, or temperature / top-k / top-p sampling with optional per-request seeds.

Greedy rows share one argmax. Sampled rows are drawn one by one. A request with a seed draws the token at
sequence position ``p`` from a generator seeded with ``mix(seed, p)``: its tokens depend on nothing but the
seed, the position and the logits, so they are the same whatever else is in the batch, and a request
resumed elsewhere with its tokens so far as the prompt (stream migration, a disaggregated decode) draws
the tokens the uninterrupted request would have. A disaggregated decode request's first token is the one
its prefill worker already sent (``kv_transfer.first_token_id``), whatever the logits say.
"""

from __future__ import annotations

import torch

from splitserve.engine.request import Request


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._generator = torch.Generator().manual_seed(seed)
        self._seeded = torch.Generator()  # re-seeded for each draw of a request with a seed

    def __call__(self, logits: torch.Tensor, requests: list[Request], ahead: list[int] | None = None) -> list[int]:
        """logits: [N, vocab] float32 on any device, row i for ``requests[i]``; returns N token ids.

        ``ahead[i]``: how many tokens past the request's next one row i draws (a verification step's rows after
        its drafts); None: 0 for every row.
        """
        ahead = ahead if ahead is not None else [0] * len(requests)
        logits = logits.float().cpu()
        _suppress_early_stops(logits, requests, ahead)
        tokens = logits.argmax(dim=-1).tolist()
        for i, request in enumerate(requests):
            forced = _forced_first_token(request) if ahead[i] == 0 else None
            if forced is not None:
                tokens[i] = forced
            elif not request.params.is_greedy:
                tokens[i] = self._sample_row(logits[i], request, ahead[i])
        return tokens

    def _sample_row(self, row: torch.Tensor, request: Request, ahead: int = 0) -> int:  # row: [vocab]
        params = request.params
        row = row / params.temperature
        if params.top_k > 0 and params.top_k < row.shape[0]:
            kth = torch.topk(row, params.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop = cumulative - sorted_logits.softmax(dim=-1) >= params.top_p  # keep the token crossing top_p
            row = row.scatter(0, order[drop], float("-inf"))
        probs = row.softmax(dim=-1)
        return int(torch.multinomial(probs, 1, generator=self._generator_for(request, ahead)).item())

    def _generator_for(self, request: Request, ahead: int = 0) -> torch.Generator:
        seed = request.params.seed
        if seed is None:
            return self._generator
        return self._seeded.manual_seed(position_seed(seed, request.num_tokens + ahead))


_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """A 63-bit seed for the draw at sequence ``position`` of a request seeded with ``seed`` (SplitMix64's
    finalizer over both; the same in every process, unlike ``hash()``)."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _forced_first_token(request: Request) -> int | None:
    """The first token of a request whose prefill ran on another worker: the one that worker sent."""
    transfer = request.params.kv_transfer
    if request.num_output_tokens or transfer is None:
        return None
    return transfer.first_token_id


def _suppress_early_stops(logits: torch.Tensor, requests: list[Request], ahead: list[int]) -> None:
    """Below ``min_tokens``, EOS and stop token ids cannot be sampled."""
    for i, request in enumerate(requests):
        params = request.params
        if request.num_output_tokens + ahead[i] >= params.min_tokens:
            continue
        stop_ids = [*params.stop_token_ids, *request.eos_token_ids]
        if stop_ids:
            logits[i, stop_ids] = float("-inf")

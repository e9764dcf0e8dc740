"""Draft tokens by prompt lookup (vLLM's ``ngram`` method, llama.cpp's lookup decoding).

A request's context often repeats itself: a summary quotes its document, an edit copies most of its input, code
repeats its names. The proposer looks for the context's last n tokens (``prompt_lookup_max`` down to
``prompt_lookup_min``) earlier in the context, and proposes the tokens that followed their latest earlier
occurrence. The scheduler then computes the request's last token and the drafts as one chunk, and the engine
keeps each draft while it equals the token sampled before it (``accept``): the output is exactly what decoding
one token at a time gives, since every row of a step is computed as it would be alone (``docs/exactness.md``).

Each request keeps an index from each n-gram to the position after its latest occurrence, extended by the
tokens appended since the last proposal, so a proposal costs a few dictionary lookups, not a scan.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from splitserve.config import SpeculativeConfig


@dataclass(slots=True)
class _Index:
    """n -> {n-gram: the position right after its latest occurrence that has a token after it}."""

    grams: dict[int, dict[tuple[int, ...], int]]
    indexed: int = 0  # n-grams ending before this position are in ``grams``


@dataclass(slots=True)
class SpecStats:
    """Counters in vLLM's ``vllm:spec_decode_*`` shape."""

    num_drafts: int = 0  # verification steps that carried drafts
    num_draft_tokens: int = 0  # drafts computed
    num_accepted_tokens: int = 0  # drafts kept
    accepted_per_position: list[int] = field(default_factory=list)  # kept drafts by position in their run

    def snapshot(self) -> SpecStats:
        """A copy for the metrics thread (the engine goes on counting in this one)."""
        return replace(self, accepted_per_position=list(self.accepted_per_position))


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._indexes: dict[str, _Index] = {}
        self.stats = SpecStats(accepted_per_position=[0] * config.num_speculative_tokens)

    def propose(self, request_id: str, tokens: list[int], max_drafts: int) -> list[int]:
        """Up to ``min(max_drafts, num_speculative_tokens)`` drafts to follow ``tokens``; [] when none match."""
        k = min(max_drafts, self.config.num_speculative_tokens)
        if k < 1:
            return []
        index = self._indexes.get(request_id)
        if index is None:
            lengths = range(self.config.prompt_lookup_min, self.config.prompt_lookup_max + 1)
            index = self._indexes[request_id] = _Index({n: {} for n in lengths})
        self._extend(index, tokens)
        for n in range(self.config.prompt_lookup_max, self.config.prompt_lookup_min - 1, -1):
            if n >= len(tokens):
                continue
            after = index.grams[n].get(tuple(tokens[-n:]))
            if after is not None:
                return tokens[after : after + k]
        return []

    @staticmethod
    def _extend(index: _Index, tokens: list[int]) -> None:
        """Index every n-gram that ends before the last token (so a token follows it), the latest winning."""
        end = len(tokens) - 1
        for n, grams in index.grams.items():
            for stop in range(max(index.indexed, n), end + 1):
                grams[tuple(tokens[stop - n : stop])] = stop
        index.indexed = max(index.indexed, end + 1)

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One verification step's result, for the metrics."""
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += num_drafts
        self.stats.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.stats.accepted_per_position[position] += 1


def accept(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a verification step yields: ``sampled[j]`` is the token drawn after the last token and drafts
    ``[:j]``; each draft is kept while it equals the sample before it, then one more sample follows."""
    kept = [sampled[0]]
    for j, draft in enumerate(drafts):
        if sampled[j] != draft:
            break
        kept.append(sampled[j + 1])
    return kept

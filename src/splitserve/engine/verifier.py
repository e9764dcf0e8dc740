"""The exactness check that runs in production (``--verify-sample-rate``).

Every path that reuses KV (the engine's prefix cache, the L1 and L2 tiers, a prefill worker's push, a stream
resumed on another worker) promises the tokens a cold run gives. A sample of the requests that took such a
path is recomputed here as a *shadow*: the same prompt and sampling, no cached or loaded KV, admitted only
when no client request waits (``Scheduler.add_shadow``), its output sent to nobody. When it finishes, its
tokens are compared with what the client got. A mismatch counts in
``splitserve:exactness_mismatches_total{path}`` and is logged once, with the path, the request id and the
first position that differs. The client's answer never waits for any of it.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections import Counter
from dataclasses import dataclass

from splitserve.engine.request import Request
from splitserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

SHADOW_PREFIX = "verify-"
# the path a request's reused KV took: its deepest source (request.cached_tokens_by_source's names), in this
# order; with "migration", the paths metrics.names.EXACTNESS_PATHS lists
PATH_OF_SOURCE = {"pd": "pd", "l2": "l2", "l1": "l1", "engine": "prefix_cache"}


@dataclass(slots=True)
class _Expected:
    request_id: str
    path: str
    tokens: list[int]  # what the client got, from the shadow's prompt on


class ExactnessVerifier:
    """Picks a sample of finished requests that reused KV, builds their shadows, and compares the shadows'
    tokens with the originals' (``checks`` and ``mismatches`` count by path)."""

    def __init__(self, sample_rate: float, rng: random.Random | None = None) -> None:
        self.sample_rate = sample_rate
        self._rng = rng or random.Random()
        self._expected: dict[str, _Expected] = {}  # shadow id -> what it must reproduce
        self.checks: Counter[str] = Counter()
        self.mismatches: Counter[str] = Counter()

    def shadow_for(self, request: Request) -> Request | None:
        """The shadow of a request that just finished, if it reused KV and the sample picks it; else None."""
        path = path_of(request)
        if path is None or not request.output_token_ids or self._rng.random() >= self.sample_rate:
            return None
        start = request.params.resumed_prompt_tokens or request.num_prompt_tokens
        prompt = request.all_token_ids[:start]
        expected = request.all_token_ids[start:]
        params = shadow_params(request.params, len(expected))
        shadow = Request(
            SHADOW_PREFIX + request.request_id, prompt, params, request.arrival_time, request.eos_token_ids,
            is_shadow=True,
        )  # fmt: skip
        self._expected[shadow.request_id] = _Expected(request.request_id, path, expected)
        return shadow

    def finished(self, shadow: Request) -> bool:
        """Compare a finished (or aborted) shadow with its original; returns whether they agree."""
        expected = self._expected.pop(shadow.request_id, None)
        if expected is None:
            return True
        got = shadow.output_token_ids
        first = next((i for i, (a, b) in enumerate(zip(got, expected.tokens, strict=False)) if a != b), None)
        if first is None and len(got) < len(expected.tokens):
            return True  # aborted before it finished, the same so far: nothing to compare
        self.checks[expected.path] += 1
        if first is None:
            return True
        self.mismatches[expected.path] += 1
        logger.error(
            "exactness check failed: request %s (path %s) differs from its cold recompute at output position %d "
            "(token %d served, %d recomputed)",
            expected.request_id, expected.path, first, expected.tokens[first], got[first],
        )  # fmt: skip
        return False


def path_of(request: Request) -> str | None:
    """The path a request's reused KV took (one of ``metrics.names.EXACTNESS_PATHS``), or None when it computed
    everything itself."""
    if request.params.resumed_prompt_tokens:
        return "migration"
    used = {name for name, num_tokens in request.cached_tokens_by_source if num_tokens > 0}
    return next((path for source, path in PATH_OF_SOURCE.items() if source in used), None)


def shadow_params(params: SamplingParams, num_tokens: int) -> SamplingParams:
    """The original's sampling for ``num_tokens`` tokens: its seed (so a seeded draw is the same draw), its
    ``min_tokens`` and stop token ids (which of them can be drawn changes the distribution every draw samples
    from), no stop string or EOS that could end it early, no prefill worker's first token, nothing a client would
    read. A stop token id ends it where it ended the original."""
    return dataclasses.replace(
        params,
        max_tokens=num_tokens,
        min_tokens=min(params.min_tokens, num_tokens),  # the same draws: none past num_tokens is made
        ignore_eos=True,
        stop=(),
        kv_transfer=None,
        resumed_prompt_tokens=None,
        replay_output=False,
    )

"""The cache-aware policies' cost model (issue 17, item 2): estimated TTFT = (prefill queued on the worker + the
request's uncached tokens) x the worker's measured seconds per token. No network: plain ``Worker`` objects."""

from __future__ import annotations

import pytest

from splitserve.keys import hash_blocks
from splitserve.kv_events import Tier
from splitserve.router.cost import MIN_SAMPLE_TOKENS, PRIOR_S_PER_TOKEN, PrefillCostModel, cheapest
from splitserve.router.discovery import Worker
from splitserve.router.kv_index import PrefixIndex
from splitserve.router.policies import KVAwarePolicy, PrefixAwarePolicy
from tests.unit.test_router_policies import BLOCK_SIZE, W0, W1, guard, kv_index, prompt, routing, stored


class TestPrefillCostModel:
    def test_a_rate_is_learned_from_streams_that_computed_enough(self) -> None:
        model = PrefillCostModel()
        assert model.rate(W0) == PRIOR_S_PER_TOKEN
        model.observe(W0, 5.0, MIN_SAMPLE_TOKENS - 1)  # mostly fixed costs: ignored
        assert model.rate(W0) == PRIOR_S_PER_TOKEN
        model.observe(W0, 1.0, 1000)
        assert model.rate(W0) == pytest.approx(1e-3)
        model.observe(W0, 3.0, 1000)  # a slower sample moves the mean a fifth of the way
        assert model.rate(W0) == pytest.approx(0.8e-3 + 0.2 * 3e-3)
        assert model.rate(W1) == model.rate(W0)  # a worker without samples takes the others' median

    def test_the_estimate_counts_the_queue_and_the_uncached_tokens(self) -> None:
        model = PrefillCostModel({W0: 2e-3})
        worker = Worker(W0, pending_prefill_tokens=500)
        assert model.estimate_s(worker, 250) == pytest.approx(1.5)


class TestCheapest:
    def test_a_cache_hit_wins_until_the_queue_there_costs_more_than_it_saves(self) -> None:
        model = PrefillCostModel({W0: 1e-3, W1: 1e-3})
        holder, idle = Worker(W0), Worker(W1)
        assert cheapest(model, [(holder, 100), (idle, 1000)])[0] is holder
        holder.pending_prefill_tokens = 899
        assert cheapest(model, [(holder, 100), (idle, 1000)])[0] is holder
        holder.pending_prefill_tokens = 901  # now waiting there costs more than computing 900 tokens elsewhere
        assert cheapest(model, [(holder, 100), (idle, 1000)])[0] is idle

    def test_a_slower_worker_is_worth_less(self) -> None:
        model = PrefillCostModel({W0: 4e-3, W1: 1e-3})
        assert cheapest(model, [(Worker(W0), 400), (Worker(W1), 1000)])[0].url == W1

    def test_ties_go_to_fewer_in_flight_then_alternate(self) -> None:
        model = PrefillCostModel()
        a, b = Worker(W0, in_flight=1), Worker(W1)
        assert cheapest(model, [(a, 50), (b, 50)], turn=0)[0] is b
        b.in_flight = 1
        assert {cheapest(model, [(a, 50), (b, 50)], turn=t)[0].url for t in range(2)} == {W0, W1}


class TestPoliciesWithTheCostModel:
    def test_kvaware_follows_the_cache_and_leaves_it_for_a_long_queue(self) -> None:
        index, ids = kv_index(), prompt(64)  # 256 tokens
        stored(index, W0, Tier.ENGINE, hash_blocks(ids, BLOCK_SIZE)[:60])  # 240 of them on w0
        model = PrefillCostModel({W0: 1e-3, W1: 1e-3})
        policy = KVAwarePolicy(index, guard(), 0.5, PrefixIndex(1000), model)
        holder, other = Worker(W0), Worker(W1)
        decision = policy.select(routing(ids), [holder, other])
        assert (decision.worker, decision.outcome, decision.matched_tokens, decision.uncached_tokens) == (
            holder, "matched", 240, 16,
        )  # fmt: skip
        holder.pending_prefill_tokens = 2000  # a cold prompt is being prefilled there
        decision = policy.select(routing(ids), [holder, other])
        assert (decision.worker, decision.outcome, decision.uncached_tokens) == (other, "least_cost", 256)

    def test_prefixaware_counts_its_own_index_as_cached(self) -> None:
        model = PrefillCostModel()
        policy = PrefixAwarePolicy(PrefixIndex(1000), guard(), model)
        owner, other = Worker(W0), Worker(W1)
        ids = prompt(32)
        policy.on_routed(routing(ids), owner)
        decision = policy.select(routing(ids + prompt(2, start=999)), [other, owner])
        assert (decision.worker, decision.matched_tokens, decision.uncached_tokens) == (owner, 128, 8)

"""The cache-aware policies' cost model: estimated TTFT = (the prefill queued on the worker that goes before the
request + its uncached tokens) x the worker's measured seconds per token. No network: plain ``Worker`` objects."""

from __future__ import annotations

import pytest

from splitserve.keys import hash_blocks
from splitserve.policy import balance
from splitserve.protocol.kv_events import Tier, WorkerLoad
from splitserve.router.cost import (
    MIN_SAMPLE_TOKENS,
    PRIOR_S_PER_TOKEN,
    PRIOR_TRANSFER_S_PER_TOKEN,
    PrefillCostModel,
    cheapest,
    pd_costs,
)
from splitserve.router.discovery import Worker
from splitserve.router.kv_index import PrefixIndex
from splitserve.router.policies import KVAwarePolicy, PrefixAwarePolicy
from tests.support.policies import BLOCK_SIZE, W0, W1, guard, kv_index, prompt, routing, stored


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

    def test_the_estimate_counts_the_queue_ahead_and_the_uncached_tokens(self) -> None:
        model = PrefillCostModel({W0: 2e-3})
        # the engine runs the 200 and the other 250 first; the 500 shares its steps, as much as 250 of it ahead
        worker = queued(Worker(W0), 200, 250, 500)
        assert model.estimate_s(worker, 250) == pytest.approx((200 + 250 + 250 + 250) * 2e-3)
        assert model.estimate_s(worker, 600) == pytest.approx((950 + 600) * 2e-3)


def queued(worker: Worker, *tokens: int) -> Worker:
    """``worker`` with requests of these uncached tokens sent there and not answered yet."""
    for n in tokens:
        worker.pending_prefill.add(n)
    return worker


class TestTransferCost:
    def test_the_push_rate_is_learned_from_pushes_that_moved_enough(self) -> None:
        model = PrefillCostModel()
        assert model.transfer_s(1000) == pytest.approx(1000 * PRIOR_TRANSFER_S_PER_TOKEN)
        model.observe_transfer(1.0, MIN_SAMPLE_TOKENS - 1)  # mostly the connection and the reservation: ignored
        assert model.transfer_s_per_token is None
        model.observe_transfer(0.05, 1000)
        assert model.transfer_s(1000) == pytest.approx(0.05)
        model.observe_transfer(0.15, 1000)  # a slower push moves the mean a fifth of the way
        assert model.transfer_s_per_token == pytest.approx(0.8 * 5e-5 + 0.2 * 15e-5)


class TestPDCosts:
    def test_remote_is_prefill_there_plus_the_push_local_is_prefill_here_harm_stalls_each_running_request(
        self,
    ) -> None:
        model = PrefillCostModel({W0: 1e-3, W1: 2e-3}, transfer_s_per_token=1e-4)
        decoder = queued(Worker(W0, in_flight=3), 200)
        prefiller = queued(Worker(W1), 500)
        costs = pd_costs(model, (decoder, 1000), (prefiller, 800), 1000)
        assert costs.remote_s == pytest.approx((500 + 800) * 2e-3 + 1000 * 1e-4)  # 2.7 s
        # its queue and the prompt (2 steps of 1,024), each step with a row of the 2 streams that answered
        assert costs.local_s == pytest.approx((200 + 1000 + 2 * 2) * 1e-3)  # 1.204 s
        assert costs.harm_s == pytest.approx(3 * 1000 * 1e-3)  # its own queue stalls them either way
        assert costs.is_remote_cheaper  # 2.7 < 4.204
        decoder.in_flight = 1
        assert not pd_costs(model, (decoder, 1000), (prefiller, 800), 1000).is_remote_cheaper  # 2.7 > 2.2

    def test_an_idle_decoder_keeps_a_prompt_that_equal_workers_would_compute_alike(self) -> None:
        model = PrefillCostModel()
        costs = pd_costs(model, (Worker(W0), 4096), (Worker(W1), 4096), 4096)
        assert costs.harm_s == 0 and costs.remote_s - costs.local_s == pytest.approx(model.transfer_s(4096))
        assert not costs.is_remote_cheaper


class TestCheapest:
    def test_a_cache_hit_stays_until_the_shorter_queue_there_costs_more_than_it_saves(self) -> None:
        model = PrefillCostModel({W0: 1e-3, W1: 1e-3})
        holder, idle = Worker(W0), Worker(W1)
        assert cheapest(model, [(holder, 100), (idle, 1000)])[0] is holder
        queued(holder, 4000)  # a cold prompt there: the hit passes it within a short step (100 tokens ahead)
        assert cheapest(model, [(holder, 100), (idle, 1000)])[0] is holder
        queued(holder, *[100] * 7)  # seven other hits go first: 800 tokens ahead in all
        assert cheapest(model, [(holder, 100), (idle, 1000)])[0] is holder
        queued(holder, 100, 100, 100)  # saturated: waiting there costs more than computing 900 tokens elsewhere
        assert cheapest(model, [(holder, 100), (idle, 1000)])[0] is idle

    def test_scores_within_a_tenth_are_ties_that_go_to_fewer_in_flight(self) -> None:
        # alike workers whose measured rates differ by noise: the one decoding a stream loses the new prompt
        model = PrefillCostModel({W0: 1.0e-3, W1: 1.05e-3})
        decoding, idle = Worker(W0, in_flight=1), Worker(W1)
        assert cheapest(model, [(decoding, 1000), (idle, 1000)])[0] is idle
        model.s_per_token[W1] = 1.2e-3  # truly slower: the score decides
        assert cheapest(model, [(decoding, 1000), (idle, 1000)])[0] is decoding

    def test_streams_decoding_on_the_holder_of_a_short_prefix_send_a_new_conversation_elsewhere(self) -> None:
        # a new user's 525 tokens, of which the holder has the 48 of a system prompt: alone there it wins (477
        # tokens against 525: just past the tie band); with 16 streams answering there, a row of each in the
        # step of its prefill, it ties, and the tie goes to the worker with fewer in flight
        model = PrefillCostModel({W0: 1e-3, W1: 1e-3})
        holder, other = Worker(W0), Worker(W1)
        assert cheapest(model, [(holder, 477), (other, 525)])[0] is holder
        holder.in_flight = 16
        assert balance.work_tokens(holder, 477) == 477 + 16
        assert cheapest(model, [(holder, 477), (other, 525)])[0] is other
        queued(holder, 600)  # one of them not answered yet: 15 decoding, and its 600 tokens ahead up to 477
        assert balance.decoding(holder) == 15 and balance.work_tokens(holder, 477) == 477 + 477 + 15
        # a long history it holds stays there: 40 uncached tokens against 2,000
        assert cheapest(model, [(holder, 40), (other, 2000)])[0] is holder

    def test_load_another_router_put_on_a_worker_counts_as_this_routers_own(self) -> None:
        model = PrefillCostModel({W0: 1e-3, W1: 1e-3})
        holder, other = Worker(W0), Worker(W1)
        holder.report(WorkerLoad(running=16))  # 16 streams another replica sent there
        assert cheapest(model, [(holder, 477), (other, 525)])[0] is other
        holder.report(WorkerLoad(waiting=3, prefill_tokens=3000))  # 3 cold prompts it sent, 1,000 tokens each
        assert balance.work_tokens(holder, 40) == 3 * 40 + 40  # each goes before a short one up to its own
        assert cheapest(model, [(holder, 40), (other, 525)])[0] is holder
        assert cheapest(model, [(holder, 400), (other, 525)])[0] is other  # 3 x 400 ahead of it there

    def test_a_cold_prompt_goes_where_no_other_cold_prompt_is_queued(self) -> None:
        model = PrefillCostModel({W0: 1e-3, W1: 1e-3})
        busy, idle = queued(Worker(W0), 1050), Worker(W1)
        assert cheapest(model, [(busy, 1040), (idle, 1040)])[0] is idle

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
        queued(holder, 2000)  # a cold prompt is being prefilled there: the hit passes it (16 tokens ahead)
        assert policy.select(routing(ids), [holder, other]).worker is holder
        queued(holder, *[16] * 20)  # twenty other hits wait there: 336 tokens ahead in all
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

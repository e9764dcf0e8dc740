"""The router's pure parts: routing policies, the KV indexes, worker health and the worker list, prompt tokens.

No model, no network: workers are plain ``Worker`` objects whose ``in_flight`` the tests set, time is a fake
clock, and the tokenizer is a fake.
"""

from __future__ import annotations

import random
import struct
import tracemalloc
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest

from splitserve.breaker import BreakerState, CircuitBreaker
from splitserve.config import RouterConfig, RoutingStrategy
from splitserve.keys import hash_blocks
from splitserve.protocol.kv_events import EventKind, Tier
from splitserve.router.discovery import Worker, WorkerPool
from splitserve.router.health import MAX_COOLDOWN_S, HealthChecker, worker_breaker
from splitserve.router.kv_index import KVIndex, PrefixIndex, TierMatch
from splitserve.router.policies import (
    POLICIES,
    Decision,
    KVAwarePolicy,
    PrefixAwarePolicy,
    RoundRobinPolicy,
    RoutingPolicy,
    RoutingRequest,
    SessionPolicy,
    build_policy,
)
from splitserve.router.tokens import prompt_token_ids
from tests.support.policies import BLOCK_SIZE, CHUNK_SIZE, W0, W1, guard, kv_index, prompt, routing, stored
from tests.support.transport import InMemoryTransport


def make_workers(num: int) -> list[Worker]:
    return [Worker(f"http://w{i}:8000") for i in range(num)]


def route(policy: RoutingPolicy, request: RoutingRequest, candidates: Sequence[Worker]) -> Decision:
    """Select, then report the request accepted, as the router does once the worker answers."""
    decision = policy.select(request, candidates)
    policy.on_routed(request, decision.worker)
    return decision


def picked(decision: Decision) -> tuple[Worker, str, int]:
    """The worker, outcome and matched tokens of a decision (its uncached tokens are tested apart)."""
    return decision.worker, decision.outcome, decision.matched_tokens


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


# -- the registry ------------------------------------------------------------------------------------------


class TestBuildPolicy:
    def test_every_strategy_has_a_policy_named_after_it(self) -> None:
        assert set(POLICIES) == set(RoutingStrategy)
        kv_index = KVIndex(BLOCK_SIZE, CHUNK_SIZE, 1000)
        for strategy in RoutingStrategy:
            policy = build_policy(RouterConfig(routing_strategy=strategy), list, kv_index)
            assert policy.name == strategy.value
            assert policy.needs_tokens == (strategy in (RoutingStrategy.PREFIXAWARE, RoutingStrategy.KVAWARE))

    def test_config_reaches_the_policy(self) -> None:
        kv_index = KVIndex(BLOCK_SIZE, CHUNK_SIZE, 1000)
        prefix = build_policy(
            RouterConfig(routing_strategy=RoutingStrategy.PREFIXAWARE, prefix_index_max_blocks=123), list, kv_index
        )
        assert isinstance(prefix, PrefixAwarePolicy) and prefix.index.max_blocks == 123
        kvaware = build_policy(RouterConfig(routing_strategy=RoutingStrategy.KVAWARE, l2_weight=0.25), list, kv_index)
        assert isinstance(kvaware, KVAwarePolicy) and kvaware.index is kv_index and kvaware.l2_weight == 0.25

    def test_load_guard_thresholds_come_from_the_config(self) -> None:
        config = RouterConfig(
            routing_strategy=RoutingStrategy.PREFIXAWARE,
            block_size=BLOCK_SIZE,
            balance_abs_threshold=0,
            balance_rel_threshold=0.0,
        )
        policy = build_policy(config, list, KVIndex(BLOCK_SIZE, CHUNK_SIZE, 1000))
        owner, other = make_workers(2)
        route(policy, routing(prompt(2)), [owner])
        owner.in_flight = 1
        assert picked(policy.select(routing(prompt(2)), [owner, other])) == (other, "load_guard", 0)


# -- roundrobin and session --------------------------------------------------------------------------------


class TestRoundRobin:
    def test_spreads_evenly_over_the_candidates(self) -> None:
        policy, workers = RoundRobinPolicy(), make_workers(3)
        picks = [policy.select(routing(), workers) for _ in range(300)]
        assert Counter(d.worker.url for d in picks) == {w.url: 100 for w in workers}
        assert [d.worker for d in picks[:6]] == workers + workers
        assert {d.outcome for d in picks} == {"roundrobin"}


class TestSession:
    def test_the_same_session_always_gets_the_same_worker(self) -> None:
        workers = make_workers(3)
        policy = SessionPolicy(lambda: workers, guard())
        decisions = [policy.select(routing(session_id="alice"), workers) for _ in range(20)]
        assert len({d.worker.url for d in decisions}) == 1
        assert {d.outcome for d in decisions} == {"session"}

    def test_different_sessions_spread_over_the_workers(self) -> None:
        workers = make_workers(3)
        policy = SessionPolicy(lambda: workers, guard())
        owners = Counter(policy.select(routing(session_id=f"user-{i}"), workers).worker.url for i in range(200))
        assert set(owners) == {w.url for w in workers}
        assert min(owners.values()) >= 40  # a fair share is 67

    def test_an_unroutable_owner_hands_over_and_gets_its_session_back(self) -> None:
        workers = make_workers(3)
        policy = SessionPolicy(lambda: workers, guard())
        owner = policy.select(routing(session_id="alice"), workers).worker
        others = [w for w in workers if w is not owner]
        handover = policy.select(routing(session_id="alice"), others)
        assert handover.outcome == "handover" and handover.worker is not owner
        assert policy.select(routing(session_id="alice"), others).worker is handover.worker  # stable meanwhile
        assert picked(policy.select(routing(session_id="alice"), workers)) == (owner, "session", 0)

    def test_removing_a_worker_moves_only_the_sessions_it_owned(self) -> None:
        workers = make_workers(4)
        policy = SessionPolicy(lambda: workers, guard())
        sessions = [f"user-{i}" for i in range(1000)]
        before = {s: policy.select(routing(session_id=s), workers).worker.url for s in sessions}
        removed = workers.pop(2)
        after = {s: policy.select(routing(session_id=s), workers).worker.url for s in sessions}
        moved = {s for s in sessions if before[s] != after[s]}
        assert moved == {s for s in sessions if before[s] == removed.url}
        assert removed.url not in after.values()

    def test_adding_a_worker_moves_sessions_only_onto_it(self) -> None:
        workers = make_workers(4)
        policy = SessionPolicy(lambda: workers, guard())
        sessions = [f"user-{i}" for i in range(1000)]
        before = {s: policy.select(routing(session_id=s), workers).worker.url for s in sessions}
        workers.append(Worker("http://w4:8000"))
        after = {s: policy.select(routing(session_id=s), workers).worker.url for s in sessions}
        moved = [s for s in sessions if before[s] != after[s]]
        assert {after[s] for s in moved} == {"http://w4:8000"}
        assert 50 <= len(moved) <= 400  # about a fifth

    def test_no_session_goes_to_the_least_loaded_worker(self) -> None:
        workers = make_workers(3)
        workers[0].in_flight, workers[1].in_flight, workers[2].in_flight = 3, 1, 2
        policy = SessionPolicy(lambda: workers, guard())
        assert picked(policy.select(routing(), workers)) == (workers[1], "least_loaded", 0)


# -- prefixaware -------------------------------------------------------------------------------------------


class TestPrefixAware:
    @staticmethod
    def policy() -> PrefixAwarePolicy:
        return PrefixAwarePolicy(PrefixIndex(10_000), guard())

    def test_a_prompt_extending_a_routed_one_goes_to_the_same_worker(self) -> None:
        policy, workers = self.policy(), make_workers(3)
        first = route(policy, routing(prompt(3)), workers)
        assert first.outcome == "fallback"
        assert picked(route(policy, routing(prompt(5)), workers)) == (first.worker, "matched", 3 * BLOCK_SIZE)
        for num_blocks in range(6, 10):  # ties among idle workers rotate; the index must hold it in place
            assert route(policy, routing(prompt(num_blocks)), workers).worker is first.worker

    def test_the_deepest_matching_owner_wins(self) -> None:
        policy = self.policy()
        deep, shallow = make_workers(2)
        route(policy, routing(prompt(4)), [deep])  # deep holds blocks 0-3
        route(policy, routing(prompt(2)), [shallow])  # deep was unroutable: shallow now holds blocks 0-1
        assert picked(policy.select(routing(prompt(6)), [deep, shallow])) == (deep, "matched", 4 * BLOCK_SIZE)
        branch = prompt(2) + prompt(2, start=9000)  # shares only blocks 0-1
        assert picked(policy.select(routing(branch), [deep, shallow])) == (shallow, "matched", 2 * BLOCK_SIZE)

    def test_no_match_goes_to_the_least_loaded_worker(self) -> None:
        policy, workers = self.policy(), make_workers(3)
        route(policy, routing(prompt(3)), [workers[0]])
        workers[0].in_flight, workers[1].in_flight, workers[2].in_flight = 0, 2, 1
        assert picked(policy.select(routing(prompt(3, start=5000)), workers)) == (workers[0], "fallback", 0)
        workers[0].in_flight = 5
        assert picked(policy.select(routing(prompt(3, start=5000)), workers)) == (workers[2], "fallback", 0)

    def test_an_owner_that_is_not_a_candidate_falls_back(self) -> None:
        policy, (owner, other) = self.policy(), make_workers(2)
        route(policy, routing(prompt(3)), [owner])
        assert picked(policy.select(routing(prompt(3)), [other])) == (other, "fallback", 0)

    @pytest.mark.parametrize(
        ("owner_load", "other_load", "outcome"),
        [
            (10, 0, "load_guard"),  # gap 10 > 4 and 10 > 1.5 * 1
            (20, 10, "load_guard"),  # gap 10 > 4 and 20 > 1.5 * 11
            (4, 0, "matched"),  # gap 4 is not over the absolute threshold
            (15, 10, "matched"),  # gap 5 > 4 but 15 is not over 1.5 * 11
        ],
    )
    def test_the_load_guard_moves_a_hot_owners_request_only_past_both_thresholds(
        self, owner_load: int, other_load: int, outcome: str
    ) -> None:
        policy, (owner, other) = self.policy(), make_workers(2)
        route(policy, routing(prompt(3)), [owner])
        owner.in_flight, other.in_flight = owner_load, other_load
        decision = policy.select(routing(prompt(3)), [owner, other])
        assert decision.outcome == outcome
        assert decision.worker is (other if outcome == "load_guard" else owner)


class TestPrefixIndex:
    def test_the_newest_holder_of_a_block_wins(self) -> None:
        index = PrefixIndex(100)
        hashes = hash_blocks(prompt(3), BLOCK_SIZE)
        index.insert(hashes, "http://a")
        index.insert(hashes, "http://b")
        assert index.match(hashes) == ("http://b", 3)
        assert index.match(hashes_of_unrelated_prompt()) == (None, 0)

    def test_forget_worker_drops_its_blocks(self) -> None:
        index = PrefixIndex(100)
        index.insert(hash_blocks(prompt(3), BLOCK_SIZE), "http://a")
        index.insert(hashes_of_unrelated_prompt(), "http://b")
        index.forget_worker("http://a")
        assert len(index) == 3 and index.match(hash_blocks(prompt(3), BLOCK_SIZE)) == (None, 0)
        assert index.match(hashes_of_unrelated_prompt()) == ("http://b", 3)

    def test_a_cap_below_one_is_refused(self) -> None:
        with pytest.raises(ValueError, match="max_blocks"):
            PrefixIndex(0)

    def test_memory_stays_bounded_over_100k_distinct_prompts(self) -> None:
        max_blocks, rng, unpack = 50_000, random.Random(0), struct.Struct("<4Q").unpack
        tracemalloc.start()
        try:
            index = PrefixIndex(max_blocks)
            max_len = 0
            for _ in range(100_000):
                index.insert(unpack(rng.randbytes(32)), "http://w0:8000")  # 4 random 64-bit block hashes
                max_len = max(max_len, len(index))
            current_bytes, peak_bytes = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert max_len == len(index) == max_blocks
        assert current_bytes < 30 << 20 and peak_bytes < 30 << 20, (current_bytes, peak_bytes)  # about 11 and 16 MB

    def test_eviction_drops_deepest_blocks_first_so_a_recent_prompt_still_matches(self) -> None:
        index = PrefixIndex(8)
        hashes = hash_blocks(prompt(8), BLOCK_SIZE)
        index.insert(hashes, "http://a")
        index.insert(hashes_of_unrelated_prompt()[:1], "http://b")  # one block over the cap
        assert index.match(hashes) == ("http://a", 7)


def hashes_of_unrelated_prompt() -> list[int]:
    return hash_blocks(prompt(3, start=7000), BLOCK_SIZE)


# -- kvaware -----------------------------------------------------------------------------------------------


class TestKVIndex:
    def test_a_reset_registers_a_worker_and_replaces_what_was_known(self) -> None:
        index = KVIndex(BLOCK_SIZE, CHUNK_SIZE, 1000)
        hashes = hash_blocks(prompt(4), BLOCK_SIZE)
        assert index.apply(W0, "w-0", True, [(Tier.ENGINE, EventKind.STORED, hashes)], {"role": "backend"})
        assert index.is_registered(W0) and index.worker_id(W0) == "w-0"
        assert index.match(hashes, W0) == TierMatch(engine=16)
        assert index.apply(W0, "w-0b", True, [])  # a new snapshot: it holds nothing now
        assert index.match(hashes, W0) == TierMatch() and index.worker_id(W0) == "w-0b"

    def test_a_plain_batch_from_an_unknown_worker_is_refused_and_not_applied(self) -> None:
        index = KVIndex(BLOCK_SIZE, CHUNK_SIZE, 1000)
        hashes = hash_blocks(prompt(4), BLOCK_SIZE)
        events = [(Tier.ENGINE, EventKind.STORED, hashes), (Tier.L2, EventKind.STORED, hashes[3:])]
        assert index.apply(W0, "w-0", False, events) is False
        assert not index.is_registered(W0) and index.worker_id(W0) is None and len(index) == 0

    def test_removed_events_remove(self) -> None:
        index, hashes = kv_index(), hash_blocks(prompt(8), BLOCK_SIZE)
        stored(index, W0, Tier.ENGINE, hashes[:4])
        stored(index, W0, Tier.L1, [hashes[7]])
        stored(index, W0, Tier.L2, [hashes[7]])
        assert index.match(hashes, W0) == TierMatch(engine=16, l1=16)
        removals = [(tier, EventKind.REMOVED, [hashes[h]]) for tier, h in ((Tier.ENGINE, 2), (Tier.L1, 7))]
        assert index.apply(W0, "w-0", False, removals)
        assert index.match(hashes, W0) == TierMatch(engine=8)  # blocks 2+ need chunk 0's record: none
        assert index.apply(W1, "w-1", False, [(Tier.L2, EventKind.REMOVED, [hashes[7]])])  # L2 is shared
        assert len(index) == 3

    def test_engine_prefix_then_l1_chunks_then_l2(self) -> None:
        index, hashes = kv_index(), hash_blocks(prompt(14), BLOCK_SIZE)  # chunks 0-2 and 2 blocks of chunk 3
        stored(index, W0, Tier.ENGINE, hashes[:2])
        assert index.match(hashes, W0) == TierMatch(engine=8)
        stored(index, W0, Tier.L1, [hashes[3], hashes[7]])  # chunks 0 and 1, named by their last blocks
        assert index.match(hashes, W0) == TierMatch(engine=8, l1=24)  # chunk 0 counts only past the engine
        stored(index, W1, Tier.L2, [hashes[11], hashes[13]])  # chunk 2 and the prompt's tail, by another worker
        assert index.match(hashes, W0) == TierMatch(engine=8, l1=24, l2=24)
        assert index.match(hashes, W0).total == 14 * BLOCK_SIZE

    def test_l2_is_shared_by_every_worker_even_an_unregistered_one(self) -> None:
        index, hashes = kv_index(), hash_blocks(prompt(8), BLOCK_SIZE)
        stored(index, W0, Tier.L2, [hashes[3], hashes[7]])
        for url in (W0, W1, "http://never-registered:8000"):
            assert index.match(hashes, url) == TierMatch(l2=32)

    def test_a_longer_record_in_l2_beats_a_shorter_one_in_l1(self) -> None:
        index, hashes = kv_index(), hash_blocks(prompt(4), BLOCK_SIZE)
        stored(index, W0, Tier.L1, [hashes[1]])  # a tail covering blocks 0-1
        stored(index, W0, Tier.L2, [hashes[3]])  # the whole chunk
        assert index.match(hashes, W0) == TierMatch(l2=16)

    def test_a_tail_record_stops_the_walk(self) -> None:
        index, hashes = kv_index(), hash_blocks(prompt(12), BLOCK_SIZE)
        stored(index, W0, Tier.L1, [hashes[3], hashes[5], hashes[11]])  # chunk 0, a tail in chunk 1, chunk 2
        assert index.match(hashes, W0) == TierMatch(l1=24)  # blocks 6-7 are nowhere: chunk 2 is unreachable

    def test_a_chunk_of_another_prompt_does_not_match(self) -> None:
        index = kv_index()
        stored(index, W0, Tier.L1, [hash_blocks(prompt(4, start=5000), BLOCK_SIZE)[3]])
        assert index.match(hash_blocks(prompt(4), BLOCK_SIZE), W0) == TierMatch()

    def test_the_per_worker_tier_cap_ignores_excess_stores(self) -> None:
        index, hashes = kv_index(max_blocks=4), hash_blocks(prompt(12), BLOCK_SIZE)
        stored(index, W0, Tier.ENGINE, hashes[:3])
        stored(index, W0, Tier.ENGINE, hashes[3:5])  # 5 > 4: ignored as a whole
        assert index.match(hashes, W0) == TierMatch(engine=12)
        stored(index, W0, Tier.ENGINE, hashes[3:4])
        stored(index, W0, Tier.L1, hashes[4:8])  # L1 has its own cap
        stored(index, W1, Tier.ENGINE, hashes[:4])  # and so does every worker
        assert index.match(hashes, W0) == TierMatch(engine=16, l1=16)
        assert len(index) == 12

    def test_the_l2_cap_evicts_least_recently_stored(self) -> None:
        index = kv_index(max_blocks=4)
        stored(index, W0, Tier.L2, [1, 2, 3, 4])
        stored(index, W1, Tier.L2, [1, 5])  # 1 is refreshed, 2 goes
        assert len(index) == 4
        held = [h for h in (1, 2, 3, 4, 5) if index.match([h], W0) == TierMatch(l2=BLOCK_SIZE)]
        assert held == [1, 3, 4, 5]

    def test_a_chunk_size_that_is_not_a_multiple_of_the_block_size_is_refused(self) -> None:
        with pytest.raises(ValueError, match="multiple"):
            KVIndex(16, 40, 1000)


class TestKVAware:
    @staticmethod
    def policy(index: KVIndex, l2_weight: float = 0.5) -> KVAwarePolicy:
        return KVAwarePolicy(index, guard(), l2_weight, PrefixIndex(1000))

    def test_chooses_the_worker_holding_more_in_engine_or_l1(self) -> None:
        index, ids = kv_index(), prompt(8)
        hashes = hash_blocks(ids, BLOCK_SIZE)
        stored(index, W0, Tier.ENGINE, hashes[:2])
        stored(index, W1, Tier.L1, [hashes[3]])
        w0, w1 = Worker(W0), Worker(W1)
        assert picked(self.policy(index).select(routing(ids), [w0, w1])) == (w1, "matched", 16)
        stored(index, W0, Tier.ENGINE, hashes[2:5])
        assert picked(self.policy(index).select(routing(ids), [w0, w1])) == (w0, "matched", 20)

    def test_l2_alone_counts_alike_for_every_worker_so_the_least_loaded_wins(self) -> None:
        index, ids = kv_index(), prompt(8)
        stored(index, W0, Tier.L2, [hash_blocks(ids, BLOCK_SIZE)[3]])
        w0, w1 = Worker(W0, in_flight=2), Worker(W1, in_flight=1)
        assert picked(self.policy(index).select(routing(ids), [w0, w1])) == (w1, "matched", 16)
        w1.in_flight = 3
        assert picked(self.policy(index).select(routing(ids), [w0, w1])) == (w0, "matched", 16)

    def test_l2_weighs_less_than_a_workers_own_cache(self) -> None:
        index, ids = kv_index(), prompt(8)
        hashes = hash_blocks(ids, BLOCK_SIZE)
        stored(index, W0, Tier.L2, [hashes[3], hashes[7]])  # 32 tokens at 0.5 for both
        stored(index, W1, Tier.ENGINE, hashes[:1])  # 4 tokens in full, then 28 from L2 at 0.5
        w0, w1 = Worker(W0), Worker(W1)
        assert picked(self.policy(index).select(routing(ids), [w0, w1])) == (w1, "matched", 32)

    def test_nothing_held_anywhere_falls_back_to_the_least_loaded(self) -> None:
        index = kv_index()
        w0, w1 = Worker(W0, in_flight=1), Worker(W1)
        assert picked(self.policy(index).select(routing(prompt(8)), [w0, w1])) == (w1, "fallback", 0)
        assert picked(self.policy(index).select(routing(None), [w0, w1])) == (w1, "fallback", 0)

    def test_with_zero_l2_weight_an_l2_only_match_is_a_fallback(self) -> None:
        index, ids = kv_index(), prompt(4)
        stored(index, W0, Tier.L2, [hash_blocks(ids, BLOCK_SIZE)[3]])
        w0 = Worker(W0)
        assert picked(self.policy(index, l2_weight=0.0).select(routing(ids), [w0])) == (w0, "fallback", 0)

    @pytest.mark.parametrize(("holder_load", "outcome"), [(10, "load_guard"), (4, "matched")])
    def test_the_load_guard_applies(self, holder_load: int, outcome: str) -> None:
        index, ids = kv_index(), prompt(8)
        stored(index, W0, Tier.ENGINE, hash_blocks(ids, BLOCK_SIZE))
        holder, other = Worker(W0, in_flight=holder_load), Worker(W1)
        decision = self.policy(index).select(routing(ids), [holder, other])
        assert decision.outcome == outcome
        assert decision.worker is (other if outcome == "load_guard" else holder)


# -- health ------------------------------------------------------------------------------------------------


class TestCircuitBreaker:
    @staticmethod
    def opened(clock: FakeClock, cooldown_s: float = 5.0) -> CircuitBreaker:
        breaker = worker_breaker(3, cooldown_s, clock=clock)
        assert [breaker.record_failure() for _ in range(3)] == [False, False, True]
        return breaker

    def test_opens_after_the_threshold_of_consecutive_failures(self) -> None:
        clock = FakeClock()
        breaker = worker_breaker(3, 5.0, clock=clock)
        breaker.record_failure()
        breaker.record_failure()
        assert breaker.state == BreakerState.CLOSED and breaker.allows()
        assert breaker.record_failure() is True
        assert breaker.state == BreakerState.OPEN and not breaker.allows()
        assert breaker.record_failure() is False  # already open

    def test_a_success_resets_the_failure_count(self) -> None:
        breaker = worker_breaker(3, 5.0, clock=FakeClock())
        for _ in range(5):
            breaker.record_failure()
            breaker.record_failure()
            breaker.record_success()
        assert breaker.state == BreakerState.CLOSED and breaker.allows()

    def test_half_open_after_the_cooldown_lets_exactly_one_trial_through(self) -> None:
        clock = FakeClock()
        breaker = self.opened(clock)
        clock.advance(4.5)
        assert breaker.state == BreakerState.OPEN and not breaker.allows()
        clock.advance(0.5)
        assert breaker.state == BreakerState.HALF_OPEN and breaker.allows()
        breaker.on_attempt()
        assert not breaker.allows()  # the trial is in flight
        clock.advance(4.9)
        assert not breaker.allows()
        clock.advance(0.1)
        assert breaker.allows()  # a trial with no outcome for a cool-down (e.g. cancelled) makes room for another

    def test_a_successful_trial_closes(self) -> None:
        clock = FakeClock()
        breaker = self.opened(clock)
        clock.advance(5.0)
        breaker.on_attempt()
        breaker.record_success()
        assert breaker.state == BreakerState.CLOSED and breaker.allows()
        assert [breaker.record_failure() for _ in range(3)] == [False, False, True]  # a fresh count

    def test_a_failed_trial_reopens_with_a_doubled_cooldown_up_to_the_cap(self) -> None:
        clock = FakeClock()
        breaker = self.opened(clock)
        clock.advance(5.0)
        for cooldown_s in (10.0, 20.0, 40.0, MAX_COOLDOWN_S, MAX_COOLDOWN_S):
            assert breaker.state == BreakerState.HALF_OPEN
            breaker.on_attempt()
            assert breaker.record_failure() is False  # re-opened: not a new opening, nothing more to log
            clock.advance(cooldown_s - 0.5)
            assert breaker.state == BreakerState.OPEN and not breaker.allows()
            clock.advance(0.5)
        assert breaker.state == BreakerState.HALF_OPEN and breaker.allows()  # a new trial

    def test_success_after_backoff_restores_the_base_cooldown(self) -> None:
        clock = FakeClock()
        breaker = self.opened(clock)
        clock.advance(5.0)
        breaker.on_attempt()
        breaker.record_failure()  # cooldown now 10 s
        clock.advance(10.0)
        breaker.on_attempt()
        breaker.record_success()
        for _ in range(3):
            breaker.record_failure()
        clock.advance(5.0)
        assert breaker.state == BreakerState.HALF_OPEN


def checker(failure_threshold: int = 2, success_threshold: int = 2) -> HealthChecker:
    """A checker whose results the tests record themselves (its transport reaches no worker)."""
    return HealthChecker(
        list, InMemoryTransport(), failure_threshold=failure_threshold, success_threshold=success_threshold
    )


class TestHealthRecord:
    def test_a_never_probed_worker_is_unhealthy_on_its_first_failure(self) -> None:
        worker, health = Worker(W0), checker()
        assert worker.healthy is None and worker.is_routable
        health._record(worker, False, "ClientConnectorError")
        assert worker.healthy is False and not worker.is_routable

    def test_a_healthy_worker_needs_consecutive_failures(self) -> None:
        worker, health = Worker(W0, healthy=True), checker(failure_threshold=2)
        health._record(worker, False, "HTTP 500")
        assert worker.healthy is True
        health._record(worker, True, "HTTP 200")  # breaks the streak
        health._record(worker, False, "HTTP 500")
        assert worker.healthy is True
        health._record(worker, False, "HTTP 500")
        assert worker.healthy is False

    def test_success_threshold_successes_bring_it_back_and_reset_its_breaker(self) -> None:
        clock = FakeClock()
        worker = Worker(W0, breaker=worker_breaker(1, 5.0, clock=clock))
        health = checker(success_threshold=2)
        health._record(worker, False, "HTTP 503")
        worker.breaker.record_failure()
        assert worker.healthy is False and worker.breaker.state == BreakerState.OPEN
        health._record(worker, True, "HTTP 200")
        assert worker.healthy is False
        health._record(worker, False, "HTTP 503")  # breaks the streak
        health._record(worker, True, "HTTP 200")
        assert worker.healthy is False
        health._record(worker, True, "HTTP 200")
        assert worker.healthy is True and worker.breaker.state == BreakerState.CLOSED and worker.is_routable

    def test_a_first_success_below_the_threshold_leaves_a_new_worker_unprobed(self) -> None:
        worker, health = Worker(W0), checker(success_threshold=2)
        health._record(worker, True, "HTTP 200")
        assert worker.healthy is None and worker.is_routable
        health._record(worker, True, "HTTP 200")
        assert worker.healthy is True


# -- discovery ---------------------------------------------------------------------------------------------


class TestWorkerPool:
    def test_update_keeps_the_state_of_urls_that_stay(self) -> None:
        pool = WorkerPool([Worker("http://a:1/"), Worker("http://b:1")])
        a = pool.get("http://a:1")
        assert a is not None and a.url == "http://a:1"
        a.in_flight, a.healthy = 3, True
        a.breaker.record_failure()
        breaker = a.breaker
        pool.update([Worker("http://c:1/"), Worker("http://a:1//")])
        assert [w.url for w in pool] == ["http://c:1", "http://a:1"]
        kept = pool.get("http://a:1/")
        assert kept is a and kept.in_flight == 3 and kept.healthy is True and kept.breaker is breaker
        assert pool.get("http://b:1") is None and len(pool) == 2
        new = pool.get("http://c:1")
        assert new is not None and new.healthy is None and new.in_flight == 0

    def test_from_urls_normalizes_and_keeps_roles(self) -> None:
        pool = WorkerPool.from_urls(["http://a:1/"], ["http://p:1/"], ["http://d:1"], failure_threshold=7)
        assert [(w.url, w.role.value) for w in pool] == [
            ("http://a:1", "backend"),
            ("http://p:1", "prefill"),
            ("http://d:1", "decode"),
        ]
        assert all(w.breaker.failure_threshold == 7 for w in pool)


# -- prompt tokens -----------------------------------------------------------------------------------------


class FakeTokenizer:
    def __init__(self) -> None:
        self.chats: list[tuple[list[dict[str, Any]], bool]] = []

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(i) for i in ids]

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: Any = None
    ) -> list[int]:
        self.chats.append((messages, add_generation_prompt))
        return [len(messages), int(add_generation_prompt)]


class TestPromptTokenIds:
    @pytest.mark.parametrize(
        ("prompt_field", "expected"),
        [
            ("hi", [104, 105]),
            ([5, 6, 7], [5, 6, 7]),
            (["hi"], [104, 105]),  # a batch of one
            ([[5, 6, 7]], [5, 6, 7]),
        ],
    )
    def test_completion_prompts(self, prompt_field: Any, expected: list[int]) -> None:
        assert prompt_token_ids(FakeTokenizer(), "/v1/completions", {"prompt": prompt_field}) == expected

    def test_chat_messages_are_rendered_with_the_template(self) -> None:
        tokenizer = FakeTokenizer()
        messages = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None},
        ]
        assert prompt_token_ids(tokenizer, "/v1/chat/completions", {"messages": messages}) == [3, 1]
        body = {"messages": messages[:1], "add_generation_prompt": False}
        assert prompt_token_ids(tokenizer, "/v1/chat/completions", body) == [1, 0]
        assert tokenizer.chats == [
            (
                [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "a\nb"},
                    {"role": "assistant", "content": ""},
                ],
                True,
            ),
            ([{"role": "system", "content": "be brief"}], False),
        ]

    @pytest.mark.parametrize(
        ("path", "body"),
        [
            ("/v1/completions", {}),
            ("/v1/completions", {"prompt": ""}),
            ("/v1/completions", {"prompt": 5}),
            ("/v1/completions", {"prompt": []}),
            ("/v1/completions", {"prompt": ["a", "b"]}),  # a real batch: no single prompt
            ("/v1/completions", {"prompt": [1, "a"]}),
            ("/v1/completions", {"prompt": [True, 2]}),
            ("/v1/completions", {"prompt": [[1, 2], [3]]}),
            ("/v1/chat/completions", {}),
            ("/v1/chat/completions", {"messages": "hi"}),
            ("/v1/chat/completions", {"messages": []}),
            ("/v1/chat/completions", {"messages": ["hi"]}),
            ("/v1/chat/completions", {"messages": [{"content": "no role"}]}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": ["bare string part"]}]}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}),
        ],
    )
    def test_anything_unreadable_gives_none(self, path: str, body: dict[str, Any]) -> None:
        assert prompt_token_ids(FakeTokenizer(), path, body) is None


def test_a_half_open_trial_without_an_outcome_expires() -> None:
    now = [0.0]
    breaker = worker_breaker(1, 5.0, clock=lambda: now[0])
    breaker.record_failure()
    now[0] = 5.0
    breaker.on_attempt()  # the trial's request is cancelled: no success, no failure
    assert not breaker.allows()
    now[0] = 10.0
    assert breaker.allows()


@pytest.mark.parametrize("strategy", [RoutingStrategy.PREFIXAWARE, RoutingStrategy.KVAWARE])
def test_a_match_under_the_cache_threshold_goes_to_the_least_loaded_worker(strategy: RoutingStrategy) -> None:
    """A shared system prompt (2 of 10 blocks) must not pull a new conversation onto its worker."""
    kv_index = KVIndex(BLOCK_SIZE, CHUNK_SIZE, 1000)
    config = RouterConfig(routing_strategy=strategy, block_size=BLOCK_SIZE, cache_threshold=0.4)
    policy = build_policy(config, list, kv_index)
    owner, other = make_workers(2)
    system = prompt(2)
    route(policy, routing(system), [owner])
    kv_index.apply(owner.url, "owner", True, [(Tier.ENGINE, EventKind.STORED, hash_blocks(system, BLOCK_SIZE))])
    owner.in_flight = 1
    new_conversation = [*system, *prompt(8, start=1000)]
    assert picked(policy.select(routing(new_conversation), [owner, other])) == (other, "below_threshold", 0)
    follow_up = [*system, *prompt(2, start=1000)]  # half of it held by the owner
    assert policy.select(routing(follow_up), [owner, other]).worker is owner


@pytest.mark.parametrize("strategy", [RoutingStrategy.PREFIXAWARE, RoutingStrategy.KVAWARE])
def test_cold_prompts_go_where_the_least_prefill_is_queued(strategy: RoutingStrategy) -> None:
    """Every cache-aware decision says what the worker must compute (the forwarder counts it as queued there
    until the worker answers), and a prompt that no worker holds goes where the least of that is queued, not
    where the fewest requests are: one worker prefilling a long cold prompt is busier than one streaming two
    cached follow-ups."""
    kv_index = KVIndex(BLOCK_SIZE, CHUNK_SIZE, 1000)
    policy = build_policy(RouterConfig(routing_strategy=strategy, block_size=BLOCK_SIZE), list, kv_index)
    busy, streaming = make_workers(2)
    cold = prompt(10, start=5000)
    first = policy.select(routing(cold), [busy])
    assert (first.matched_tokens, first.uncached_tokens) == (0, 10 * BLOCK_SIZE)
    busy.pending_prefill.add(first.uncached_tokens)  # what the forwarder does
    busy.in_flight = 1
    streaming.in_flight = 2
    assert policy.select(routing(prompt(10, start=9000)), [busy, streaming]).worker is streaming
    busy.pending_prefill.remove(first.uncached_tokens)  # it answered: compared by requests in flight again
    assert policy.select(routing(prompt(10, start=9000)), [busy, streaming]).worker is busy
    # a match: the uncached tokens are the prompt's less what the worker holds
    route(policy, routing(cold), [busy])
    kv_index.apply(busy.url, "busy", True, [(Tier.ENGINE, EventKind.STORED, hash_blocks(cold, BLOCK_SIZE))])
    follow_up = policy.select(routing([*cold, *prompt(2, start=7000)]), [busy, streaming])
    assert (follow_up.worker, follow_up.matched_tokens, follow_up.uncached_tokens) == (busy, 40, 8)

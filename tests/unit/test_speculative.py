"""Prompt-lookup drafts and their verification, without a model."""

from __future__ import annotations

import pytest

from splitserve.config import SpeculativeConfig
from splitserve.engine.speculative import NgramProposer, accept


def proposer(**kwargs: int) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(**kwargs))  # type: ignore[arg-type]


def test_the_drafts_follow_the_latest_earlier_occurrence_of_the_context_end() -> None:
    p = proposer(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3)
    #          0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 6, 7, 1, 2, 5, 6, 8, 9, 4, 5, 6]
    assert p.propose("r", tokens, 10) == [8, 9, 4]  # "5 6" last seen at 5..6, followed by 8 9 4
    assert p.propose("s", [1, 2, 3, 9, 9, 1, 2, 3], 10) == [9, 9, 1]  # the 3-gram "1 2 3"


def test_the_longest_matching_n_gram_wins() -> None:
    p = proposer(num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=3)
    # "3" alone last occurs at 4 (then 7); "2 3" only at 1..2 (then 4)
    assert p.propose("r", [1, 2, 3, 4, 3, 7, 2, 3], 10) == [4, 3]


def test_no_match_no_drafts_and_the_cap_is_kept() -> None:
    p = proposer(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=2)
    assert p.propose("r", [1, 2, 3, 4, 5], 10) == []
    assert p.propose("s", [1, 2, 3, 4, 1, 2], 2) == [3, 4]  # max_drafts below num_speculative_tokens
    assert p.propose("t", [1, 2, 3, 4, 1, 2], 0) == []


def test_the_index_grows_with_the_tokens() -> None:
    p = proposer(num_speculative_tokens=2, prompt_lookup_min=2, prompt_lookup_max=2)
    tokens = [1, 2, 3, 4]
    assert p.propose("r", tokens, 5) == []
    tokens += [9, 1, 2]
    assert p.propose("r", tokens, 5) == [3, 4]
    tokens += [3, 7, 7, 1, 2]  # "1 2" now last seen at 5..6, followed by 3 7
    assert p.propose("r", tokens, 5) == [3, 7]
    p.forget("r")
    assert p.propose("r", tokens, 5) == [3, 7]  # rebuilt from nothing, the same


def test_accept_keeps_drafts_while_they_equal_the_samples_then_one_more() -> None:
    assert accept([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # every draft, and the token after them
    assert accept([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # the second draft was wrong: its sample replaces it
    assert accept([4, 5, 6], [3, 5, 6, 7]) == [3]
    assert accept([], [8]) == [8]


def test_the_stats_count_drafts_and_accepted_positions() -> None:
    p = proposer(num_speculative_tokens=3)
    p.record(3, 2)
    p.record(2, 0)
    assert (p.stats.num_drafts, p.stats.num_draft_tokens, p.stats.num_accepted_tokens) == (2, 5, 2)
    assert p.stats.accepted_per_position == [1, 1, 0]


def test_the_config_reads_vllms_json_and_refuses_what_it_cannot_run() -> None:
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}')
    assert config is not None and (config.num_speculative_tokens, config.prompt_lookup_max) == (5, 3)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("  ") is None
    for bad, message in [
        ("{not json", "not JSON"),
        ("[1]", "JSON object"),
        ('{"method": "eagle"}', "method"),
        ('{"method": "ngram", "model": "x"}', "unknown keys"),
        ('{"num_speculative_tokens": 0}', "positive"),
        ('{"prompt_lookup_min": 5, "prompt_lookup_max": 3}', "prompt_lookup_min"),
    ]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.parse(bad)

"""The planner's workloads: the trace format (round trip, bad lines named), and the generated shapes."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from splitserve.planner.workload import (
    DEFAULT_RATES,
    TraceError,
    TraceRequest,
    WorkloadShape,
    generate,
    load_trace,
    parse_trace,
    save_trace,
)

# ---------------------------------------------------------------------------------------------- the trace format


def test_a_saved_trace_loads_back_equal(tmp_path: Path) -> None:
    requests = [
        TraceRequest(0.0, 900, 120),
        TraceRequest(0.25, 1200, 64, "doc-3", 800),
        TraceRequest(0.25, 40, 1, "chat-1", 0),
        TraceRequest(7.123456, 5000, 300),
    ]
    path = tmp_path / "trace.jsonl"
    save_trace(path, requests)
    assert load_trace(path) == requests
    assert json.loads(path.read_text().splitlines()[1]) == {
        "arrival_s": 0.25,
        "prompt_tokens": 1200,
        "output_tokens": 64,
        "prefix_group": "doc-3",
        "prefix_tokens": 800,
    }


def test_a_generated_workload_round_trips(tmp_path: Path) -> None:
    requests = generate(WorkloadShape.CHAT, num_requests=200, seed=3)
    path = tmp_path / "chat.jsonl"
    save_trace(path, requests)
    loaded = load_trace(path)
    assert [(r.prompt_tokens, r.output_tokens, r.prefix_group, r.prefix_tokens) for r in loaded] == [
        (r.prompt_tokens, r.output_tokens, r.prefix_group, r.prefix_tokens) for r in requests
    ]
    assert all(abs(a.arrival_s - b.arrival_s) < 1e-6 for a, b in zip(loaded, requests, strict=True))


def test_blank_lines_and_comments_are_skipped() -> None:
    lines = ["# a comment", "", '{"arrival_s": 1, "prompt_tokens": 10, "output_tokens": 2}', "   "]
    assert parse_trace(lines) == [TraceRequest(1.0, 10, 2)]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"arrival_s": 1, "prompt_tokens": 10}', "output_tokens is missing"),
        ('{"arrival_s": 1, "prompt_tokens": 10, "output_tokens": 2, "prompt": "hi"}', "unknown field 'prompt'"),
        ('{"arrival_s": "soon", "prompt_tokens": 10, "output_tokens": 2}', "arrival_s must be a number"),
        ('{"arrival_s": -1, "prompt_tokens": 10, "output_tokens": 2}', "arrival_s must be a finite number >= 0"),
        ('{"arrival_s": 1, "prompt_tokens": 10.5, "output_tokens": 2}', "prompt_tokens must be an integer"),
        ('{"arrival_s": 1, "prompt_tokens": 0, "output_tokens": 2}', "must be >= 1"),
        ('{"arrival_s": 1, "prompt_tokens": 10, "output_tokens": 2, "prefix_tokens": 4}', "needs a prefix_group"),
        (
            '{"arrival_s": 1, "prompt_tokens": 10, "output_tokens": 2, "prefix_group": "a", "prefix_tokens": 10}',
            "prefix_tokens must be in [0, prompt_tokens)",
        ),
        ('{"arrival_s": 1, "prompt_tokens": 10, "output_tokens": 2, "prefix_group": ""}', "non-empty string"),
        ('{"arrival_s": 1, "prompt_tokens": true, "output_tokens": 2}', "prompt_tokens must be an integer"),
    ],
)
def test_a_bad_line_is_named_with_its_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 2}\n# fine\n' + line + "\n")
    with pytest.raises(TraceError) as caught:
        load_trace(path)
    assert str(caught.value).startswith(f"{path}:3: ")
    assert message in str(caught.value)


def test_arrivals_must_not_go_back_in_time() -> None:
    lines = ['{"arrival_s": 2, "prompt_tokens": 10, "output_tokens": 2}',
             '{"arrival_s": 1, "prompt_tokens": 10, "output_tokens": 2}']  # fmt: skip
    with pytest.raises(TraceError, match=r"<trace>:2: arrival_s 1.0 is before the previous line's 2.0"):
        parse_trace(lines)


def test_an_empty_or_missing_trace_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("# nothing\n")
    with pytest.raises(TraceError, match="no requests"):
        load_trace(tmp_path / "empty.jsonl")
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "missing.jsonl")


# ---------------------------------------------------------------------------------------------- the shapes


@pytest.mark.parametrize("shape", list(WorkloadShape))
def test_a_shape_is_deterministic_per_seed(shape: WorkloadShape) -> None:
    assert generate(shape, num_requests=100, seed=1) == generate(shape, num_requests=100, seed=1)
    assert generate(shape, num_requests=100, seed=1) != generate(shape, num_requests=100, seed=2)


@pytest.mark.parametrize("shape", list(WorkloadShape))
def test_a_shape_arrives_at_its_rate_in_order_and_fits_the_context(shape: WorkloadShape) -> None:
    requests = generate(shape, num_requests=1500, seed=0, max_model_len=4096)
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals) and len(requests) == 1500
    rate = (len(requests) - 1) / (arrivals[-1] - arrivals[0])
    assert rate == pytest.approx(DEFAULT_RATES[shape], rel=0.15)
    for r in requests:
        r.check()
        assert r.prompt_tokens + r.output_tokens <= 4096


def test_the_shapes_differ_as_documented() -> None:
    long = generate(WorkloadShape.LONG_CONTEXT, num_requests=300)
    assert all(3000 <= r.prompt_tokens <= 7000 and r.prefix_group is None for r in long)
    rag = generate(WorkloadShape.RAG, num_requests=300)
    assert all(r.prefix_group is not None and r.prefix_group.startswith("doc-") for r in rag)
    assert all(1500 <= r.prefix_tokens <= 3000 for r in rag)
    mixed = generate(WorkloadShape.MIXED, num_requests=1000)
    share_long = sum(r.prompt_tokens >= 3000 for r in mixed) / len(mixed)
    assert share_long == pytest.approx(0.3, abs=0.05)


def test_a_chat_turn_extends_its_conversation() -> None:
    requests = generate(WorkloadShape.CHAT, num_requests=400)
    by_group: dict[str, list[TraceRequest]] = {}
    for r in requests:
        assert r.prefix_group is not None
        by_group.setdefault(r.prefix_group, []).append(r)
    turns = [group for group in by_group.values() if len(group) > 1]
    assert turns
    for group in turns:
        assert group[0].prefix_tokens == 0
        for previous, turn in itertools.pairwise(group):
            assert turn.prefix_tokens == previous.prompt_tokens + previous.output_tokens
            assert turn.prompt_tokens > turn.prefix_tokens


def test_an_unknown_shape_or_rate_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown workload 'batch'; workloads: chat, rag, mixed, long-context"):
        generate("batch")
    with pytest.raises(ValueError, match="rate and num_requests must be positive"):
        generate("chat", rate=0)

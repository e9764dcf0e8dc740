"""Reading a Prometheus page: whole sample names and any labels, never a substring."""

from __future__ import annotations

from splitserve.metrics import sum_samples

PAGE = """# HELP vllm:num_requests_running Requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a,b",engine="0"} 2.0
vllm:num_requests_running{model_name="c",engine="1"} 1.0
# HELP vllm:num_requests_running_total_seconds A different metric sharing the prefix.
# TYPE vllm:num_requests_running_total_seconds gauge
vllm:num_requests_running_total_seconds 40.0
# HELP splitserve:prefill_time_seconds Prefill time.
# TYPE splitserve:prefill_time_seconds histogram
splitserve:prefill_time_seconds_bucket{le="+Inf"} 3.0
splitserve:prefill_time_seconds_count 3.0
splitserve:prefill_time_seconds_sum 1.5
"""


def test_samples_are_matched_by_their_whole_name_across_labels() -> None:
    assert sum_samples(PAGE, "vllm:num_requests_running") == 3.0
    assert sum_samples(PAGE, "splitserve:prefill_time_seconds_count") == 3.0
    assert sum_samples(PAGE, "splitserve:prefill_time_seconds_sum") == 1.5
    assert sum_samples(PAGE, "vllm:num_requests_waiting") == 0.0
    assert sum_samples(PAGE, "vllm:num_requests_running", engine="1") == 1.0
    assert sum_samples(PAGE, "vllm:num_requests_running", engine="2") == 0.0

"""Print the ``vllm:`` metric families vLLM exposes on a CPU worker, from vLLM's own Prometheus stat logger.

Run it with the peer venv's interpreter (``scripts/setup_vllm_cpu.sh`` installs vLLM there); it starts no engine
and loads no model: it builds vLLM's ``PrometheusStatLogger`` over a default configuration (no LoRA, speculative
decoding, KV connector or watermark: what ``vllm serve MODEL`` on a CPU has), exactly as vLLM does at start, and
reads the families back from the registry::

    ~/.cache/splitserve/peers/vllm-venv/bin/python scripts/vllm_metric_families.py --max-model-len 512 \\
        > tests/data/vllm_0_32_metric_families.txt

One family a line, tab-separated: the name as exposed (counters with ``_total``), the type, the label names
(sorted, comma-separated), the bucket edges of a histogram (``-`` otherwise) and the HELP text. The token-count
histograms' edges depend on ``max_model_len`` (a 1-2-5 series up to it), hence the flag; the test that reads the
file builds its worker with the same length.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from prometheus_client import REGISTRY
from prometheus_client.metrics_core import Metric


def _vllm_families(max_model_len: int) -> list[Metric]:
    import vllm
    from vllm.config import CacheConfig, ObservabilityConfig
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    config = SimpleNamespace(
        observability_config=ObservabilityConfig(),
        model_config=SimpleNamespace(served_model_name="m", max_model_len=max_model_len, is_diffusion=False),
        cache_config=CacheConfig(),
        device_config=SimpleNamespace(device_type="cpu"),
        speculative_config=None,
        kv_transfer_config=None,
        ec_transfer_config=None,
        lora_config=None,
        watermark_config=None,
    )
    stat_logger = PrometheusStatLogger(config, [0])  # type: ignore[arg-type]
    stat_logger.log_engine_initialized()  # vllm:cache_config_info
    print(f"# vLLM {vllm.__version__}: its PrometheusStatLogger with the default CPU configuration, "
          f"max_model_len={max_model_len}.")  # fmt: skip
    return [f for f in REGISTRY.collect() if f.name.startswith("vllm:")]


def _line(family: Metric) -> str:
    name = f"{family.name}_total" if family.type == "counter" else family.name
    samples = family.samples
    labels = sorted({k for s in samples for k in s.labels} - {"le"})
    edges = sorted({float(s.labels["le"]) for s in samples if "le" in s.labels} - {float("inf")})
    buckets = ",".join(f"{e:g}" for e in edges) if family.type == "histogram" else "-"
    return "\t".join([name, family.type, ",".join(labels), buckets, family.documentation])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-model-len", type=int, default=512)
    args = parser.parse_args()
    print("# Made by scripts/vllm_metric_families.py. name, type, labels, bucket edges, HELP; tab-separated.")
    for family in sorted(_vllm_families(args.max_model_len), key=lambda f: f.name):
        print(_line(family))


if __name__ == "__main__":
    main()

"""splitserve: an open LLM serving stack with disaggregated prefill/decode and a tiered KV cache."""

__version__ = "0.1.0"

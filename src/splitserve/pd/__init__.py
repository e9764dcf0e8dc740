"""Disaggregated prefill/decode: KV transfer from prefill to decode workers over TCP, with a bounded buffer."""

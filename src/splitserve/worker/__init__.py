"""One ``splitserve worker`` process: its HTTP app (``app``, ``serving``, ``protocol``), how it runs (``run``), its
KV events (``kv_events``, ``vllm_publisher``) and its composition root (``build``)."""

"""What crosses a process boundary, typed once: torch-free, so that the router, the workers and the tools share
each message's one definition.

- :mod:`~splitserve.protocol.errors`: OpenAI's error body, for every 4xx and 5xx any process answers;
- :mod:`~splitserve.protocol.kv_transfer`: the ``kv_transfer_params`` of disaggregated prefill/decode, as the
  router sends them and as the prefill worker reports its push.
"""

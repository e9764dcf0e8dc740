"""What crosses a process boundary, typed once: torch-free, so that the router, the workers and the tools share
each message's one definition.

- :mod:`~splitserve.protocol.errors`: OpenAI's error body, for every 4xx and 5xx any process answers;
- :mod:`~splitserve.protocol.openai`: OpenAI's completion and chat completion answers, whole and streamed (SSE);
- :mod:`~splitserve.protocol.sagemaker`: SageMaker's ``/invocations`` and ``/ping``, mapped to OpenAI's routes;
- :mod:`~splitserve.protocol.kv_transfer`: the ``kv_transfer_params`` of disaggregated prefill/decode, as the
  router sends them and as the prefill worker reports its push;
- :mod:`~splitserve.protocol.kv_events`: the KV events a worker reports to routers (JSON batches), and the
  sinks its engine and KV store report them to;
- :mod:`~splitserve.protocol.vllm_events`: vLLM's KV event format (msgpack frames over ZMQ), which the router
  reads from vLLM workers and a splitserve worker can publish.
"""

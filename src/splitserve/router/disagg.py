"""Conditional disaggregation: long prompts are prefilled on the prefill pool, short ones go to decode directly.

Per request (``Disaggregator.proxy``):

1. Count the prompt's tokens with the workers' tokenizer and chat template, and pick the decode worker D
   first, with the configured strategy over the decode pool.
2. Disaggregate when the tokens D would have to compute (the prompt minus what the strategy found D already
   holds) reach ``--routing-threshold``; log ``Conditional routing: estimated_tokens=E, threshold=T,
   disaggregate=B``. Otherwise forward to D as a colocated worker would be.
3. Disaggregated: send a prefill worker P, picked by the same strategy over the prefill pool (a prefill worker
   holding the prompt's prefix computes less), the request with ``max_tokens`` 1, not streamed, and
   ``kv_transfer_params`` {transfer_id, decode_kv_addr} (D's KV receiver, from ``GET /kv/transfer``). P computes
   the prompt, samples the first token, pushes the KV into D's PD buffer and answers with the token and the
   push's result.
4. Send D the original request with ``kv_transfer_params`` {transfer_id, first_token_id}: D takes the KV from
   its buffer (or recomputes it when the push failed) and forces P's first token, so both agree on it. A
   streaming client gets the first token from P's answer at once; D then streams the rest
   (``skip_first_token``). If P fails, D computes the prompt itself: slower, never an error.

Streams are followed for migration as colocated ones are (``router/migrate.py``), on every path: when D dies
mid-stream, another decode worker goes on from the prompt and the tokens generated so far (the first one, P's,
included), computing them itself or loading them from L2.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from starlette.responses import Response, StreamingResponse

from splitserve.auth import sign
from splitserve.openai_chunks import answer_text, sse_event, stream_error_end, text_chunk
from splitserve.router.discovery import Worker, WorkerPool, WorkerRole
from splitserve.router.forward import Call, Forwarder
from splitserve.router.migrate import is_migratable
from splitserve.router.policies import Decision, build_policy
from splitserve.router.transport import TransportError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from splitserve.config import RouterConfig
    from splitserve.router.kv_index import KVIndex

logger = logging.getLogger("splitserve.router")

CHARS_PER_TOKEN = 4  # the estimate when the prompt cannot be tokenized
PREFILL_DROPPED_FIELDS = ("max_completion_tokens", "min_tokens", "stream_options", "n", "logprobs", "top_logprobs")


class Disaggregator:
    """The proxy of a disaggregated endpoint. It sends requests through ``forwarder`` (the plain proxy's), picks
    decode workers with the forwarder's policy, and prefill workers with an instance of its own."""

    def __init__(self, config: RouterConfig, pool: WorkerPool, kv_index: KVIndex, forwarder: Forwarder) -> None:
        self.config = config
        self.pool = pool
        self.forwarder = forwarder
        self.metrics = forwarder.metrics
        self.threshold = config.routing_threshold
        # the prefill pool gets its own instance of the configured strategy (its own prefix index, ring...)
        self.prefill_policy = build_policy(config, self.prefill_pool, kv_index)

    def decode_pool(self) -> list[Worker]:
        return self.pool.by_role(WorkerRole.DECODE)

    def prefill_pool(self) -> list[Worker]:
        return self.pool.by_role(WorkerRole.PREFILL)

    async def proxy(self, call: Call) -> Response:
        forwarder = self.forwarder
        decoders = [w for w in self.decode_pool() if w.is_routable]
        if not decoders:
            return await forwarder.forward(call, self.decode_pool)  # the 503, counted and explained
        decision = forwarder.policy.select(call.routing, decoders)
        estimated = self._estimated_tokens(call)
        uncached = estimated - decision.matched_tokens
        prefillers = [w for w in self.prefill_pool() if w.is_routable]
        disaggregate = uncached >= self.threshold and bool(prefillers)
        held = f" (decode worker {decision.worker.name} holds {decision.matched_tokens})"
        logger.info(
            "Conditional routing: estimated_tokens=%d, threshold=%d, disaggregate=%s%s",
            estimated, self.threshold, disaggregate, held if decision.matched_tokens else "",
        )  # fmt: skip
        migratable = self.config.stream_migration and is_migratable(call.path, call.body)
        if not disaggregate:
            self.metrics.pd_path("direct")
            if migratable:
                forwarder.track(call)
            return await forwarder.forward(call, self.decode_pool, decision)
        decoder = decision.worker
        prefiller = self.prefill_policy.select(call.routing, prefillers).worker
        addr = await self._kv_addr(decoder)
        transfer_id = f"xfer-{uuid.uuid4().hex}"
        answer = await self._prefill(prefiller, call, transfer_id, addr) if addr is not None else None
        if answer is not None and 400 <= answer[0] < 500 and answer[0] != 429:
            return Response(answer[1], answer[0], media_type="application/json")  # the client's mistake
        p_body = _json_object(answer[1]) if answer is not None and answer[0] == 200 else None
        if p_body is None:
            logger.warning("prefill of %s failed; decode worker %s computes the prompt", transfer_id, decoder.name)
            self.metrics.pd_path("fallback")
            if migratable:
                forwarder.track(call)
            return await forwarder.forward(call, self.decode_pool, decision)
        self.prefill_policy.on_routed(call.routing, prefiller)
        report = p_body.get("kv_transfer_params") or {}
        if not report.get("ok"):
            decoder.kv_transfer_addr = None  # it may have moved (a restart); ask again next time
            logger.warning("KV transfer %s failed (%s); decode recomputes", transfer_id, report.get("reason"))
        self.metrics.observe_transfer(report)
        self.metrics.pd_path("disaggregated")
        first_token = report.get("first_token_id")
        params = self._signed(
            {"transfer_id": transfer_id, "first_token_id": first_token, "skip_first_token": call.is_stream}
        )
        decode_call = _with_body(call, call.body | {"kv_transfer_params": params})
        decode_call.observe_ttft = not call.is_stream  # a stream's first token came from prefill
        if not call.is_stream or first_token is None:
            return await forwarder.forward(decode_call, self.decode_pool, decision)
        is_chat = call.path.endswith("/chat/completions")
        first_text = answer_text(is_chat, p_body)
        if migratable:  # D's stream carries the first token's id, and the client has its text already
            forwarder.track(decode_call, sent_text=first_text)
        first_chunk = _first_chunk(is_chat, p_body, first_text)
        self.metrics.ttft_s.observe(time.perf_counter() - call.start_s)
        relay = self._stream_after_first(first_chunk, decode_call, decision)
        return StreamingResponse(relay, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _stream_after_first(self, first_chunk: bytes, call: Call, decision: Decision) -> AsyncIterator[bytes]:
        """The first token's chunk at once, then D's stream (its first token's text left out)."""
        yield first_chunk
        response = await self.forwarder.forward(call, self.decode_pool, decision)
        if isinstance(response, StreamingResponse):
            async for chunk in response.body_iterator:
                yield chunk if isinstance(chunk, bytes) else str(chunk).encode()
            return
        error = bytes(response.body) if response.status_code != 200 else b""  # decode failed before streaming
        yield stream_error_end(error.decode(errors="replace") or "no decode worker answered")

    async def _prefill(self, worker: Worker, call: Call, transfer_id: str, addr: str) -> tuple[int, bytes] | None:
        """P's status and body for the prefill request, or None when P could not be reached."""
        body = {k: v for k, v in call.body.items() if k not in PREFILL_DROPPED_FIELDS}
        params = self._signed({"transfer_id": transfer_id, "decode_kv_addr": addr})
        body |= {"max_tokens": 1, "stream": False, "kv_transfer_params": params}
        worker.in_flight += 1
        worker.breaker.on_attempt()
        began = time.perf_counter()
        try:
            upstream = await self.forwarder.transport.post(worker.url + call.path, json.dumps(body).encode(),
                                                           call.headers)  # fmt: skip
            content = await upstream.read()
        except TransportError as exc:
            worker.breaker.record_failure()
            logger.warning("prefill worker %s failed: %s", worker.name, exc)
            return None
        finally:
            worker.in_flight -= 1
        self.metrics.prefill_s.observe(time.perf_counter() - began)
        if upstream.status >= 500:
            worker.breaker.record_failure()
        else:
            worker.breaker.record_success()
        return upstream.status, content

    async def _kv_addr(self, worker: Worker) -> str | None:
        """D's KV receiver address (cached); None if it has none or did not answer."""
        if worker.kv_transfer_addr is None:
            info = await self.forwarder.get_json(f"{worker.url}/kv/transfer")
            worker.kv_transfer_addr = info.get("addr") if isinstance(info, dict) else None
            if worker.kv_transfer_addr is None:
                logger.warning("decode worker %s reports no KV receiver (is it --role decode?)", worker.name)
        return worker.kv_transfer_addr

    def _signed(self, params: dict[str, Any]) -> dict[str, Any]:
        """``kv_transfer_params`` as workers with the cluster secret accept them: signed by the router."""
        secret = self.config.cluster_secret
        return params if secret is None else params | {"mac": sign(secret, params)}

    def _estimated_tokens(self, call: Call) -> int:
        if call.routing.token_ids is not None:
            return len(call.routing.token_ids)
        return len(json.dumps(call.body.get("messages") or call.body.get("prompt") or "")) // CHARS_PER_TOKEN


def _json_object(content: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(content)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _with_body(call: Call, body: dict[str, Any]) -> Call:
    from dataclasses import replace

    headers = {k: v for k, v in call.headers.items() if k.lower() != "content-length"}
    return replace(call, body=body, raw=json.dumps(body).encode(), headers=headers)


def _first_chunk(is_chat: bool, prefill_answer: dict[str, Any], text: str) -> bytes:
    """An SSE chunk carrying the first token's ``text`` from P's answer, in the API's format."""
    common = {"id": prefill_answer.get("id", ""), "created": prefill_answer.get("created", int(time.time())),
              "model": prefill_answer.get("model", "")}  # fmt: skip
    return sse_event(text_chunk(is_chat, common, text, role=True))

"""Conditional disaggregation: long prompts are prefilled on the prefill pool, short ones go to decode directly.

Per request (``Disaggregator.proxy``):

1. Count the prompt's tokens with the workers' tokenizer and chat template, and pick the decode worker D
   first, with the configured strategy over the decode pool.
2. Decide (:class:`PDDecision`). Nothing is disaggregated unless the tokens D would have to compute (the prompt
   minus what the strategy found D already holds) reach ``--routing-threshold`` and a prefill worker P is
   routable; P is picked by the same strategy over the prefill pool (a prefill worker holding the prompt's prefix
   computes less). ``threshold`` (the default: the reference system's rule, which the reference system's checks expect)
   then disaggregates. ``cost`` (``--pd-decision cost``) disaggregates only when the cost model
   (``router/cost.py``, :func:`~splitserve.router.cost.pd_costs`) says

       remote_s < local_s + harm_s
       remote_s = (P's queued prefill tokens + the tokens P must compute) x P's s/token + prompt x push s/token
       local_s  = (D's queued prefill tokens + the tokens D must compute) x D's s/token
       harm_s   = D's requests in flight x the tokens D must compute x D's s/token

   ``harm_s`` is why: every stream D runs stalls while D prefills, so an idle D keeps a long prompt (no push to
   pay) and a busy one sends it to P, which keeps decode latency flat. Either way the router logs
   ``Conditional routing: estimated_tokens=E, threshold=T, disaggregate=B``, with ``remote_ms``, ``local_ms`` and
   ``harm_ms`` appended when the cost rule decided. Not disaggregated: forward to D as a colocated worker would be.
3. Disaggregated: send P the request with ``max_tokens`` 1, not streamed, and
   ``kv_transfer_params`` {transfer_id, decode_kv_addr} (D's KV receiver, from ``GET /kv/transfer``). P computes
   the prompt, samples the first token, pushes the KV into D's PD buffer and answers with the token and the
   push's result.
4. Send D the original request with ``kv_transfer_params`` {transfer_id}: D takes the KV from its buffer (or
   recomputes it when the push failed). A stream of one sequence whose first token is plain text
   (:func:`sends_first_token`) gets its first chunk from P's answer at once, with that token's logprobs when
   asked; D is told {first_token_id, skip_first_token}, forces P's token, so both agree on it, and streams
   the rest. Anything else D answers whole, drawing the first token itself on the loaded KV: a whole answer,
   each of ``n`` sequences (which load the push once: the others start from its cached blocks), a stream with
   tools (whose calls are read from the whole output) or one whose first token P read as reasoning. If P
   fails, D computes the prompt itself: slower, never an error.

vLLM pairs (splitserve's KV connector in both, ``splitserve.worker.vllm_connector``) go the same way, but D's
receiver is at ``--vllm-kv-transfer-port`` of its host (vLLM has no ``/kv/transfer``), and D computes the
prompt's last token on the loaded KV and samples the first token itself, as vLLM's own disaggregation does: a
stream is D's whole stream, and P's first token is not sent.

A request for its prompt's logprobs (``prompt_logprobs``, or ``echo`` with ``logprobs``), which computes its
whole prompt wherever it runs, goes to D as to a colocated worker (the log says why), and so does a request of
several sequences whose D is a vLLM worker, whose connector loads a push for one request. A schema, regex or grammar
goes through as it is: P draws the first token within it, and D's grammar starts by taking that token (or
draws its own).

Streams are followed for migration as colocated ones are (``router/migrate.py``), on every path: when D dies
mid-stream, another decode worker goes on from the prompt and the tokens generated so far (the first one, P's,
included), computing them itself or loading them from L2.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from starlette.responses import Response, StreamingResponse

from splitserve import tracing
from splitserve.auth import sign
from splitserve.config import BackendKind, PDDecision, port_of
from splitserve.protocol.kv_transfer import KVTransferParams, KVTransferReport
from splitserve.protocol.openai import answer_text, sse_event, stream_error_end, text_chunk
from splitserve.router.cost import PDCosts, PrefillCostModel, QueuedPrefill, pd_costs
from splitserve.router.discovery import Worker, WorkerPool, WorkerRole
from splitserve.router.forward import Call, Forwarder
from splitserve.router.migrate import is_migratable, num_logprobs
from splitserve.router.policies import Decision, build_policy
from splitserve.router.transport import TransportError
from splitserve.router.vllm_events import host_and_port

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from splitserve.config import RouterConfig
    from splitserve.router.kv_index import KVIndex

logger = logging.getLogger("splitserve.router")

CHARS_PER_TOKEN = 4  # the estimate when the prompt cannot be tokenized
# P computes the prompt and draws one token: one sequence, no usage to stream, the client's logprobs (for a first
# token sent from P's answer)
PREFILL_DROPPED_FIELDS = ("max_completion_tokens", "min_tokens", "stream_options", "n", "best_of")


@dataclass(frozen=True, slots=True)
class _Route:
    """Where one request goes: D (``uncached_tokens``: what D would compute itself), and P when disaggregated."""

    decode: Decision
    prefill: Decision | None


@dataclass(frozen=True, slots=True)
class _PrefillAnswer:
    status: int
    content: bytes
    body: dict[str, Any] | None  # the JSON object of a 200 answer, else None

    @property
    def report(self) -> KVTransferReport:
        """P's ``kv_transfer_params``: the push's outcome, its timing and the first token."""
        return KVTransferReport.from_api(self.body.get("kv_transfer_params") if self.body is not None else None)


class Disaggregator:
    """The proxy of a disaggregated endpoint. It sends requests through ``forwarder`` (the plain proxy's), picks
    decode workers with the forwarder's policy, and prefill workers with an instance of its own; it prices
    disaggregation with the forwarder's cost model, which it also teaches the pushes' and prefill workers' rates."""

    def __init__(
        self,
        config: RouterConfig,
        pool: WorkerPool,
        kv_index: KVIndex,
        forwarder: Forwarder,
    ) -> None:
        self.config = config
        self.pool = pool
        self.forwarder = forwarder
        self.metrics = forwarder.metrics
        self.threshold = config.routing_threshold
        self.decision = config.pd_decision
        self.cost = forwarder.cost if forwarder.cost is not None else PrefillCostModel()
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
        route = self._route(call, decoders)
        decision = route.decode
        migratable = self.config.stream_migration and is_migratable(call.path, call.body)
        if route.prefill is None:
            return await self._to_decoder(call, decision, migratable, "direct")
        decoder = decision.worker
        addr = await self._kv_addr(decoder)
        if addr is not None and not decoder.forces_first_token and (several := several_sequences(call.body)):
            logger.info(
                "Conditional routing: not disaggregated, %s: a vLLM decode worker loads a push for one", several
            )
            return await self._to_decoder(call, decision, migratable, "direct")
        transfer_id = f"xfer-{uuid.uuid4().hex}"
        answer = await self._prefill(route.prefill, call, transfer_id, addr) if addr is not None else None
        if answer is not None and 400 <= answer.status < 500 and answer.status != 429:
            return Response(answer.content, answer.status, media_type="application/json")  # the client's mistake
        p_body = answer.body if answer is not None else None
        if answer is None or p_body is None:
            logger.warning("prefill of %s failed; decode worker %s computes the prompt", transfer_id, decoder.name)
            return await self._to_decoder(call, decision, migratable, "fallback")
        self.prefill_policy.on_routed(call.routing, route.prefill.worker)
        report = answer.report
        if report.ok:
            decision = replace(decision, uncached_tokens=0)  # D loads the prompt's KV: nothing to prefill there
        else:
            decoder.kv_transfer_addr = None  # it may have moved (a restart); ask again next time
            logger.warning("KV transfer %s failed (%s); decode recomputes", transfer_id, report.reason)
        self.metrics.observe_transfer(report)
        self.metrics.pd_path("disaggregated")
        is_chat = call.path.endswith("/chat/completions")
        first_token = report.first_token_id
        if not (decoder.forces_first_token and first_token is not None and sends_first_token(is_chat, call, p_body)):
            # D samples the first token itself, on the loaded KV, and answers or streams the whole answer
            params = self._signed(KVTransferParams(transfer_id).as_api())
            decode_call = _with_body(call, call.body | {"kv_transfer_params": params})
            if migratable:
                forwarder.track(decode_call)
            return await forwarder.forward(decode_call, self.decode_pool, decision)
        params = self._signed(KVTransferParams(transfer_id, first_token_id=first_token, skip_first_token=True).as_api())
        decode_call = _with_body(call, call.body | {"kv_transfer_params": params})
        decode_call.observe_ttft = False  # the stream's first token came from prefill
        first_text = answer_text(is_chat, p_body)
        logprobs = ((p_body.get("choices") or [{}])[0]).get("logprobs")  # when the client asked for them
        first_chunk = _first_chunk(is_chat, p_body, first_text, logprobs)
        if migratable:  # D's stream carries the first token's id, and the client has its text (and logprobs)
            forwarder.track(decode_call, sent_text=first_text, sent_logprobs=num_logprobs(is_chat, logprobs))
        self.metrics.ttft_s.observe(time.perf_counter() - call.start_s)
        relay = self._stream_after_first(first_chunk, decode_call, decision)
        return StreamingResponse(relay, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _to_decoder(self, call: Call, decision: Decision, migratable: bool, path: str) -> Response:
        """``call`` as it is to D, as to a colocated worker, counted under ``path`` (direct or fallback)."""
        self.metrics.pd_path(path)
        if migratable:
            self.forwarder.track(call)
        return await self.forwarder.forward(call, self.decode_pool, decision)

    def _route(self, call: Call, decoders: list[Worker]) -> _Route:
        """Pick D among ``decoders``, decide whether P prefills (step 2 above), and log the decision."""
        with tracing.span("route") as span:
            route = self._decide(call, decoders)
            tracing.set_attributes(span, {
                "splitserve.worker": route.decode.worker.url, "splitserve.disaggregated": route.prefill is not None,
                "splitserve.prefill_worker": route.prefill.worker.url if route.prefill is not None else None,
                "splitserve.matched_tokens": route.decode.matched_tokens,
                "splitserve.uncached_tokens": route.decode.uncached_tokens,
            })  # fmt: skip
        return route

    def _decide(self, call: Call, decoders: list[Worker]) -> _Route:
        estimated = self._estimated_tokens(call)
        decode = self.forwarder.policy.select(call.routing, decoders)
        decode = replace(decode, uncached_tokens=max(0, estimated - decode.matched_tokens))  # counted queued on D
        prefillers = [w for w in self.prefill_pool() if w.is_routable]
        prefill: Decision | None = None
        costs: PDCosts | None = None
        colocated = kept_colocated(call.body)
        if colocated is not None and decode.uncached_tokens >= self.threshold and prefillers:
            logger.info("Conditional routing: not disaggregated, %s", colocated)
        elif decode.uncached_tokens >= self.threshold and prefillers:
            prefill = self.prefill_policy.select(call.routing, prefillers)
            prefill = replace(prefill, uncached_tokens=max(0, estimated - prefill.matched_tokens))
        if prefill is not None and self.decision == PDDecision.COST:
            costs = pd_costs(
                self.cost, (decode.worker, decode.uncached_tokens), (prefill.worker, prefill.uncached_tokens), estimated
            )
            prefill = prefill if costs.is_remote_cheaper else None
        self._log_route(estimated, decode, prefill is not None, costs)
        return _Route(decode, prefill)

    def _log_route(self, estimated: int, decode: Decision, disaggregate: bool, costs: PDCosts | None) -> None:
        priced = (
            f", remote_ms={costs.remote_s * 1e3:.1f}, local_ms={costs.local_s * 1e3:.1f}, "
            f"harm_ms={costs.harm_s * 1e3:.1f} ({decode.worker.in_flight} in flight on the decode worker)"
            if costs is not None
            else ""
        )
        held = f" (decode worker {decode.worker.name} holds {decode.matched_tokens})" if decode.matched_tokens else ""
        logger.info(
            "Conditional routing: estimated_tokens=%d, threshold=%d, disaggregate=%s%s%s",
            estimated, self.threshold, disaggregate, priced, held,
        )  # fmt: skip

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

    async def _prefill(self, prefill: Decision, call: Call, transfer_id: str, addr: str) -> _PrefillAnswer | None:
        """P's answer to the prefill request, or None when P could not be reached. P's uncached tokens count as
        queued there until it answers; its answer teaches the cost model (:meth:`_learn`)."""
        worker = prefill.worker
        body = {k: v for k, v in call.body.items() if k not in PREFILL_DROPPED_FIELDS}
        if not call.is_stream or several_sequences(call.body):  # its first token never reaches the client
            body = {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs")}
        params = self._signed(KVTransferParams(transfer_id, decode_kv_addr=addr).as_api())
        body |= {"max_tokens": 1, "stream": False, "kv_transfer_params": params}
        if isinstance(call.body.get("min_tokens"), int) and call.body["min_tokens"] >= 1:
            body["min_tokens"] = 1  # no EOS as the first token, which D would be made to take
        lease = worker.lease(prefill.uncached_tokens)
        queued = QueuedPrefill(lease)
        attributes = {"splitserve.worker": worker.url, "splitserve.transfer_id": transfer_id,
                      "splitserve.uncached_tokens": prefill.uncached_tokens}  # fmt: skip
        try:
            with tracing.span("prefill", attributes, client=True) as span:
                upstream = await self.forwarder.transport.post(worker.url + call.path, json.dumps(body).encode(),
                                                               tracing.inject(call.headers))  # fmt: skip
                content = await upstream.read()
                answer = _PrefillAnswer(
                    upstream.status, content, _json_object(content) if upstream.status == 200 else None
                )
                report = answer.report
                tracing.set_attributes(span, {
                    "http.response.status_code": upstream.status,
                    "splitserve.kv_transfer.ok": report.ok,
                    "splitserve.kv_transfer.tokens": report.num_tokens,
                    "splitserve.kv_transfer.bytes": report.num_bytes,
                    "splitserve.kv_transfer.ms": report.transfer_ms,
                    "splitserve.kv_transfer.reason": report.reason or None,
                })  # fmt: skip
            self._learn(queued, answer.report)
        except TransportError as exc:
            worker.breaker.record_failure()
            logger.warning("prefill worker %s failed: %s", worker.name, exc)
            return None
        finally:
            queued.release()
            lease.release()
        self.metrics.prefill_s.observe(time.perf_counter() - queued.sent_s)
        if upstream.status >= 500:
            worker.breaker.record_failure()
        else:
            worker.breaker.record_success()
        return answer

    def _learn(self, queued: QueuedPrefill, report: KVTransferReport) -> None:
        """From P's report: the push's seconds per token (a successful one), and P's seconds per prefill token
        (its answer's time less the push it waited for). A report without the push's time teaches nothing."""
        if report.transfer_ms is None:
            return
        if report.ok:
            self.cost.observe_transfer(report.transfer_ms / 1000, report.num_tokens)
        queued.answered(self.cost, not_prefill_s=report.transfer_ms / 1000)

    async def _kv_addr(self, worker: Worker) -> str | None:
        """D's KV receiver address (cached): what its ``GET /kv/transfer`` names (a splitserve worker's), else a
        vLLM worker's at ``--vllm-kv-transfer-port``; None if it has none."""
        if worker.kv_transfer_addr is None:
            vllm_port = self.config.vllm_kv_transfer_port
            info = None if self.config.backend_kind == BackendKind.VLLM else await self.forwarder.get_json(
                f"{worker.url}/kv/transfer"
            )  # fmt: skip
            worker.kv_transfer_addr = info.get("addr") if isinstance(info, dict) else None
            if worker.kv_transfer_addr is None and vllm_port is not None:
                worker.kv_transfer_addr, worker.forces_first_token = vllm_receiver(worker.url, vllm_port), False
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


def vllm_receiver(worker_url: str, port: str) -> str:
    """``host:port`` of a vLLM worker's KV receiver: ``port`` (or ``+N``, from its HTTP port) at its host."""
    host, http_port = host_and_port(worker_url)
    return f"{host}:{port_of(port, http_port)}"


def kept_colocated(body: dict[str, Any]) -> str | None:
    """Why a request is not disaggregated whatever its length (None: it may be)."""
    if body.get("prompt_logprobs") is not None or (body.get("echo") and body.get("logprobs") is not None):
        return "the prompt's logprobs are asked for: the prompt is computed where the answer is"
    return None


def several_sequences(body: dict[str, Any]) -> str:
    """``n=N`` or ``best_of=N`` for a request of several sequences, else ""."""
    return next((f"{k}={body[k]}" for k in ("n", "best_of") if isinstance(body.get(k), int) and body[k] > 1), "")


def sends_first_token(is_chat: bool, call: Call, prefill_answer: dict[str, Any]) -> bool:
    """Whether a disaggregated answer's first token goes to the client from P's answer, at once: a stream of one
    sequence whose first token is plain text. Otherwise D samples the first token itself and sends everything:
    with ``n`` or ``best_of`` above 1 (each sequence draws its own), tools (calls are read from the whole
    output), or when P read its token as reasoning or a call (a chat message without content, or with
    ``reasoning_content``: a ``--reasoning-parser``)."""
    body = call.body
    if not call.is_stream or several_sequences(body):
        return False
    if not is_chat:
        return True
    if body.get("tools") and body.get("tool_choice") != "none":
        return False
    message = ((prefill_answer.get("choices") or [{}])[0]).get("message")
    return isinstance(message, dict) and message.get("content") is not None and "reasoning_content" not in message


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


def _first_chunk(is_chat: bool, prefill_answer: dict[str, Any], text: str, logprobs: Any) -> bytes:
    """An SSE chunk carrying the first token's ``text`` from P's answer, in the API's format, with its
    ``logprobs`` (P's answer's: a whole answer's are a chunk's, for one token)."""
    common = {"id": prefill_answer.get("id", ""), "created": prefill_answer.get("created", int(time.time())),
              "model": prefill_answer.get("model", "")}  # fmt: skip
    chunk = text_chunk(is_chat, common, text, role=True)
    if logprobs is not None:
        chunk["choices"][0]["logprobs"] = logprobs
    return sse_event(chunk)

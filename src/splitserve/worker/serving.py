"""OpenAI request -> engine input, and engine outputs -> OpenAI responses (whole or as SSE chunks).

Every client mistake becomes an :class:`ApiError` carrying its HTTP status and OpenAI error body; the app turns
it into a response. Tokenization (and the chat template) runs on one dedicated thread, so long prompts never
block the event loop and the tokenizer is never used by two threads of ours at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from splitserve.auth import verified
from splitserve.engine.async_engine import (
    AsyncEngine,
    EngineCore,
    EngineDeadError,
    EngineNotReadyError,
    QueueFullError,
    RequestStream,
)
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.sampling_params import SamplingParams
from splitserve.errors import SplitserveError
from splitserve.model.tokenizer import TokenizerLike
from splitserve.protocol import openai
from splitserve.protocol.errors import error_body, error_type
from splitserve.protocol.kv_transfer import KVTransferParams, KVTransferReport
from splitserve.worker.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    KVLookupRequest,
    KVLookupResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    now_s,
    random_id,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's legacy default for /v1/completions


class ApiError(SplitserveError):
    """A request that cannot be served; ``status`` and ``body()`` form the HTTP answer."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or error_type(status)
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, code=self.code, param=self.param, type_=self.type)


@dataclass(frozen=True, slots=True)
class EngineInput:
    """What one OpenAI request becomes: the engine's id, prompt and sampling parameters."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    return_token_ids: bool = False  # vLLM's option: token ids beside the text


class OpenAIServing:
    """Turns validated OpenAI requests into engine calls and engine outputs into OpenAI responses."""

    def __init__(
        self,
        engine: AsyncEngine,
        max_tokens_limit: int | None = None,
        draining: threading.Event | None = None,
        cluster_secret: str | None = None,
    ) -> None:
        self.engine = engine
        self.max_tokens_limit = max_tokens_limit
        self.draining = draining or threading.Event()
        self.cluster_secret = cluster_secret  # with it, kv_transfer_params must be signed by the router
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")

    def close(self) -> None:
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    # ---- model and readiness ---------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self._ready_engine().model_name

    def _ready_engine(self) -> EngineCore:
        try:
            return self.engine.engine
        except EngineNotReadyError as exc:
            raise ApiError(503, "the model is still loading; retry shortly", code="model_loading") from exc
        except EngineDeadError as exc:
            raise ApiError(503, f"the engine is not running: {exc}", code="engine_dead") from exc

    def models(self) -> ModelList:
        engine = self._ready_engine()
        card = ModelCard(id=engine.model_name, root=engine.model_name, max_model_len=engine.max_model_len)
        return ModelList(data=[card])

    def check_model(self, requested: str | None) -> None:
        """404 ``model_not_found`` unless ``requested`` is None or the served name."""
        served = self.model_name
        if requested is not None and requested != served:
            raise ApiError(404, f"The model `{requested}` does not exist.", "model", code="model_not_found")

    # ---- request -> engine input -----------------------------------------------------------------------

    async def completion_input(
        self, request: CompletionRequest, resumed_prompt_tokens: int | None = None
    ) -> EngineInput:
        """``resumed_prompt_tokens``: the router resumes a stream here, and the original prompt was this long
        (what the exactness check replays from); ignored unless it leaves generated tokens in the prompt."""
        self._check_common(request)
        prompt_ids = await self._completion_prompt_ids(request.prompt)
        max_tokens = self._resolve_max_tokens(
            request.max_tokens, len(prompt_ids), DEFAULT_COMPLETION_MAX_TOKENS, "prompt"
        )
        params = _sampling_params(request, max_tokens)
        if resumed_prompt_tokens is not None and 0 < resumed_prompt_tokens < len(prompt_ids):
            params = dataclasses.replace(params, resumed_prompt_tokens=resumed_prompt_tokens)
        return EngineInput(random_id("cmpl"), prompt_ids, params, bool(request.return_token_ids))

    async def chat_input(self, request: ChatCompletionRequest) -> EngineInput:
        self._check_common(request)
        prompt_ids = await self._chat_prompt_ids(
            request.message_dicts(), request.add_generation_prompt, request.template_tools()
        )
        if not prompt_ids:
            raise ApiError(400, "the messages produced an empty prompt", "messages")
        max_tokens = self._resolve_max_tokens(request.requested_max_tokens(), len(prompt_ids), None, "messages")
        params = _sampling_params(request, max_tokens)
        return EngineInput(random_id("chatcmpl"), prompt_ids, params, bool(request.return_token_ids))

    def kv_transfer_info(self) -> dict[str, Any]:
        """Decode role: the KV receiver's address and PD buffer; a 404 on other roles."""
        info = self._ready_engine().kv_transfer_info()
        if info is None:
            raise ApiError(404, "this worker has no KV receiver (only --role decode has one)", code="not_found")
        return info

    async def kv_lookup(self, request: KVLookupRequest) -> KVLookupResponse:
        """Tokens of the request's prompt held per source (engine prefix cache, L1, L2); reads only."""
        self.check_model(request.model)
        given = [name for name in ("prompt", "token_ids", "messages") if getattr(request, name) is not None]
        if len(given) != 1:
            raise ApiError(400, "give exactly one of 'prompt', 'token_ids' or 'messages'", given[1] if given else None)
        if request.messages is not None:
            ids = await self._chat_prompt_ids(request.message_dicts(), request.add_generation_prompt)
        elif request.prompt is not None:
            ids = await self._completion_prompt_ids(request.prompt)
        else:
            ids = list(request.token_ids or [])
        engine = self._ready_engine()
        if not ids or not all(0 <= t < engine.vocab_size for t in ids):
            raise ApiError(400, "the prompt must be a non-empty list of valid token ids", given[0])
        matched = await asyncio.to_thread(engine.lookup_prefix, ids, request.cache_salt)
        return KVLookupResponse(num_tokens=len(ids), num_matched_tokens=sum(matched.values()), matched_tokens=matched)

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """The prompt's (or the chat template's) token ids, as a completion of it would see them."""
        self.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise ApiError(400, "give exactly one of 'prompt' or 'messages'", "prompt")
        if request.messages is not None:
            ids = await self._chat_prompt_ids(request.message_dicts(), request.add_generation_prompt, request.tools)
        elif request.tools:
            raise ApiError(400, "'tools' go with 'messages'", "tools")
        else:
            ids = await self._off_loop(self._tokenizer().encode, request.prompt) if request.prompt else []
        strs = await self._off_loop(self._tokenizer().convert_ids_to_tokens, ids) if request.return_token_strs else None
        max_model_len = self._ready_engine().max_model_len
        return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        tokenizer, vocab_size = self._tokenizer(), self._ready_engine().vocab_size
        if not all(0 <= t < vocab_size for t in request.tokens):
            raise ApiError(400, f"token ids must be in [0, {vocab_size})", "tokens")
        return DetokenizeResponse(prompt=await self._off_loop(tokenizer.decode, request.tokens))

    def _check_common(self, request: CompletionRequest | ChatCompletionRequest) -> None:
        self.check_model(request.model)
        params = request.kv_transfer_params
        if params is not None and self.cluster_secret is not None and not verified(self.cluster_secret, params):
            raise ApiError(
                400, "kv_transfer_params are taken from the router only, signed with the cluster secret",
                "kv_transfer_params",
            )  # fmt: skip
        reason = request.unsupported_reason()
        if reason is not None:
            param, message = reason
            raise ApiError(400, message, param)

    async def _chat_prompt_ids(
        self, messages: list[dict[str, Any]], add_prompt: bool, tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The chat template's token ids (on the tokenizer thread); a 400 for messages it cannot render."""
        tokenizer = self._tokenizer()
        try:
            ids: list[int] = await self._off_loop(tokenizer.apply_chat_template, messages, add_prompt, tools)
        except ValueError as exc:
            param = "tools" if str(exc).startswith("tools:") else "messages"
            raise ApiError(400, f"invalid {param}: {exc}", param) from exc
        return ids

    async def _completion_prompt_ids(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "the prompt is empty", "prompt")
            return await self._off_loop(self._tokenizer().encode, prompt)
        if not prompt:
            raise ApiError(400, "the prompt is empty", "prompt")
        return [int(t) for t in prompt]  # type: ignore[arg-type]  # list[int] after the unwrapping above

    def _tokenizer(self) -> TokenizerLike:
        tokenizer = self._ready_engine().tokenizer
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", "prompt")
        return tokenizer

    async def _off_loop(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    def _resolve_max_tokens(self, requested: int | None, num_prompt: int, default: int | None, what: str) -> int:
        """The output budget: ``requested``, or ``default`` capped to the context left, or all of it."""
        max_model_len = self._ready_engine().max_model_len
        if num_prompt >= max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your request has "
                f"{num_prompt} input tokens. Please reduce the length of the input {what}.",
                what,
            )
        remaining = max_model_len - num_prompt
        if requested is None:  # the request's own default, within --max-tokens-limit and the context left
            limits = [n for n in (default, self.max_tokens_limit) if n is not None]
            return min([remaining, *limits])
        if requested < 1:
            raise ApiError(400, f"max_tokens must be at least 1, got {requested}", "max_tokens")
        if self.max_tokens_limit is not None and requested > self.max_tokens_limit:
            raise ApiError(400, f"max_tokens must be at most {self.max_tokens_limit}, got {requested}", "max_tokens")
        if requested > remaining:
            raise ApiError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{num_prompt + requested} tokens ({num_prompt} in the {what}, {requested} in the completion). "
                f"Please reduce the length of the {what} or completion.",
                "max_tokens",
            )
        return requested

    async def submit(self, engine_input: EngineInput) -> RequestStream:
        """Hand the request to the engine; its ``ValueError`` is the client's mistake (400)."""
        if self.draining.is_set():
            raise ApiError(503, "the worker is draining: send the request to another worker", code="draining")
        try:
            return await self.engine.submit(engine_input.prompt_token_ids, engine_input.params, engine_input.request_id)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc
        except QueueFullError as exc:
            raise ApiError(429, f"the worker is full: {exc}; retry shortly", code="queue_full",
                           headers={"Retry-After": "1"}) from exc  # fmt: skip
        except (EngineNotReadyError, EngineDeadError):
            self._ready_engine()  # raises the matching 503
            raise

    # ---- engine outputs -> responses ------------------------------------------------------------------

    async def complete(self, engine_input: EngineInput, stream: RequestStream) -> openai.Completion:
        text, token_ids, last = await _collect(stream)
        ids = engine_input.return_token_ids
        prompt_ids, output_ids = (engine_input.prompt_token_ids, token_ids) if ids else (None, None)
        choice = openai.completion_choice(
            text, _reason(last), last.stop_reason, prompt_token_ids=prompt_ids, token_ids=output_ids
        )
        transfer = await _transfer_report(last, token_ids[0] if token_ids else None)
        return openai.completion(engine_input.request_id, now_s(), self.model_name, [choice], _usage(last), transfer)

    async def chat(self, engine_input: EngineInput, stream: RequestStream) -> openai.ChatCompletion:
        text, token_ids, last = await _collect(stream)
        ids = engine_input.return_token_ids
        choice = openai.chat_choice(text, _reason(last), last.stop_reason, token_ids if ids else None)
        transfer = await _transfer_report(last, token_ids[0] if token_ids else None)
        prompt_ids = engine_input.prompt_token_ids if ids else None
        return openai.chat_completion(
            engine_input.request_id,
            now_s(),
            self.model_name,
            [choice],
            _usage(last),
            prompt_token_ids=prompt_ids,
            kv_transfer_params=transfer,
        )

    async def stream_completion(
        self, engine_input: EngineInput, stream: RequestStream, include_usage: bool, continuous_usage: bool = False
    ) -> AsyncIterator[bytes]:
        """SSE events: one chunk per piece of text, the finishing chunk, optional usage, ``[DONE]``. With
        ``continuous_usage`` every chunk carries the usage so far."""
        rid, model, created = engine_input.request_id, self.model_name, now_s()
        with_ids = engine_input.return_token_ids  # then every token gets a chunk, with its id
        prompt_ids: list[int] | None = engine_input.prompt_token_ids if with_ids else None

        def chunk(choices: list[openai.CompletionChoice], usage: openai.Usage | None = None) -> bytes:
            return openai.sse_event(openai.completion(rid, created, model, choices, usage))

        async for event in _stream_events(stream, include_usage, _skips_first_text(engine_input)):
            if isinstance(event, dict):
                yield chunk([], event)
            elif isinstance(event, bytes):
                yield event
            elif event.new_text or event.finished or with_ids:
                ids = event.new_token_ids if with_ids else None
                choice = openai.completion_choice(
                    event.new_text, _reason(event), prompt_token_ids=prompt_ids, token_ids=ids
                )
                prompt_ids = None  # the prompt's ids go in the first chunk only
                yield chunk([choice], _usage(event) if continuous_usage else None)

    async def stream_chat(
        self, engine_input: EngineInput, stream: RequestStream, include_usage: bool, continuous_usage: bool = False
    ) -> AsyncIterator[bytes]:
        """SSE events: a role chunk, content chunks, a finishing chunk, optional usage, ``[DONE]``. With
        ``continuous_usage`` every chunk carries the usage so far."""
        rid, model, created = engine_input.request_id, self.model_name, now_s()
        with_ids = engine_input.return_token_ids  # then every token gets a chunk, with its id

        def chunk(choices: list[openai.ChatChunkChoice], usage: openai.Usage | None = None) -> bytes:
            return openai.sse_event(openai.chat_chunk(rid, created, model, choices, usage))

        role = openai.chat_chunk_choice(openai.chat_delta("", role=True))
        first_usage = openai.usage(len(engine_input.prompt_token_ids), 0) if continuous_usage else None
        prompt_ids = engine_input.prompt_token_ids if with_ids else None
        yield openai.sse_event(openai.chat_chunk(rid, created, model, [role], first_usage, prompt_ids))
        async for event in _stream_events(stream, include_usage, _skips_first_text(engine_input)):
            if isinstance(event, dict):
                yield chunk([], event)
            elif isinstance(event, bytes):
                yield event
            else:
                token_ids = event.new_token_ids if with_ids else None
                usage = _usage(event) if continuous_usage else None
                if event.new_text or (with_ids and not event.finished):
                    yield chunk([openai.chat_chunk_choice(openai.chat_delta(event.new_text), None, token_ids)], usage)
                    token_ids = None
                if event.finished:  # its text went in the chunk before: an empty delta
                    yield chunk([openai.chat_chunk_choice({}, _reason(event), token_ids)], usage)


async def _stream_events(
    stream: RequestStream, include_usage: bool, skip_first_text: bool = False
) -> AsyncIterator[RequestOutput | openai.Usage | bytes]:
    """The stream's outputs, then its usage (if asked), then ``[DONE]``; an engine failure becomes an SSE
    error event. The request is aborted if the consumer stops early (client disconnect). With
    ``skip_first_text`` the first token's text is left out (a router already sent it)."""
    try:
        last: RequestOutput | None = None
        async for output in stream:
            if last is None and skip_first_text:
                output.new_text = ""
            last = output
            yield output
        if include_usage and last is not None:
            yield _usage(last)
    except EngineDeadError as exc:
        body = ApiError(503, f"the engine stopped: {exc}", code="engine_dead").body()
        yield f"data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()
    finally:
        stream.close()
    yield b"data: [DONE]\n\n"


async def _collect(stream: RequestStream) -> tuple[str, list[int], RequestOutput]:
    """A request's text and token ids; its last output carries the finish reason and token counts."""
    parts: list[str] = []
    last: RequestOutput | None = None
    token_ids: list[int] = []
    try:
        async for output in stream:
            parts.append(output.new_text)
            token_ids.extend(output.new_token_ids)
            last = output
    except EngineDeadError as exc:
        raise ApiError(503, f"the engine stopped: {exc}", code="engine_dead") from exc
    finally:
        stream.close()
    if last is None:
        raise ApiError(503, "the request ended without output", code="engine_dead")
    return "".join(parts), token_ids, last


TRANSFER_WAIT_S = 60.0


async def _transfer_report(last: RequestOutput, first_token: int | None) -> dict[str, Any] | None:
    """Prefill role: wait for the request's KV push and describe it (with the first token) for the router."""
    future = last.kv_transfer_result
    if future is None:
        return None
    try:
        result = await asyncio.wait_for(asyncio.wrap_future(future), TRANSFER_WAIT_S)
    except Exception as exc:  # the push never raises: this is a stuck (timeout) or broken sender thread
        return KVTransferReport(ok=False, reason=f"{type(exc).__name__}: {exc}", first_token_id=first_token).as_api()
    return result.report(first_token).as_api()


def _skips_first_text(engine_input: EngineInput) -> bool:
    transfer = engine_input.params.kv_transfer
    return transfer is not None and transfer.skip_first_token


def _usage(output: RequestOutput) -> openai.Usage:
    """Token counts so far, with the prompt's cached tokens (prefix cache, L1, L2 and PD-pushed KV)."""
    return openai.usage(output.num_prompt_tokens, output.num_output_tokens, output.num_cached_tokens)


def _reason(output: RequestOutput) -> str | None:
    return None if output.finish_reason is None else output.finish_reason.value


def _sampling_params(request: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> SamplingParams:
    """Build the engine's parameters; their ``ValueError`` (range checks) becomes a 400 naming the field."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=request.top_k or 0,
            seed=request.seed,
            stop=request.stop_strings(),
            stop_token_ids=tuple(request.stop_token_ids or ()),
            min_tokens=request.min_tokens,
            ignore_eos=request.ignore_eos,
            include_stop_str_in_output=request.include_stop_str_in_output,
            kv_transfer=KVTransferParams.from_api(request.kv_transfer_params) if request.kv_transfer_params else None,
            cache_salt=request.cache_salt,
        )
    except ValueError as exc:
        message = str(exc)
        raise ApiError(400, message, message.split(" ", 1)[0]) from exc

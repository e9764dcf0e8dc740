"""OpenAI request -> engine input, and engine outputs -> OpenAI responses (whole or as SSE chunks).

Every client mistake becomes an :class:`ApiError` carrying its HTTP status and OpenAI error body; the app turns
it into a response. Tokenization (and the chat template) runs on one dedicated thread, so long prompts never
block the event loop and the tokenizer is never used by two threads of ours at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from splitserve import tracing
from splitserve.auth import verified
from splitserve.engine.async_engine import (
    AsyncEngine,
    EngineCore,
    EngineDeadError,
    EngineNotReadyError,
    QueueFullError,
    RequestStream,
)
from splitserve.engine.detokenizer import Decoder, IncrementalDetokenizer
from splitserve.engine.outputs import RequestOutput, TokenLogprobs
from splitserve.engine.sampling_params import SamplingParams, StructuredOutput
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
    ResumeFrom,
    TokenizeRequest,
    TokenizeResponse,
    now_s,
    random_id,
)
from splitserve.worker.reasoning import ReasoningSplitter
from splitserve.worker.tools import ToolCall, ToolPlan, ToolStream, plan_tools

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
    """What one OpenAI request becomes: the engine's id, prompt and sampling parameters, and how many
    sequences it generates (``best_of``) and answers with (``n``)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    return_token_ids: bool = False  # vLLM's option: token ids beside the text
    n: int = 1
    best_of: int = 1  # at least n: the n sequences with the highest cumulative logprob are the answer
    logprobs: bool = False  # the answer carries each token's logprobs (and params.logprobs most likely ones)
    echo: str | None = None  # completions' echo: the prompt's text, which the answer's text starts with
    tools: ToolPlan | None = None  # chat: how the answer becomes tool calls
    reasoning: str | None = None  # chat: the --reasoning-parser that splits reasoning_content off
    resumed_text: str = ""  # a resumed chat stream: the text the client has, which its readers take first

    def sequences(self) -> list[tuple[str, SamplingParams]]:
        """The engine request of each sequence: its id and parameters. With a seed, sequence i draws from
        seed + i (as vLLM's), so each is reproducible and they differ."""
        if self.best_of == 1:
            return [(self.request_id, self.params)]
        seed = self.params.seed
        return [
            (f"{self.request_id}-{i}", self.params if seed is None else dataclasses.replace(self.params, seed=seed + i))
            for i in range(self.best_of)
        ]


class Choices:
    """The engine streams of one request's sequences; ``merged()`` yields ``(index, output)`` as they come.
    ``close()`` aborts every sequence still running."""

    def __init__(self, streams: list[RequestStream]) -> None:
        self.streams = streams

    def close(self) -> None:
        for stream in self.streams:
            stream.close()

    async def merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        if len(self.streams) == 1:
            async for output in self.streams[0]:
                yield 0, output
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for output in stream:
                    queue.put_nowait((index, output))
            except Exception as exc:  # the engine died: the consumer raises it
                queue.put_nowait((index, exc))
            queue.put_nowait((index, None))

        tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(self.streams)]
        try:
            running = len(tasks)
            while running:
                index, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()


class OpenAIServing:
    """Turns validated OpenAI requests into engine calls and engine outputs into OpenAI responses."""

    def __init__(
        self,
        engine: AsyncEngine,
        max_tokens_limit: int | None = None,
        draining: threading.Event | None = None,
        cluster_secret: str | None = None,
        max_logprobs: int = 20,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        self.engine = engine
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.max_tokens_limit = max_tokens_limit
        self.max_logprobs = max_logprobs  # -1: up to the vocabulary
        self._token_texts: dict[int, str] = {}  # token id -> its text, for logprobs (tokenizer thread only)
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
        top = self._check_logprobs("logprobs", request.logprobs)
        echo = bool(request.echo)
        prompt_top = top if echo and top is not None else request.prompt_logprobs
        prompt_top = self._check_logprobs("prompt_logprobs", prompt_top)
        params = _sampling_params(request, max_tokens, top, prompt_top, self._ready_engine().vocab_size)
        params = dataclasses.replace(params, structured=await self._structured(request))
        if resumed_prompt_tokens is not None and 0 < resumed_prompt_tokens < len(prompt_ids):
            params = dataclasses.replace(params, resumed_prompt_tokens=resumed_prompt_tokens)
        n, best_of = self._check_choices(request, request.best_of, len(prompt_ids), max_tokens)
        if best_of > n and params.logprobs is None:
            params = dataclasses.replace(params, logprobs=0)  # to rank the sequences
        echo_text = (await self._completion_prompt_text(request.prompt, prompt_ids)) if echo else None
        return EngineInput(
            random_id("cmpl"), prompt_ids, params, bool(request.return_token_ids), n, best_of, top is not None,
            echo_text,
        )  # fmt: skip

    async def chat_input(self, request: ChatCompletionRequest) -> EngineInput:
        """A resumed stream (``resume_from``) takes its prompt from there, and its readers and detokenizer replay
        the output the client has."""
        self._check_common(request)
        resume = request.resume_from
        if resume is not None:
            if not request.stream or (request.n or 1) != 1:
                raise ApiError(400, "resume_from goes on with one streamed choice", "resume_from")
            prompt_ids = resume.prompt_token_ids + resume.output_token_ids
        else:
            prompt_ids = await self._chat_prompt_ids(
                request.message_dicts(), request.add_generation_prompt, request.template_tools()
            )
        if not prompt_ids:
            raise ApiError(400, "the messages produced an empty prompt", "messages")
        max_tokens = self._resolve_max_tokens(request.requested_max_tokens(), len(prompt_ids), None, "messages")
        if request.top_logprobs is not None and not request.logprobs:
            raise ApiError(400, "when using `top_logprobs`, `logprobs` must be set to true", "top_logprobs")
        top = self._check_logprobs("top_logprobs", (request.top_logprobs or 0) if request.logprobs else None)
        prompt_top = self._check_logprobs("prompt_logprobs", request.prompt_logprobs)
        params = _sampling_params(request, max_tokens, top, prompt_top, self._ready_engine().vocab_size)
        structured = await self._structured(request)
        tools, tool_grammar = self._tool_plan(request)
        if tool_grammar is not None:
            if structured is not None:
                raise ApiError(400, "a required or named tool_choice and an output constraint cannot both be given",
                               "tool_choice")  # fmt: skip
            await self._off_loop(self._ready_engine().check_structured, tool_grammar)
            structured = tool_grammar
        params = dataclasses.replace(params, structured=structured)
        resumed_text = ""
        if resume is not None:
            params = dataclasses.replace(params, resumed_prompt_tokens=len(resume.prompt_token_ids), replay_output=True)
            resumed_text = await self._off_loop(self._emitted_text, params, resume)
        n, best_of = self._check_choices(request, None, len(prompt_ids), max_tokens)
        return EngineInput(
            random_id("chatcmpl"), prompt_ids, params, bool(request.return_token_ids), n, best_of, top is not None,
            tools=tools, reasoning=self.reasoning_parser, resumed_text=resumed_text,
        )  # fmt: skip

    def _emitted_text(self, params: SamplingParams, resume: ResumeFrom) -> str:
        """The text the original stream handed out for a resumed stream's output so far (as its worker's
        detokenizer did: the engine's replays the same)."""
        detok = IncrementalDetokenizer.replayed(
            self._tokenizer(), params.stop, params.include_stop_str_in_output, resume.prompt_token_ids,
            resume.output_token_ids,
        )  # fmt: skip
        return detok.emitted_text

    def _tool_plan(self, request: ChatCompletionRequest) -> tuple[ToolPlan | None, StructuredOutput | None]:
        """How the answer becomes tool calls, and the grammar a required or named tool_choice needs."""
        template = getattr(self._tokenizer(), "chat_template", None)
        try:
            return plan_tools(
                request.tools, request.tool_choice, request.parallel_tool_calls, self.tool_call_parser, template
            )
        except ValueError as exc:
            message = str(exc)
            param, _, detail = message.partition(": ")
            raise ApiError(400, detail or message, param if detail else "tools") from exc

    def _check_logprobs(self, param: str, value: int | None) -> int | None:
        """A logprobs count within --max-logprobs (and the vocabulary), else a 400 naming ``param``."""
        if value is None:
            return None
        vocab_size = self._ready_engine().vocab_size
        limit = vocab_size if self.max_logprobs == -1 else min(self.max_logprobs, vocab_size)
        if not 0 <= value <= limit:
            raise ApiError(400, f"{param} must be in [0, {limit}] (--max-logprobs), got {value}", param)
        return value

    def _check_choices(
        self, request: CompletionRequest | ChatCompletionRequest, best_of: int | None, num_prompt: int, max_tokens: int
    ) -> tuple[int, int]:
        """``(n, best_of)``: at least 1, best_of at least n and not streamed, and as many sequences as the KV
        cache holds beside their shared prompt (else a 400)."""
        n = 1 if request.n is None else request.n
        if n < 1:
            raise ApiError(400, f"n must be at least 1, got {n}", "n")
        sequences = n if best_of is None else best_of
        if sequences < n:
            raise ApiError(400, f"best_of must be at least n ({n}), got {best_of}", "best_of")
        if sequences > n and request.stream:
            raise ApiError(400, "best_of greater than n cannot be streamed", "best_of")
        engine = self._ready_engine()
        needed = num_prompt + sequences * (max_tokens + BLOCK_SLACK_TOKENS)
        if sequences > 1 and needed > engine.kv_capacity_tokens:
            param = "n" if sequences == n else "best_of"
            raise ApiError(
                400, f"{sequences} sequences of up to {max_tokens} tokens after a prompt of {num_prompt} need about "
                f"{needed} tokens of KV cache; this worker holds {engine.kv_capacity_tokens}", param,
            )  # fmt: skip
        return n, sequences

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

    async def _structured(self, request: CompletionRequest | ChatCompletionRequest) -> StructuredOutput | None:
        """The request's constraint on its output, compiled now on the tokenizer thread (the engine then finds
        it compiled); a 400 naming the field when it is malformed or does not compile."""
        try:
            found = request.structured_output()
        except ValueError as exc:
            message = str(exc)
            raise ApiError(400, message, message.split(":", 1)[0]) from exc
        if found is None:
            return None
        param, spec = found
        try:
            await self._off_loop(self._ready_engine().check_structured, spec)
        except ValueError as exc:
            raise ApiError(400, f"{param}: invalid {spec.kind}: {exc}", param) from exc
        return spec

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

    async def _completion_prompt_text(
        self, prompt: str | list[str] | list[int] | list[list[int]], prompt_ids: list[int]
    ) -> str:
        """What echo puts before the output: the prompt as sent, or its token ids' text."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            return prompt[0]
        if isinstance(prompt, str):
            return prompt
        return str(await self._off_loop(self._tokenizer().decode, prompt_ids, False))

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

    async def submit(self, engine_input: EngineInput) -> Choices:
        """Hand the request's sequences to the engine (all or none); its ``ValueError`` is the client's mistake
        (400). The sequences share the prompt: the scheduler computes it once (``Scheduler``)."""
        if self.draining.is_set():
            raise ApiError(503, "the worker is draining: send the request to another worker", code="draining")
        try:
            sequences = engine_input.sequences()
        except ValueError as exc:  # a seed + index past 64 bits
            raise ApiError(400, str(exc), "seed") from exc
        try:
            self.engine.admit(len(sequences))
        except QueueFullError as exc:
            raise ApiError(429, f"the worker is full: {exc}; retry shortly", code="queue_full",
                           headers={"Retry-After": "1"}) from exc  # fmt: skip
        except (EngineNotReadyError, EngineDeadError):
            self._ready_engine()  # raises the matching 503
            raise
        streams: list[RequestStream] = []
        try:
            for request_id, params in sequences:
                streams.append(await self._submit_one(engine_input.prompt_token_ids, params, request_id))
        except BaseException:
            Choices(streams).close()
            raise
        return Choices(streams)

    async def _submit_one(self, prompt: list[int], params: SamplingParams, request_id: str) -> RequestStream:
        try:
            return await self.engine.submit(prompt, params, request_id)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc
        except (EngineNotReadyError, EngineDeadError):
            self._ready_engine()  # raises the matching 503
            raise

    # ---- engine outputs -> responses ------------------------------------------------------------------

    async def complete(self, engine_input: EngineInput, choices: Choices) -> openai.Completion:
        sequences = _best(await _collect_all(choices), engine_input)
        ids = engine_input.return_token_ids
        echo = engine_input.echo
        answers = []
        prompt_ids = engine_input.prompt_token_ids
        for index, seq in enumerate(sequences):
            logprobs = None
            if engine_input.logprobs:
                entries = [*((seq.prompt_logprobs or []) if echo is not None else []), *seq.logprobs]
                logprobs = await self._completion_logprobs(entries, [] if echo is None else prompt_ids)
            answers.append(openai.completion_choice(
                (echo or "") + seq.text, _reason(seq.last), seq.last.stop_reason, index=index, logprobs=logprobs,
                prompt_token_ids=prompt_ids if ids else None, token_ids=seq.token_ids if ids else None,
                prompt_logprobs=await self._prompt_logprobs(engine_input, seq.prompt_logprobs),
            ))  # fmt: skip
        first = sequences[0]
        transfer = await _transfer_report(first.last, first.token_ids[0] if first.token_ids else None)
        usage = _usage_of([seq.last for seq in sequences])
        return openai.completion(engine_input.request_id, now_s(), self.model_name, answers, usage, transfer)

    async def chat(self, engine_input: EngineInput, choices: Choices) -> openai.ChatCompletion:
        sequences = _best(await _collect_all(choices), engine_input)
        ids = engine_input.return_token_ids
        answers = []
        for index, seq in enumerate(sequences):
            logprobs = await self._chat_logprobs(seq.logprobs) if engine_input.logprobs else None
            reasoning: str | None = None
            content: str | None = seq.text
            if engine_input.reasoning is not None:
                reasoning, content = ReasoningSplitter(engine_input.reasoning).split(seq.text)
            reason = _reason(seq.last)
            calls: list[ToolCall] = []
            if engine_input.tools is not None:
                content, calls = engine_input.tools.extract(content or "")
                reason = engine_input.tools.finish_reason(reason, calls)
            if content is None and not calls and engine_input.reasoning is None:
                content = ""
            answers.append(openai.chat_choice(
                content, reason, seq.last.stop_reason, seq.token_ids if ids else None, index=index,
                logprobs=logprobs, tool_calls=[c.as_api() for c in calls],  # type: ignore[misc]
                reasoning=reasoning if engine_input.reasoning is not None else None,
            ))  # fmt: skip
        first = sequences[0]
        transfer = await _transfer_report(first.last, first.token_ids[0] if first.token_ids else None)
        return openai.chat_completion(
            engine_input.request_id,
            now_s(),
            self.model_name,
            answers,
            _usage_of([seq.last for seq in sequences]),
            prompt_token_ids=engine_input.prompt_token_ids if ids else None,
            prompt_logprobs=await self._prompt_logprobs(engine_input, first.prompt_logprobs),
            kv_transfer_params=transfer,
        )

    async def stream_completion(
        self, engine_input: EngineInput, choices: Choices, include_usage: bool, continuous_usage: bool = False
    ) -> AsyncIterator[bytes]:
        """SSE events: one chunk per piece of text (per choice), the finishing chunks, optional usage, ``[DONE]``.
        With ``continuous_usage`` every chunk carries the usage so far."""
        rid, model, created = engine_input.request_id, self.model_name, now_s()
        with_ids = engine_input.return_token_ids  # then every token gets a chunk, with its id
        offsets: dict[int, int] = {}  # each choice's text so far (for text_offset); a choice not in it is new
        echo = engine_input.echo

        def chunk(choices: list[openai.CompletionChoice], usage: openai.Usage | None = None) -> bytes:
            return openai.sse_event(openai.completion(rid, created, model, choices, usage))

        skipped = await self._skipped_chars(engine_input)
        async for event in _stream_events(choices, include_usage, skipped):
            if isinstance(event, dict):
                yield chunk([], event)
            elif isinstance(event, bytes):
                yield event
            else:
                index, output = event
                first = index not in offsets
                if first and skipped is not None:  # the client has the echo and the first token's text
                    offsets[index] = len(echo or "") + skipped
                text = (echo or "") + output.new_text if first and skipped is None else output.new_text
                if not (text or output.finished or with_ids or (engine_input.logprobs and output.new_logprobs)):
                    continue
                logprobs = prompt_logprobs = None
                if engine_input.logprobs:
                    entries = [*((output.prompt_logprobs or []) if first and echo is not None else []),
                               *(output.new_logprobs or [])]  # fmt: skip
                    tokens = engine_input.prompt_token_ids if first and echo is not None else []
                    logprobs = await self._completion_logprobs(entries, tokens, offsets.get(index, 0))
                if first:
                    prompt_logprobs = await self._prompt_logprobs(engine_input, output.prompt_logprobs)
                # text_offset counts the tokens' text, which a stop string's hold-back can send later than them
                offsets[index] = (
                    logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                    if logprobs is not None and logprobs["tokens"]
                    else offsets.get(index, 0) + (0 if engine_input.logprobs else len(text))
                )
                choice = openai.completion_choice(
                    text, _reason(output), index=index, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                    prompt_token_ids=engine_input.prompt_token_ids if with_ids and first else None,  # the first only
                    token_ids=output.new_token_ids if with_ids else None,
                )  # fmt: skip
                yield chunk([choice], _usage(output) if continuous_usage else None)

    async def stream_chat(
        self, engine_input: EngineInput, choices: Choices, include_usage: bool, continuous_usage: bool = False
    ) -> AsyncIterator[bytes]:
        """SSE events: a role chunk per choice, content chunks, finishing chunks, optional usage, ``[DONE]``. With
        ``continuous_usage`` every chunk carries the usage so far."""
        rid, model, created = engine_input.request_id, self.model_name, now_s()
        with_ids = engine_input.return_token_ids  # then every token gets a chunk, with its id

        def chunk(choices: list[openai.ChatChunkChoice], usage: openai.Usage | None = None) -> bytes:
            return openai.sse_event(openai.chat_chunk(rid, created, model, choices, usage))

        first_usage = openai.usage(len(engine_input.prompt_token_ids), 0) if continuous_usage else None
        prompt_ids = engine_input.prompt_token_ids if with_ids else None
        for index in range(engine_input.n):
            role = openai.chat_chunk_choice(openai.chat_delta("", role=True), index=index)
            yield openai.sse_event(openai.chat_chunk(rid, created, model, [role], first_usage, prompt_ids))
        readers: dict[int, _ChatStreamReader] = {}
        skipped = await self._skipped_chars(engine_input)
        async for event in _stream_events(choices, include_usage, skipped):
            if isinstance(event, dict):
                yield chunk([], event)
            elif isinstance(event, bytes):
                yield event
            else:
                index, output = event
                reader = readers.get(index)
                if reader is None:
                    reader = readers[index] = _ChatStreamReader.resumed(engine_input)
                token_ids = output.new_token_ids if with_ids else None
                usage = _usage(output) if continuous_usage else None
                logprobs = (
                    await self._chat_logprobs(output.new_logprobs)
                    if engine_input.logprobs and output.new_logprobs
                    else None
                )
                # one chunk per output, its finish included (as vLLM's): a stream cut between chunks has either
                # all of an output's tokens (their ids, text and calls) or none, which a migration relies on
                delta: openai.ChatDelta = {}
                for part in reader.deltas(output.new_text, output.finished):
                    delta.update(part)  # reasoning, content and calls: distinct keys
                reason = reader.finish_reason(_reason(output)) if output.finished else None
                if delta or output.finished or token_ids is not None or logprobs is not None:
                    delta = delta or ({} if output.finished else openai.chat_delta(""))  # text held back: empty
                    yield chunk([openai.chat_chunk_choice(delta, reason, token_ids, index=index, logprobs=logprobs)],
                                usage)  # fmt: skip

    async def _skipped_chars(self, engine_input: EngineInput) -> int | None:
        """The characters a stream leaves out because its router already sent its first token (the prefill
        worker's, forced here): that token's text (:func:`token_text_after`, on the tokenizer thread). None when
        the router did not send it."""
        transfer = engine_input.params.kv_transfer
        if transfer is None or not transfer.skip_first_token or transfer.first_token_id is None:
            return None
        prompt, token = engine_input.prompt_token_ids, transfer.first_token_id
        return len(await self._off_loop(token_text_after, self._tokenizer(), prompt, token))

    # ---- log-probabilities in OpenAI's shapes ---------------------------------------------------------------

    async def _texts(self, entries: list[TokenLogprobs], extra: tuple[int, ...] = ()) -> dict[int, str]:
        """The text of every token the entries name (and ``extra``), decoded on the tokenizer thread."""
        ids = {*extra, *(e.token_id for e in entries), *(t for e in entries for t, _ in e.top)}
        return dict(await self._off_loop(self._token_texts_of, sorted(ids)))

    def _token_texts_of(self, ids: list[int]) -> list[tuple[int, str]]:
        tokenizer = self._tokenizer()
        for token_id in ids:
            if token_id not in self._token_texts:
                self._token_texts[token_id] = tokenizer.decode([token_id], False)
        return [(token_id, self._token_texts[token_id]) for token_id in ids]

    async def _chat_logprobs(self, entries: list[TokenLogprobs]) -> openai.ChatLogprobs:
        texts = await self._texts(entries)

        def top(token_id: int, logprob: float) -> openai.TopLogprob:
            return {"token": texts[token_id], "logprob": _finite(logprob), "bytes": list(texts[token_id].encode())}

        content: list[openai.ChatTokenLogprob] = [
            {**top(e.token_id, e.logprob), "top_logprobs": [top(t, lp) for t, lp in e.top]} for e in entries
        ]
        return {"content": content}

    async def _completion_logprobs(
        self, entries: list[TokenLogprobs | None], prompt_ids: list[int], offset: int = 0
    ) -> openai.CompletionLogprobs:
        """``entries``: an echoed prompt's (the first None) then the output's; ``prompt_ids``: the echoed prompt."""
        known = [e for e in entries if e is not None]
        texts = await self._texts(known, tuple(prompt_ids[:1]))
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for i, entry in enumerate(entries):
            text = texts[entry.token_id] if entry is not None else texts[prompt_ids[i]]
            offsets.append(offset)
            offset += len(text)
            tokens.append(text)
            if entry is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(_finite(entry.logprob))
            top = {texts[t]: _finite(lp) for t, lp in entry.top}
            top.setdefault(text, _finite(entry.logprob))  # the chosen token always, as OpenAI's legacy shape has it
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    async def _prompt_logprobs(
        self, engine_input: EngineInput, entries: list[TokenLogprobs | None] | None
    ) -> openai.PromptLogprobs | None:
        """vLLM's ``prompt_logprobs``: per prompt token, its own and the most likely tokens' entries by id."""
        if entries is None or (engine_input.echo is not None and engine_input.logprobs):
            return None  # echo with logprobs carries them in the choice's logprobs
        known = [e for e in entries if e is not None]
        texts = await self._texts(known)
        answer: openai.PromptLogprobs = []
        for entry in entries:
            if entry is None:
                answer.append(None)
                continue
            ranked: dict[str, openai.PromptLogprob] = {
                str(entry.token_id): {"logprob": _finite(entry.logprob), "rank": entry.rank,
                                      "decoded_token": texts[entry.token_id]}}  # fmt: skip
            for rank, (token_id, logprob) in enumerate(entry.top, start=1):
                ranked.setdefault(str(token_id), {"logprob": _finite(logprob), "rank": rank,
                                                  "decoded_token": texts[token_id]})  # fmt: skip
            answer.append(ranked)
        return answer


class _ChatStreamReader:
    """One streamed chat choice's text as deltas: the reasoning split off (``--reasoning-parser``), tool calls
    read out (``tools``), the rest as content."""

    def __init__(self, engine_input: EngineInput) -> None:
        self.splitter = ReasoningSplitter(engine_input.reasoning) if engine_input.reasoning is not None else None
        self.tools = ToolStream(engine_input.tools) if engine_input.tools is not None else None
        self.plain = self.splitter is None and self.tools is None

    @classmethod
    def resumed(cls, engine_input: EngineInput) -> _ChatStreamReader:
        """A reader that has taken the text a resumed stream's client has (its deltas were sent before)."""
        reader = cls(engine_input)
        if engine_input.resumed_text:
            reader.deltas(engine_input.resumed_text, finished=False)
        return reader

    def deltas(self, new_text: str, finished: bool) -> list[openai.ChatDelta]:
        if self.plain:
            return [openai.chat_delta(new_text)] if new_text else []
        out: list[openai.ChatDelta] = []
        content = new_text
        if self.splitter is not None:
            reasoning, content = self.splitter.feed(new_text, final=finished)
            if reasoning:
                out.append({"reasoning_content": reasoning})
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if finished:
                rest, more = self.tools.finish()
                content, calls = content + rest, calls + more
            if content:
                out.append(openai.chat_delta(content))
            if calls:
                out.append({"tool_calls": calls})
        elif content:
            out.append(openai.chat_delta(content))
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        if self.tools is None:
            return reason
        return self.tools.plan.finish_reason(reason, self.tools.calls)


BLOCK_SLACK_TOKENS = 16  # a sequence's share of a partly filled KV block, in the n / best_of capacity check


@dataclass(slots=True)
class Sequence:
    """One sequence's whole answer: its text, tokens, logprobs (when asked) and last output."""

    text: str
    token_ids: list[int]
    last: RequestOutput
    logprobs: list[TokenLogprobs]
    prompt_logprobs: list[TokenLogprobs | None] | None

    @property
    def cumulative_logprob(self) -> float:
        return sum(e.logprob for e in self.logprobs)


def _best(sequences: list[Sequence], engine_input: EngineInput) -> list[Sequence]:
    """The n sequences to answer with: all when n == best_of, else the n with the highest cumulative logprob
    (ties: the first generated), in that order."""
    if engine_input.best_of == engine_input.n:
        return sequences
    order = sorted(range(len(sequences)), key=lambda i: (-sequences[i].cumulative_logprob, i))
    return [sequences[i] for i in order[: engine_input.n]]


def _finite(value: float) -> float:
    """JSON has no -inf: a token the model rules out (a -inf logit) reads as the float's lowest value."""
    return value if value > -math.inf else -9999.0


async def _stream_events(
    choices: Choices, include_usage: bool, skip_chars: int | None = None
) -> AsyncIterator[tuple[int, RequestOutput] | openai.Usage | bytes]:
    """The choices' outputs as ``(index, output)``, then the usage (if asked), then ``[DONE]``; an engine failure
    becomes an SSE error event. Every sequence is aborted if the consumer stops early (client disconnect). With
    ``skip_chars`` (a router already sent the first token, from the prefill worker's answer: that many
    characters) the first characters of each choice's text are left out, however the outputs split them (a
    stop string's hold-back can keep part of the first token's text for the next one), and so are its first
    token's logprobs."""
    try:
        last: dict[int, RequestOutput] = {}
        left: dict[int, int] = {}
        async for index, output in choices.merged():
            if skip_chars is not None:
                if index not in last:
                    left[index] = skip_chars
                    output.new_logprobs = output.new_logprobs[1:] if output.new_logprobs else output.new_logprobs
                cut = min(left[index], len(output.new_text))
                output.new_text, left[index] = output.new_text[cut:], left[index] - cut
            last[index] = output
            yield index, output
        if include_usage and last:
            yield _usage_of(list(last.values()))
    except EngineDeadError as exc:
        body = ApiError(503, f"the engine stopped: {exc}", code="engine_dead").body()
        yield f"data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()
    finally:
        choices.close()
    yield b"data: [DONE]\n\n"


async def _collect_all(choices: Choices) -> list[Sequence]:
    """Every sequence's whole answer, in order; all are aborted if this is cancelled (client disconnect)."""
    try:
        return list(await asyncio.gather(*(_collect(stream) for stream in choices.streams)))
    finally:
        choices.close()


async def _collect(stream: RequestStream) -> Sequence:
    """A sequence's text, token ids and logprobs; its last output carries the finish reason and token counts."""
    parts: list[str] = []
    last: RequestOutput | None = None
    token_ids: list[int] = []
    logprobs: list[TokenLogprobs] = []
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    try:
        async for output in stream:
            parts.append(output.new_text)
            token_ids.extend(output.new_token_ids)
            logprobs.extend(output.new_logprobs or ())
            prompt_logprobs = output.prompt_logprobs if output.prompt_logprobs is not None else prompt_logprobs
            last = output
    except EngineDeadError as exc:
        raise ApiError(503, f"the engine stopped: {exc}", code="engine_dead") from exc
    finally:
        stream.close()
    if last is None:
        raise ApiError(503, "the request ended without output", code="engine_dead")
    return Sequence("".join(parts), token_ids, last, logprobs, prompt_logprobs)


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
    report = result.report(first_token)
    if report.transfer_ms is not None:  # the push as a span of this request (tracing on)
        end = time.time_ns()
        tracing.record(tracing.current(), "kv_push", tracing.ago_ns(report.transfer_ms / 1000, end), end, {
            "splitserve.transfer_id": report.transfer_id, "splitserve.kv_transfer.ok": report.ok,
            "splitserve.kv_transfer.tokens": report.num_tokens, "splitserve.kv_transfer.bytes": report.num_bytes,
            "splitserve.kv_transfer.reason": report.reason or None,
        })  # fmt: skip
    return report.as_api()


def token_text_after(tokenizer: Decoder, prompt: list[int], token: int) -> str:
    """The text of ``token`` as the first output after ``prompt``, decoded as the engine decodes it."""
    detokenizer = IncrementalDetokenizer(tokenizer, (), False, prompt)
    detokenizer.update([token])
    return detokenizer.text


def _usage(output: RequestOutput) -> openai.Usage:
    """Token counts so far, with the prompt's cached tokens (prefix cache, L1, L2 and PD-pushed KV)."""
    return openai.usage(output.num_prompt_tokens, output.num_output_tokens, output.num_cached_tokens)


def _usage_of(outputs: list[RequestOutput]) -> openai.Usage:
    """The usage of a request's sequences: the prompt once, every sequence's output (as vLLM counts n)."""
    first = outputs[0]
    return openai.usage(first.num_prompt_tokens, sum(o.num_output_tokens for o in outputs), first.num_cached_tokens)


def _reason(output: RequestOutput) -> str | None:
    return None if output.finish_reason is None else output.finish_reason.value


def _sampling_params(
    request: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    vocab_size: int | None = None,
) -> SamplingParams:
    """Build the engine's parameters; their ``ValueError`` (range checks) becomes a 400 naming the field."""
    bias = _logit_bias(request.logit_bias)
    if vocab_size is not None and any(t >= vocab_size for t, _ in bias):
        raise ApiError(400, f"logit_bias token ids must be below the vocabulary size {vocab_size}", "logit_bias")
    try:
        return SamplingParams(
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
            logit_bias=bias,
            min_p=request.min_p or 0.0,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
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


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token ids as strings) as the engine's pairs; a key that is no id is a 400."""
    pairs = []
    for key, value in (bias or {}).items():
        if not key.strip().isdigit():
            raise ApiError(400, f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))

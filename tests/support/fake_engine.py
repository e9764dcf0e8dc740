"""A deterministic stand-in for ``LLMEngine`` (and its tokenizer) for server and async-engine tests.

The tokenizer maps characters to their code points (1..255); the engine answers every request with the
characters of ``REPLY`` in order, one token per step, until ``max_tokens`` (``length``), a stop token id
(``stop``) or the end of ``REPLY`` (``stop``, like EOS, unless ``ignore_eos``). A resumed request that replays
its output (``replay_output``) first hands out the text of it that the original stream held back, as the
engine's replayed detokenizer does. It records which thread called it, so tests can check that only the engine
thread does.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from splitserve.engine.detokenizer import IncrementalDetokenizer
from splitserve.engine.outputs import FinishReason, RequestOutput, TokenLogprobs
from splitserve.engine.sampling_params import SamplingParams, StructuredOutput
from splitserve.engine.speculative import SpecStats
from splitserve.metrics import CumulativeHistogram, RequestPhases
from splitserve.policy.admission import Backlog
from tests.support.workers import free_port

REPLY = "Paris is the capital of France."
VOCAB_SIZE = 256


class FakeTokenizer:
    eos_token_id = 0
    stop_token_ids: frozenset[int] = frozenset({0})
    vocab_size = VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        return [min(max(ord(c), 1), VOCAB_SIZE - 1) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i > 0 or not skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(i) for i in ids]

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: Any = None
    ) -> list[int]:
        """A template that renders neither tool calls nor tools, so it refuses them (as Tokenizer does)."""
        if tools:
            raise ValueError("tools: this model's chat template does not render tool definitions")
        for index, message in enumerate(messages):
            if message.get("role") not in ("system", "developer", "user", "assistant", "tool"):
                raise ValueError(f"bad role {message.get('role')!r}")
            if "tool_calls" in message:
                raise ValueError(f"messages[{index}].tool_calls: this model's chat template does not render tool calls")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


@dataclass(slots=True)
class FakeStats:
    num_running: int = 0
    num_waiting: int = 0
    num_waiting_deferred: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    cached_tokens_by_source: dict[str, int] = field(default_factory=dict)
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    iteration_tokens: CumulativeHistogram = field(default_factory=lambda: CumulativeHistogram((1.0, 8.0)))
    kv_cache: None = None
    pd_buffer: None = None
    exactness_checks: dict[str, int] = field(default_factory=dict)
    exactness_mismatches: dict[str, int] = field(default_factory=dict)
    spec_decode: SpecStats | None = None
    backlog: Backlog = field(default_factory=Backlog)


@dataclass(slots=True)
class _FakeRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    num_output: int = 0
    num_cached: int = 0
    added_s: float = field(default_factory=time.monotonic)
    first_token_s: float = 0.0
    held_back: str = ""  # replay_output: the resumed output's text the original stream had not handed out


@dataclass
class FakeEngine:
    """Implements the ``EngineCore`` protocol. Knobs: ``step_delay_s``, ``fail_on_step``, ``max_model_len``,
    ``max_num_seqs`` (the requests that run at once, in arrival order; the others wait, their prompts uncomputed)."""

    max_model_len: int = 128
    model_name: str = "fake-model"
    vocab_size: int = VOCAB_SIZE
    kv_capacity_tokens: int = 4096
    step_delay_s: float = 0.0
    fail_on_step: bool = False
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    requests: dict[str, _FakeRequest] = field(default_factory=dict)
    added_ids: list[str] = field(default_factory=list)
    aborted_ids: list[str] = field(default_factory=list)
    num_steps: int = 0
    caller_threads: set[int] = field(default_factory=set)
    num_prompt_tokens: int = 0
    is_closed: bool = False
    seen_prompts: list[list[int]] = field(default_factory=list)
    seen_params: list[SamplingParams] = field(default_factory=list)
    cache_config_info: dict[str, str] = field(default_factory=lambda: {"block_size": "4"})
    max_num_seqs: int | None = None

    def _called(self) -> None:
        self.caller_threads.add(threading.get_ident())

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._called()
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        if any(not 0 <= t < VOCAB_SIZE for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {VOCAB_SIZE})")
        num_cached = self.lookup_prefix(prompt_token_ids)["engine"]
        self.seen_prompts.append(list(prompt_token_ids))
        self.seen_params.append(params)
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt + max_tokens exceeds max_model_len {self.max_model_len}")
        self.requests[request_id] = _FakeRequest(list(prompt_token_ids), params, num_cached=num_cached)
        if params.replay_output and params.resumed_prompt_tokens:
            prompt, output = (
                prompt_token_ids[: params.resumed_prompt_tokens],
                prompt_token_ids[params.resumed_prompt_tokens :],
            )
            include = params.include_stop_str_in_output
            detok = IncrementalDetokenizer.replayed(self.tokenizer, params.stop, include, prompt, output)
            self.requests[request_id].held_back = detok.text[len(detok.emitted_text) :]
        self.added_ids.append(request_id)

    def abort_request(self, request_id: str) -> None:
        self._called()
        if self.requests.pop(request_id, None) is not None:
            self.aborted_ids.append(request_id)

    def has_unfinished_requests(self) -> bool:
        self._called()
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self._called()
        self.num_steps += 1
        if self.fail_on_step:
            raise RuntimeError("injected engine failure")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        running = list(self.requests.items())[: self.max_num_seqs]
        return [self._advance(rid, req) for rid, req in running]

    def _advance(self, request_id: str, req: _FakeRequest) -> RequestOutput:
        token = ord(REPLY[req.num_output]) if req.num_output < len(REPLY) else 0
        req.num_output += 1
        reason: FinishReason | None = None
        stop_reason: int | None = None
        if token in req.params.stop_token_ids:
            reason, stop_reason = FinishReason.STOP, token
        elif token == 0 and not req.params.ignore_eos:
            reason = FinishReason.STOP
        elif req.num_output >= req.params.max_tokens:
            reason = FinishReason.LENGTH
        now = time.monotonic()
        if req.num_output == 1:
            self.num_prompt_tokens += len(req.prompt_token_ids)
            req.first_token_s = now
        if reason is not None:
            del self.requests[request_id]
        text = "" if token == 0 or stop_reason is not None else chr(token)
        text, req.held_back = req.held_back + text, ""
        params = req.params
        prompt_logprobs = None
        if params.prompt_logprobs is not None and req.num_output == 1:
            prompt_logprobs = [None, *(_fake_logprobs(t, params.prompt_logprobs) for t in req.prompt_token_ids[1:])]
        return RequestOutput(
            request_id=request_id,
            new_token_ids=[token],
            new_text=text,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_output_tokens=req.num_output,
            num_cached_tokens=req.num_cached,
            stop_reason=stop_reason,
            cached_tokens_by_source=(("engine", req.num_cached),),
            timing=_phases(req, now) if reason is not None else None,
            new_logprobs=None if params.logprobs is None else [_fake_logprobs(token, params.logprobs)],
            prompt_logprobs=prompt_logprobs,
        )

    def get_stats(self) -> FakeStats:
        self._called()
        requests = list(self.requests.values())
        running = len(requests[: self.max_num_seqs])
        waiting = requests[running:]
        backlog = Backlog(
            num_waiting=len(waiting),
            num_in_flight=len(requests),
            prefill_tokens=sum(len(r.prompt_token_ids) for r in waiting),
            seconds_per_token=None,
            oldest_waiting_since=min((r.added_s for r in waiting), default=None),
        )
        return FakeStats(
            num_running=running,
            num_waiting=len(waiting),
            prefix_cache_queries=self.num_prompt_tokens,
            num_prompt_tokens=self.num_prompt_tokens,
            backlog=backlog,
        )

    def lookup_prefix(self, prompt_token_ids: list[int], cache_salt: str | None = None) -> dict[str, int]:
        """Pretends the 4-token blocks of any earlier prompt this one extends are cached (not the last token)."""
        seen = max((len(ids) for ids in self.seen_prompts if prompt_token_ids[: len(ids)] == ids), default=0)
        return {"engine": min(seen, len(prompt_token_ids) - 1) // 4 * 4, "l1": 0, "l2": 0}

    def check_structured(self, spec: StructuredOutput) -> None:
        """Refuses a spec whose text is the word 'invalid' (the real engine compiles it with llguidance)."""
        if spec.spec == "invalid":
            raise ValueError("invalid is not a schema")

    def kv_transfer_info(self) -> dict[str, Any] | None:
        return None

    def close(self) -> None:
        self._called()
        self.is_closed = True


def _fake_logprobs(token: int, k: int) -> TokenLogprobs:
    """The token at -0.25 (rank 1), then the next ids at -1, -2, ... as its k most likely."""
    top = tuple(((token + i) % VOCAB_SIZE, -0.25 if i == 0 else -float(i)) for i in range(k))
    return TokenLogprobs(token, -0.25, 1, top)


def _phases(req: _FakeRequest, now: float) -> RequestPhases:
    """Admitted at once, a token every step: the time to the first token is prefill, the rest decode."""
    return RequestPhases(0.0, req.first_token_s - req.added_s, now - req.first_token_s, 0)


class ServerThread:
    """A real uvicorn server for ``app`` on a free local port, in a background thread."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(10)

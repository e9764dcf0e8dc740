"""Stream migration: a stream whose worker dies is resumed on another worker, and the client sees one stream.

The router asks the worker for token ids beside the text (``return_token_ids``, vLLM's option, which
splitserve workers support too) and follows the stream event by event (:class:`StreamTracker`): the prompt's
token ids (first chunk), every generated token id, the text sent so far, and whether the answer finished.
Only whole SSE events reach the client, so a worker that dies mid-event never leaves half of one behind.

When the worker fails before the answer finished (the connection breaks, the stream ends without
``[DONE]``, or it sends an error event), :func:`resume_body` makes a ``/v1/completions`` request for
another worker: the prompt's ids plus the generated ids as the prompt, the tokens left of ``max_tokens``,
and the same sampling fields. Its chunks are rewritten into the original stream's format (chat or
completion), id, ``created`` and model, and its usage counts the tokens of the whole answer.

What it guarantees:
- greedy output: the tokens an uninterrupted run gives, provided the model computes the same logits from a
  prefill of those tokens as from their decode (bit for bit with the GGUF's quantized blocks, a worker's
  default: docs/exactness.md); the resumed request names the original prompt's length
  (``RESUMED_PROMPT_TOKENS_HEADER``), so the new worker's exactness check can replay the whole answer;
- seeded sampling on splitserve workers: the same tokens too (a seeded draw depends on the seed and the
  token's position only, see ``engine/sampler.py``); unseeded sampling goes on from a fresh draw;
- text: the same characters. Text a worker held back when it died (a possible stop string) is recovered from
  the new worker's ``/detokenize``; tokens that end in half of a multi-byte character are generated again by
  the new worker, so the character comes out whole. A stop string that straddles the cut is not seen (a chat
  stream resumed as chat, below, sees it);
- the prompt's KV: where the workers share an L2 tier, the new worker loads the prompt's chunks from it and
  computes only the tokens generated since.

Disaggregated streams migrate too (``router/disagg.py``): the tracker follows the decode worker's stream,
whose first chunk carries the prefill worker's first token's id, and counts that token's text as sent.

A constrained output (a JSON schema, regex, choice or grammar) migrates with its constraint: the new worker's
grammar first takes the tokens already sent (``engine/structured.py``), so the output stays valid.

``n`` > 1 migrates per choice: each unfinished choice goes on as its own request on the new worker (choice i of
a seeded request with seed + i, as the worker drew it), their chunks are merged into the one stream under the
choice's index, and the usage at the end counts every choice's tokens.

Logprobs migrate: the resumed request asks for them in the completions shape (``logprobs`` k, the chat
request's ``top_logprobs``), and each chunk's entries are rewritten into the original stream's shape (chat: each
token's ``token``, ``logprob``, ``bytes`` of its text and its k most likely tokens; completions: the
``text_offset`` moved past the text sent before). A token whose entry the client already has (one generated again
because it ended in half a character) is not sent twice. The completions shape names the most likely tokens by
their text, so two of them with the same text (byte-fallback pieces of one character) come back as one.

``echo`` (without logprobs, of a prompt given as text) migrates: the tracker knows the echoed text (the prompt as
sent), keeps it apart from the answer's, and a choice whose echo never reached the client gets it before its
resumed text; the resumed request does not echo.

A chat stream resumed on a splitserve worker goes on as a chat request (:func:`resume_chat_body`): the original
request with the prompt's and the answer's token ids (``resume_from``). That worker replays those tokens through
its detokenizer and its readers before it generates (``worker/serving.py``), so what follows is exactly what the
original stream would have sent: the text it held back (a possible stop string, half a character), the
reasoning split off by a ``--reasoning-parser``, and tool calls, whose deltas go on with the next call's index
(a call half sent goes on with its arguments). Its chunks need only the original stream's id, ``created``, model
and choice index. On a vLLM worker a chat stream goes on as a completion, as above; one with tools cannot (its
calls are not text), and waits for a splitserve worker.

The prompt's logprobs (``prompt_logprobs``, ``echo`` with ``logprobs``) come in each choice's first chunk of a
completion stream: once every unfinished choice had its first chunk, the resumed requests ask only for the
output's logprobs, and their entries' ``text_offset`` goes on past the echo and the text sent. A choice that
had no chunk yet when its worker died would need the prompt's logprobs again: such a stream ends with an error
event, as before. A chat stream carries no prompt logprobs; its resumed request does not ask for them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from splitserve.errors import SplitserveError
from splitserve.protocol import openai
from splitserve.protocol.openai import sse_event, text_chunk

# sampling fields a resumed request carries over unchanged (the rest are the client's, or not per token)
CARRIED_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "include_stop_str_in_output", "skip_special_tokens", "user", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "cache_salt", "response_format", "structured_outputs", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar",
)  # fmt: skip
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's legacy default for /v1/completions
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded before the output to recover held-back text


def is_migratable(path: str, body: dict[str, Any]) -> bool:
    """A streamed request the router can resume elsewhere: no prompt logprobs, an echo only of a prompt given as
    text. ``n`` choices resume each on its own; a schema, regex or grammar resumes: the new worker's grammar takes
    the tokens sent; logprobs resume in the stream's shape; tool calls resume on splitserve workers."""
    if body.get("stream") is not True or not path.endswith(("/v1/completions", "/v1/chat/completions")):
        return False
    n = 1 if body.get("n") is None else body["n"]
    if not isinstance(n, int) or n < 1 or body.get("best_of") not in (None, n):
        return False
    if body.get("echo") and echoed_text(path, body) is None:
        return False  # an echo of token ids: its text is the worker's
    return requested_logprobs(path, body) != INVALID_LOGPROBS


def sends_prompt_logprobs(path: str, body: dict[str, Any]) -> bool:
    """A completion stream whose choices' first chunks carry the prompt's logprobs (``prompt_logprobs``, or
    ``echo`` with ``logprobs``)."""
    if path.endswith("/chat/completions"):
        return False
    return body.get("prompt_logprobs") is not None or bool(
        body.get("echo") and requested_logprobs(path, body) is not None
    )


def calls_tools(path: str, body: dict[str, Any]) -> bool:
    """A chat request whose answer may be tool calls: only a splitserve worker resumes it (a chat request)."""
    return path.endswith("/chat/completions") and bool(body.get("tools")) and body.get("tool_choice") != "none"


def echoed_text(path: str, body: dict[str, Any]) -> str | None:
    """The text a completions request's ``echo`` puts before its answer, where the router knows it: the prompt as
    sent, given as text (a string, or a batch of one); None otherwise (no echo, or token ids, whose text only the
    worker's tokenizer knows)."""
    if not body.get("echo") or path.endswith("/chat/completions"):
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) and prompt else None


INVALID_LOGPROBS = -1


def requested_logprobs(path: str, body: dict[str, Any]) -> int | None:
    """How many most likely tokens each streamed token's logprobs name (None: no logprobs asked for;
    ``INVALID_LOGPROBS``: a value the worker will refuse, so nothing to resume)."""
    if path.endswith("/chat/completions"):
        if body.get("logprobs") is not True:
            return None if body.get("logprobs") in (None, False) else INVALID_LOGPROBS
        top = body.get("top_logprobs")
        return 0 if top is None else top if type(top) is int and top >= 0 else INVALID_LOGPROBS
    value = body.get("logprobs")
    return None if value is None else value if type(value) is int and value >= 0 else INVALID_LOGPROBS


class WorkerStreamFailed(SplitserveError):
    """The worker sent an error event instead of finishing the answer."""


@dataclass
class ChoiceTrack:
    """One choice of a followed stream: what the client got of it, and its resumed request's progress."""

    index: int
    output_ids: list[int] = field(default_factory=list)
    text: str = ""  # the text sent to the client so far
    finished: bool = False  # a finish_reason was seen
    resumed_at: int | None = None  # output tokens before the last resume (None: the first worker's stream)
    resumed_tokens: int | None = None  # completion tokens its resumed request reported (usage), once it did
    num_logprobs: int = 0  # tokens whose logprobs the client got
    next_logprob: int = 0  # resumed: the output position of the resumed request's next logprobs entry
    text_base: int = 0  # resumed: characters the client had before the resumed request's text (text_offset)
    echo_pending: bool = False  # the client has yet to get the echoed prompt's text before this choice's
    started: bool = False  # its first chunk (with the prompt's logprobs, where asked for) reached the client

    @property
    def num_output(self) -> int:
        """Tokens generated for it in all: before the last resume, and by the resumed request (as it reported
        them, else as many as it sent ids for)."""
        if self.resumed_at is None or self.resumed_tokens is None:
            return len(self.output_ids)
        return self.resumed_at + self.resumed_tokens


@dataclass
class StreamTracker:
    """One migratable stream as the client sees it, whichever worker is producing it: ``num_choices`` choices
    (``n``), each resumed by its own ``/v1/completions`` request on the new worker."""

    is_chat: bool
    client_wants_ids: bool  # the client itself asked for return_token_ids: keep them in its chunks
    client_wants_usage: bool
    num_choices: int = 1
    logprobs: int | None = None  # requested_logprobs: each token's most likely tokens (None: no logprobs)
    echo: str | None = None  # echoed_text: what each choice's text starts with, not the answer's (kept apart)
    prompt_ids: list[int] | None = None
    choices: list[ChoiceTrack] = field(default_factory=list)
    done: bool = False  # [DONE] was seen (or, resumed, every choice's)
    id: str | None = None
    created: int | None = None
    model: str | None = None
    num_migrations: int = 0
    cached_tokens: int | None = None  # the first resumed request's cached prompt tokens
    pending: set[int] = field(default_factory=set)  # choices whose resumed request has not sent [DONE] yet
    calls_tools: bool = False  # calls_tools(): only a splitserve worker resumes it
    prompt_logprobs: bool = False  # sends_prompt_logprobs(): each choice's first chunk has the prompt's logprobs
    chat_resume: bool = False  # the current resume is chat requests (``resume_chat_body``), not completions

    def __post_init__(self) -> None:
        self.choices = self.choices or [
            ChoiceTrack(i, echo_pending=self.echo is not None) for i in range(self.num_choices)
        ]

    def answer_text(self, track: ChoiceTrack, text: str) -> str:
        """``text`` of choice ``track`` as the worker sent it, without the echo the choice's first text starts
        with (which the client now has)."""
        if not track.echo_pending or not text:
            return text
        track.echo_pending = False
        assert self.echo is not None
        return text[len(self.echo) :] if text.startswith(self.echo) else text

    @property
    def finished(self) -> bool:
        """Every choice finished."""
        return all(c.finished for c in self.choices)

    @property
    def is_resumed(self) -> bool:
        return self.num_migrations > 0

    @property
    def num_output(self) -> int:
        return sum(c.num_output for c in self.choices)

    # ---- the first worker's stream ------------------------------------------------------------------------

    def on_event(self, data: str, index: int | None = None) -> bytes:
        """One SSE event's data from the current worker (once resumed: from choice ``index``'s request); returns
        the bytes to send the client (maybe none). Raises :class:`WorkerStreamFailed` for an error event before
        the answer finished."""
        if data == "[DONE]":
            if not self.is_resumed:
                self.done = True
                return b"data: [DONE]\n\n"
            self.pending.discard(self._choice(index).index)
            return b"" if self.pending else self.end()
        try:
            chunk = json.loads(data)
        except ValueError as exc:
            raise WorkerStreamFailed(f"an event that is not JSON: {exc}") from exc
        if not isinstance(chunk, dict):
            raise WorkerStreamFailed("an event that is not a JSON object")
        if "error" in chunk:
            if self.finished:
                return sse_event(chunk)  # after the end: pass it on
            error = chunk.get("error")
            raise WorkerStreamFailed(str(error.get("message", error) if isinstance(error, dict) else error))
        if self.is_resumed:
            track = self._choice(index)
            out = self._reframe_chat(chunk, track) if self.chat_resume else self._reframe(chunk, track)
            return b"" if out is None else sse_event(out)
        if self.id is None:
            self.id, self.created, self.model = chunk.get("id"), chunk.get("created"), chunk.get("model")
        changed = self._follow(chunk, chunk.get("choices") or [])
        return sse_event(chunk) if changed else f"data: {data}\n\n".encode()

    def _choice(self, index: Any) -> ChoiceTrack:
        if not isinstance(index, int) or not 0 <= index < len(self.choices):
            raise WorkerStreamFailed(f"a choice index {index!r} of a stream of {len(self.choices)}")
        return self.choices[index]

    def _follow(self, chunk: dict[str, Any], choices: list[Any]) -> bool:
        """Take the chunk's ids, text and finish; strips the ids the client did not ask for (True if so)."""
        changed = False
        if "prompt_token_ids" in chunk:  # chat: on the first chunk (of every choice)
            ids = chunk.pop("prompt_token_ids") if not self.client_wants_ids else chunk["prompt_token_ids"]
            changed = not self.client_wants_ids
            self.prompt_ids = _ids(ids) if ids is not None else self.prompt_ids
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            track = self._choice(choice.get("index", 0))
            if "prompt_token_ids" in choice:  # completions: in the first chunk's choice
                ids = choice.pop("prompt_token_ids") if not self.client_wants_ids else choice["prompt_token_ids"]
                changed = changed or not self.client_wants_ids
                self.prompt_ids = _ids(ids) if ids is not None else self.prompt_ids
            if "token_ids" in choice:
                ids = choice.pop("token_ids") if not self.client_wants_ids else choice["token_ids"]
                changed = changed or not self.client_wants_ids
                track.output_ids.extend(_ids(ids or []))
            track.text += self.answer_text(track, openai.choice_text(self.is_chat, choice))
            entries = num_logprobs(self.is_chat, choice.get("logprobs"))
            if not track.started and self.echo is not None and entries:  # the echoed prompt's entries first
                entries -= len(self.prompt_ids or [])
            track.num_logprobs += entries
            track.started = True
            if choice.get("finish_reason") is not None:
                track.finished = True
        return changed

    # ---- a resumed stream ---------------------------------------------------------------------------------

    @property
    def can_resume(self) -> bool:
        """The prompt's ids are known, a choice is unfinished, and none needs the prompt's logprobs again."""
        if self.prompt_ids is None or self.finished:
            return False
        return not self.prompt_logprobs or all(c.started for c in self.unfinished())

    def unfinished(self) -> list[ChoiceTrack]:
        return [c for c in self.choices if not c.finished]

    def resume(self, as_chat: bool = False) -> None:
        """A new worker takes over the unfinished choices from here, one request each (``as_chat``: chat
        requests, :func:`resume_chat_body`)."""
        self.num_migrations += 1
        self.chat_resume = as_chat
        unfinished = self.unfinished()
        self.pending = {c.index for c in unfinished}
        for choice in unfinished:
            choice.resumed_at, choice.resumed_tokens = len(choice.output_ids), None
            echoed = len(self.echo) if self.echo is not None and not choice.echo_pending else 0
            choice.next_logprob, choice.text_base = len(choice.output_ids), echoed + len(choice.text)

    def end(self) -> bytes:
        """What ends the client's stream once every choice finished: after a resume, the whole answer's usage
        (when asked for: the resumed requests' own usage chunks are not passed on), and ``[DONE]``."""
        self.done = True
        usage = self.whole_usage() if self.is_resumed and self.client_wants_usage else None
        if usage is None:
            return b"data: [DONE]\n\n"
        kind = openai.CHAT_CHUNK if self.is_chat else openai.COMPLETION_CHUNK
        return sse_event(self._common() | {"object": kind, "choices": [], "usage": usage}) + b"data: [DONE]\n\n"

    def _reframe(self, chunk: dict[str, Any], track: ChoiceTrack) -> dict[str, Any] | None:
        """A resumed request's completion chunk, in the original stream's format, as choice ``track``."""
        self._take_usage(chunk.get("usage"), track)
        choices = chunk.get("choices") or []
        if not choices:
            return None  # its usage: the whole answer's goes out at the end
        choice = choices[0] if isinstance(choices[0], dict) else {}
        ids = _ids(choice.get("token_ids") or [])
        track.output_ids.extend(ids)
        text = str(choice.get("text") or "")
        track.text += text
        finish = choice.get("finish_reason")
        if track.echo_pending and (text or finish is not None) and self.echo is not None:
            track.echo_pending = False  # the echo never reached the client: it goes first
            text = self.echo + text
        if finish is not None:
            track.finished = True
        logprobs = self._logprobs(choice.get("logprobs"), track) if self.logprobs is not None else None
        if not text and finish is None and not self.client_wants_ids and not logprobs:
            return None
        out = self.chunk(text, finish, ids, choice.get("stop_reason"), index=track.index)
        if logprobs is not None:
            out["choices"][0]["logprobs"] = logprobs
        continuous = self.client_wants_usage and isinstance(chunk.get("usage"), dict)
        return out | {"usage": self.whole_usage()} if continuous else out  # continuous_usage_stats

    def _reframe_chat(self, chunk: dict[str, Any], track: ChoiceTrack) -> dict[str, Any] | None:
        """A resumed chat request's chunk as choice ``track`` of the original stream: the deltas as they are (its
        worker replayed what the client has), under the original id, ``created``, model and index; its role
        chunk and its own usage left out."""
        self._take_usage(chunk.get("usage"), track)
        choices = chunk.get("choices") or []
        choice = choices[0] if choices and isinstance(choices[0], dict) else None
        if choice is None:
            return None  # its usage: the whole answer's goes out at the end
        given = choice.get("delta")
        delta = {key: value for key, value in given.items() if key != "role"} if isinstance(given, dict) else {}
        if delta == {"content": ""}:
            delta = {}  # its role chunk's, or a token whose text it holds back
        ids = _ids(choice.get("token_ids") or [])
        track.output_ids.extend(ids)
        track.text += openai.choice_text(True, {"delta": delta})
        track.num_logprobs += num_logprobs(True, choice.get("logprobs"))
        finish = choice.get("finish_reason")
        if finish is not None:
            track.finished = True
        if not delta and finish is None and not (ids and self.client_wants_ids) and not choice.get("logprobs"):
            return None  # the role chunk, or ids the client did not ask for
        out_choice = {**choice, "index": track.index, "delta": delta or ({} if finish else {"content": ""})}
        if not self.client_wants_ids:
            out_choice.pop("token_ids", None)
        out = {**self._common(), "object": openai.CHAT_CHUNK, "choices": [out_choice]}
        continuous = self.client_wants_usage and isinstance(chunk.get("usage"), dict)
        return out | {"usage": self.whole_usage()} if continuous else out

    def _logprobs(self, value: Any, track: ChoiceTrack) -> dict[str, Any] | None:
        """A resumed chunk's logprobs (the completions shape) in the original stream's, without the entries the
        client already has; None when none is left."""
        if not isinstance(value, dict):
            return None
        tokens, values, tops = value.get("tokens") or [], value.get("token_logprobs") or [], value.get("top_logprobs")
        offsets = value.get("text_offset") or []
        keep: list[int] = []
        for i in range(len(tokens)):
            if track.next_logprob >= track.num_logprobs:
                keep.append(i)
            track.next_logprob += 1
        track.num_logprobs += len(keep)
        if not keep:
            return None
        top = [tops[i] if isinstance(tops, list) and i < len(tops) else None for i in keep]
        if not self.is_chat:
            offset = [track.text_base + (offsets[i] if i < len(offsets) else 0) for i in keep]
            tokens_kept, values_kept = [tokens[i] for i in keep], [values[i] if i < len(values) else None for i in keep]
            return {"tokens": tokens_kept, "token_logprobs": values_kept, "top_logprobs": top, "text_offset": offset}
        k = self.logprobs or 0
        return {"content": [
            _chat_entry(str(tokens[i]), values[i] if i < len(values) else None) | {"top_logprobs": [
                _chat_entry(str(t), lp) for t, lp in _most_likely(top[j] or {}, k)]}
            for j, i in enumerate(keep)
        ]}  # fmt: skip

    def _take_usage(self, usage: Any, track: ChoiceTrack) -> None:
        if not isinstance(usage, dict):
            return
        track.resumed_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details")
        if self.cached_tokens is None and isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            self.cached_tokens = details["cached_tokens"]

    def whole_usage(self) -> dict[str, Any]:
        """The usage of the whole answer: the original prompt, every token generated for every choice, and the
        prompt's cached tokens (the first resumed request's, at most the original prompt's length)."""
        num_prompt, num_output = len(self.prompt_ids or []), self.num_output
        whole: dict[str, Any] = {
            "prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output
        }  # fmt: skip
        if self.cached_tokens is not None:
            whole["prompt_tokens_details"] = {"cached_tokens": min(self.cached_tokens, num_prompt)}
        return whole

    def chunk(
        self, text: str, finish: str | None = None, ids: list[int] | None = None, stop: Any = None, index: int = 0
    ) -> dict[str, Any]:
        """A chunk of the original stream carrying ``text`` for choice ``index``."""
        token_ids = ids if self.client_wants_ids else None
        return text_chunk(
            self.is_chat, self._common(), text, finish, token_ids=token_ids, stop_reason=stop, index=index
        )

    def _common(self) -> dict[str, Any]:
        """The original stream's id, created and model, which every chunk the router writes carries."""
        return {"id": self.id, "created": self.created, "model": self.model}


def resume_body(
    tracker: StreamTracker, choice: ChoiceTrack, original: dict[str, Any], max_model_len: int | None = None
) -> dict[str, Any] | None:
    """The ``/v1/completions`` body that goes on with ``choice`` of ``tracker``'s answer; None when no token is
    left. Choice i of a seeded ``n`` draws from seed + i, as the worker drew it (``engine/sampler.py``).

    A chat request without a budget had the context left; ``max_model_len`` (the new worker's) says how much
    that is now. Without it, the resumed part gets the completions default, 16 tokens."""
    assert tracker.prompt_ids is not None
    done = len(choice.output_ids)
    body: dict[str, Any] = {key: original[key] for key in CARRIED_FIELDS if key in original}
    if tracker.is_chat:
        requested = chat_budget(original)
        if requested is None and max_model_len is not None:
            requested = max_model_len - len(tracker.prompt_ids)
    else:
        requested = original.get("max_tokens")
        requested = DEFAULT_COMPLETION_MAX_TOKENS if requested is None else requested
    if requested is not None:
        if not isinstance(requested, int) or requested - done < 1:
            return None
        body["max_tokens"] = requested - done
    body |= _per_choice(original, choice)
    if tracker.logprobs is not None:
        body["logprobs"] = tracker.logprobs
    if original.get("model") is not None:
        body["model"] = original["model"]
    body |= {"prompt": tracker.prompt_ids + choice.output_ids, "stream": True, "return_token_ids": True}
    return body | _usage_options(tracker, original)


def resume_chat_body(tracker: StreamTracker, choice: ChoiceTrack, original: dict[str, Any]) -> dict[str, Any] | None:
    """The chat request that goes on with ``choice`` of ``tracker``'s answer on a splitserve worker: the original
    request, one choice, the tokens left of its budget, and ``resume_from`` (the prompt's and the choice's token
    ids); None when no token is left. Choice i of a seeded ``n`` draws from seed + i, as the worker drew it."""
    assert tracker.prompt_ids is not None
    done = len(choice.output_ids)
    dropped = ("n", "max_tokens", "stream_options", "kv_transfer_params", "prompt_logprobs")
    body = {key: value for key, value in original.items() if key not in dropped}
    requested = chat_budget(original)
    if requested is not None:  # none: the context left, which the worker works out
        if not isinstance(requested, int) or requested - done < 1:
            return None
        body["max_completion_tokens"] = requested - done
    body |= _per_choice(original, choice)
    body |= {"stream": True, "return_token_ids": True}
    body["resume_from"] = {"prompt_token_ids": tracker.prompt_ids, "output_token_ids": choice.output_ids}
    return body | _usage_options(tracker, original)


def chat_budget(original: dict[str, Any]) -> Any:
    """A chat request's token budget as it gave it: ``max_completion_tokens`` (the current OpenAI name) over the
    deprecated ``max_tokens``; None without either."""
    requested = original.get("max_completion_tokens")
    return original.get("max_tokens") if requested is None else requested


def _per_choice(original: dict[str, Any], choice: ChoiceTrack) -> dict[str, Any]:
    """What a resumed request of ``choice`` changes of the original's: the ``min_tokens`` left, and choice i's seed
    (seed + i, as the worker drew it)."""
    fields: dict[str, Any] = {}
    if isinstance(original.get("min_tokens"), int):
        fields["min_tokens"] = max(0, original["min_tokens"] - len(choice.output_ids))
    if isinstance(original.get("seed"), int) and choice.index:
        fields["seed"] = original["seed"] + choice.index
    return fields


def _usage_options(tracker: StreamTracker, original: dict[str, Any]) -> dict[str, Any]:
    """A resumed request's ``stream_options``: its usage when the client wants the whole answer's (continuously,
    if it asked so)."""
    if not tracker.client_wants_usage:
        return {}
    options = original.get("stream_options")
    continuous = isinstance(options, dict) and options.get("continuous_usage_stats") is True
    return {"stream_options": {"include_usage": True} | ({"continuous_usage_stats": True} if continuous else {})}


def _most_likely(top: dict[str, Any], k: int) -> list[tuple[str, Any]]:
    """The k most likely of a completions entry's ``top_logprobs``, most likely first: the dict also holds the
    chosen token, wherever a worker puts it (splitserve last, vLLM first), when it is not among them."""
    ranked = sorted(top.items(), key=lambda item: -item[1] if isinstance(item[1], (int, float)) else math.inf)
    return ranked[:k]


def _chat_entry(token: str, logprob: Any) -> dict[str, Any]:
    """A chat logprobs entry of a token known by its text (its ``bytes``: the text's, as splitserve gives them)."""
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def num_logprobs(is_chat: bool, value: Any) -> int:
    """How many tokens' entries a chunk's ``logprobs`` carries."""
    if not isinstance(value, dict):
        return 0
    entries = value.get("content") if is_chat else value.get("tokens")
    return len(entries) if isinstance(entries, list) else 0


def held_back_text(choice: ChoiceTrack, context_text: str, full_text: str) -> str:
    """Text of a choice's generated tokens the client has not got: ``full_text`` is the decode of the prompt's
    last tokens plus the choice's output tokens, ``context_text`` of those prompt tokens alone."""
    if not full_text.startswith(context_text):
        return ""
    generated = full_text[len(context_text) :]
    if not generated.startswith(choice.text) or generated.endswith("\ufffd"):
        return ""
    return generated[len(choice.text) :]


class SSEBuffer:
    """Splits a byte stream into whole SSE events; returns each event's ``data`` (joined lines)."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, piece: bytes) -> list[str]:
        self._pending += piece
        if b"\n\n" not in self._pending and b"\r\n\r\n" not in self._pending:
            return []
        text = self._pending.replace(b"\r\n", b"\n")
        *events, self._pending = text.split(b"\n\n")
        out = []
        for event in events:
            lines = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
            if lines:
                out.append(b"\n".join(lines).decode("utf-8", errors="replace"))
        return out


def _ids(value: Any) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) for t in value):
        raise WorkerStreamFailed("token ids that are not a list of integers")
    return value

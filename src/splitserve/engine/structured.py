"""Structured outputs: JSON schemas, regexes, choices and grammars as token masks, by llguidance.

A ``GrammarCompiler`` belongs to one model (its tokenizer). It turns a ``StructuredOutput`` into llguidance's
grammar, compiles it into a matcher once and keeps that pristine matcher by the spec's key (least recently used
out first), so a request starts from a deep copy that costs microseconds. The worker compiles on its tokenizer
thread when a request arrives (``check``), so an invalid schema is the client's 400 and a long compile never
stalls the engine's steps.

A request's ``Grammar`` consumes each output token as the engine appends it, so the next draw's mask allows
exactly the tokens that keep the output valid. A request resumed elsewhere (a migrated stream, whose prompt ends
with the tokens already sent) first consumes the tokens generated before; a disaggregated decode consumes the
prefill worker's first token as it appends it. So the grammar carries on where it was, on whichever worker.
The runner computes a step's masks on a thread of its own while the forward pass runs (llguidance releases the
GIL), and the sampler applies them before anything else, as vLLM does.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from splitserve.engine.sampling_params import StructuredKind, StructuredOutput

if TYPE_CHECKING:
    import llguidance

    from splitserve.model.tokenizer import TokenizerLike

MAX_CACHED_GRAMMARS = 256
# JSON without optional whitespace: a small model cannot wander off into blank lines, and the output is compact
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A structured-output spec that does not compile (an invalid schema, regex, grammar or choice list)."""


def grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar for ``spec``; ``GrammarError`` when it is malformed beyond what compiling reports."""
    from llguidance import LLMatcher, grammar_from

    try:
        if spec.kind in (StructuredKind.JSON, StructuredKind.JSON_OBJECT):
            schema = spec.spec if spec.kind == StructuredKind.JSON else '{"type": "object"}'
            return str(LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))  # type: ignore[arg-type]
        if spec.kind == StructuredKind.REGEX:
            return str(LLMatcher.grammar_from_regex(spec.spec))
        if spec.kind == StructuredKind.CHOICE:
            choices = json.loads(spec.spec)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise GrammarError("choice must be a non-empty list of non-empty strings")
            return str(grammar_from("choice", spec.spec))
        return str(grammar_from("grammar", spec.spec))
    except GrammarError:
        raise
    except (ValueError, TypeError) as exc:
        raise GrammarError(str(exc)) from exc


class Grammar:
    """One request's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Consume a drawn token; False when it breaks the grammar (the matcher stays in error)."""
        return bool(self.matcher.consume_token(token_id))

    @property
    def is_finished(self) -> bool:
        """The output is complete: nothing but an end-of-sequence token may follow."""
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str:
        return str(self.matcher.get_error())

    def fill_mask(self, row: torch.Tensor) -> None:
        """The next token's mask into ``row`` (int32, a bit per token id; 1: allowed)."""
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())


class GrammarCompiler:
    """Compiles specs for one tokenizer and keeps the compiled matchers by spec (thread-safe)."""

    def __init__(self, tokenizer_factory: Callable[[], llguidance.LLTokenizer]) -> None:
        self._tokenizer_factory = tokenizer_factory
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer: TokenizerLike, vocab_size: int) -> GrammarCompiler:
        """For a Hugging Face fast tokenizer (``model.tokenizer.Tokenizer``); its stop tokens end a finished
        output. Building llguidance's view of the vocabulary takes about a second: it happens at first use."""

        def build() -> llguidance.LLTokenizer:
            import llguidance.hf

            hf: Any = getattr(tokenizer, "hf", None)
            if hf is None:
                raise GrammarError("structured outputs need the model's Hugging Face tokenizer")
            eos = sorted(tokenizer.stop_token_ids) or None  # type: ignore[attr-defined]
            return llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)

        return cls(build)

    def _lltokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = self._tokenizer_factory()
        return self._tokenizer

    def compile(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """The pristine matcher of ``spec`` (from the cache, or compiled now); ``GrammarError`` when invalid."""
        from llguidance import LLMatcher

        key = spec.key
        with self._lock:
            cached = self._compiled.get(key)
            if cached is not None:
                self._compiled.move_to_end(key)
                return cached
            tokenizer = self._lltokenizer()
        grammar = grammar_text(spec)
        error = LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise GrammarError(" ".join(line.strip() for line in error.splitlines() if line.strip())[:500])
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        with self._lock:
            self._compiled[key] = matcher
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return matcher

    def check(self, spec: StructuredOutput) -> None:
        """Compile ``spec`` now (any thread), so the engine later finds it compiled; ``GrammarError`` if invalid."""
        self.compile(spec)

    def grammar(self, spec: StructuredOutput, generated: Sequence[int] = ()) -> Grammar:
        """A fresh place in ``spec``'s grammar after ``generated`` (tokens a resumed request made before)."""
        grammar = Grammar(self.compile(spec).deep_copy())
        for token in generated:
            if not grammar.accept(token):
                raise GrammarError(f"the tokens generated before do not follow the grammar: {grammar.error}")
        return grammar


@dataclass(frozen=True, slots=True)
class TokenMasks:
    """A step's masks: the draws (rows of the logits) they constrain, and for each an additive bias over the
    vocabulary, 0 where the grammar allows the token and -inf where not. Adding it leaves an allowed logit's bits
    as they were (x + 0 is x) and costs a fortieth of a masked fill."""

    rows: list[int]
    bias: torch.Tensor  # [len(rows), vocab] float32

    @classmethod
    def from_bitmasks(cls, rows: list[int], bitmasks: torch.Tensor, vocab_size: int) -> TokenMasks:
        """``bitmasks``: [len(rows), words] int32, bit i of word w for token 32 w + i. A row allowing nothing (a
        grammar in error) is not applied: the engine ends that request when its token is refused."""
        bits = np.unpackbits(bitmasks.contiguous().numpy().view(np.uint8), axis=-1, bitorder="little")[:, :vocab_size]
        bits[~bits.any(axis=1)] = 1
        with np.errstate(divide="ignore"):
            bias = np.log(bits.astype(np.float32))  # log 1 = 0, log 0 = -inf: a third of a table lookup's time
        return cls(rows, torch.from_numpy(bias))

    def apply(self, logits: torch.Tensor) -> None:
        """Rule out the disallowed tokens of the constrained rows of ``logits`` ([draws, vocab] float32), in place."""
        logits.index_add_(0, torch.tensor(self.rows, dtype=torch.long), self.bias)

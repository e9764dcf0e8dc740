"""Incremental detokenization and stop strings.

Text is produced from output tokens a few at a time: decoding ``ids[prefix_offset:]`` and subtracting the
text of ``ids[prefix_offset:read_offset]`` gives the new characters, with a token boundary as context so
that byte-level BPE spaces and multi-byte characters come out right. The prompt's last few tokens are that
context for the first output token (as in vLLM), so a SentencePiece "▁word" that opens the output keeps its
space, and a request resumed from its prompt plus earlier output continues its text exactly; an incomplete character
(U+FFFD at the end) is held back until the next token completes it. When stop strings are set, the last
``max(len(stop)) - 1`` characters are held back too, so a stop string split across tokens is never
partly emitted.

A stream resumed on another worker (the router's migration) can replay the output the original worker made
(:meth:`IncrementalDetokenizer.replayed`): the replay leaves it where the original worker's detokenizer was,
holding back the same characters, so the text goes on exactly as the original stream's would have.
"""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded before the output (vLLM's initial detokenization offset)


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Decoder, stop: tuple[str, ...], include_stop_str: bool, prompt_tail: list[int] | None = None
    ) -> None:
        """``prompt_tail``: the prompt's last tokens, context for the first output token's text."""
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop_str = include_stop_str
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all text decoded so far
        self.num_emitted_chars = 0
        self._ids = list(prompt_tail or ())[-PROMPT_CONTEXT_TOKENS:]  # that context, then the output so far
        self._num_context = len(self._ids)
        self._prefix_offset = 0
        self._read_offset = self._num_context

    @classmethod
    def replayed(
        cls, tokenizer: Decoder, stop: tuple[str, ...], include_stop_str: bool, prompt: list[int], output: list[int]
    ) -> IncrementalDetokenizer:
        """A detokenizer that has taken ``output`` after ``prompt`` token by token and handed out its text, as the
        original stream's had; later :meth:`update` calls take the output generated after ``output`` alone.
        ``emitted_text`` is what it handed out (the client of the original stream has it)."""
        detok = cls(tokenizer, stop, include_stop_str, prompt)
        taken: list[int] = []
        for token in output:  # one token at a time, as the original took them (update reads the new tail only)
            taken.append(token)
            detok.update(taken)
        detok.take_new_text(finished=False)
        detok._num_context += len(output)
        return detok

    @property
    def emitted_text(self) -> str:
        return self.text[: self.num_emitted_chars]

    def update(self, output_ids: list[int]) -> str | None:
        """Take the request's whole output token list; returns the matched stop string, if any.

        After a match, ``text`` ends at the stop string (or just before it).
        """
        num_before = len(self.text)
        self.text += self._decode_new(output_ids)
        if not self.stop or len(self.text) == num_before:
            return None
        search_from = max(0, num_before - max(len(s) for s in self.stop) + 1)
        for stop in self.stop:
            at = self.text.find(stop, search_from)
            if at >= 0:
                self.text = self.text[: at + len(stop)] if self.include_stop_str else self.text[:at]
                return stop
        return None

    def take_new_text(self, finished: bool) -> str:
        """Text not yet handed out; while unfinished, the possible start of a stop string is held back."""
        end = len(self.text) if finished else max(self.num_emitted_chars, len(self.text) - self.hold_back)
        new = self.text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        return new

    def _decode_new(self, output_ids: list[int]) -> str:
        ids = self._ids
        ids.extend(output_ids[len(ids) - self._num_context :])
        prefix = self.tokenizer.decode(ids[self._prefix_offset : self._read_offset])
        full = self.tokenizer.decode(ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        return full[len(prefix) :]

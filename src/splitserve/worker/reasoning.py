"""Reasoning models' thinking, split off their answer into ``reasoning_content`` (``--reasoning-parser``), whole and
streamed, as vLLM's parsers of the same names do.

- ``deepseek_r1`` (DeepSeek-R1 and its distills): the template opens ``<think>``, so the output is reasoning up
  to ``</think>``, then the answer; an output without ``</think>`` is all reasoning (it was cut short).
- ``qwen3``: reasoning only when the output opens with ``<think>`` (thinking can be switched off); without
  ``</think>`` after it, the output is all reasoning too.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(slots=True)
class ReasoningSplitter:
    """One choice's output as (reasoning, content), whole (``split``) or as it streams (``feed``)."""

    parser: str  # deepseek_r1 | qwen3
    text: str = ""
    sent: int = 0  # characters of ``text`` handed out
    in_reasoning: bool | None = None  # None: not known yet (qwen3 before its first characters)
    ended: bool = False  # </think> seen
    answered: bool = False  # some of the answer after </think> was handed out (its leading newlines dropped)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """The whole output's (reasoning, content); either is None when empty."""
        stripped = text.lstrip()
        opens = stripped.startswith(START)
        if self.parser == "qwen3" and not opens:
            return None, text
        body = stripped.removeprefix(START) if opens else text
        if END not in body:
            return body or None, None
        reasoning, content = body.split(END, 1)
        return reasoning or None, content.lstrip("\n") or None

    def feed(self, new_text: str, final: bool = False) -> tuple[str, str]:
        """The (reasoning, content) text to send now; ``final``: nothing more will come."""
        self.text += new_text
        if self.in_reasoning is None:
            stripped = self.text.lstrip()
            if self.parser == "deepseek_r1" or stripped.startswith(START):
                self.in_reasoning = True
            elif START.startswith(stripped) and not final:
                return "", ""  # may still open <think>
            else:
                self.in_reasoning = False
        if not self.in_reasoning or self.ended:
            content = self.text[self.sent :]
            self.sent = len(self.text)
            return "", self._answer(content)
        if self.sent == 0:
            stripped = self.text.lstrip()
            if stripped.startswith(START):
                self.sent = self.text.index(START) + len(START)
            elif START.startswith(stripped) and not final:
                return "", ""  # may still be the opening <think>
        end = self.text.find(END, self.sent)
        if end >= 0:
            reasoning = self.text[self.sent : end]
            self.ended = True
            rest = self.text[end + len(END) :]
            self.sent = len(self.text)
            return reasoning, self._answer(rest)
        keep = 0 if final else partial_suffix(self.text[self.sent :], END)
        reasoning = self.text[self.sent : len(self.text) - keep]
        self.sent = len(self.text) - keep
        return reasoning, ""

    def _answer(self, content: str) -> str:
        if self.ended and not self.answered:
            content = content.lstrip("\n")
            self.answered = bool(content)
        return content


def partial_suffix(text: str, marker: str) -> int:
    """How many of ``text``'s last characters begin ``marker`` (a marker the text so far may be cut off in)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0

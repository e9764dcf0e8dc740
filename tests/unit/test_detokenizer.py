from __future__ import annotations

from splitserve.engine.detokenizer import IncrementalDetokenizer


class CharTokenizer:
    """Token id i is chr(i); id 0 is a special token that decodes to nothing."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i != 0)


def feed(detok: IncrementalDetokenizer, text: str) -> tuple[str, str | None]:
    ids: list[int] = []
    emitted = ""
    for ch in text:
        ids.append(ord(ch))
        stop = detok.update(ids)
        emitted += detok.take_new_text(finished=stop is not None)
        if stop is not None:
            return emitted, stop
    return emitted + detok.take_new_text(finished=True), None


def test_plain_text_streams_through() -> None:
    assert feed(IncrementalDetokenizer(CharTokenizer(), (), False), "hello") == ("hello", None)


def test_stop_string_split_across_tokens_is_never_emitted() -> None:
    detok = IncrementalDetokenizer(CharTokenizer(), ("END",), False)
    ids: list[int] = []
    streamed = ""
    for ch in "abcEN":
        ids.append(ord(ch))
        assert detok.update(ids) is None
        streamed += detok.take_new_text(finished=False)
    assert streamed == "abc"  # "EN" is held back: it may start a stop string
    ids.append(ord("D"))
    assert detok.update(ids) == "END"
    assert streamed + detok.take_new_text(finished=True) == "abc"


def test_include_stop_string() -> None:
    detok = IncrementalDetokenizer(CharTokenizer(), ("\n\n",), True)
    assert feed(detok, "line\n\nmore") == ("line\n\n", "\n\n")

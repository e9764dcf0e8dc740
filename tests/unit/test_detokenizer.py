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


class ByteTokenizer:
    """Token id i is the byte i: a character of several bytes comes whole only with its last token."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_a_replayed_detokenizer_goes_on_as_the_original_would_have() -> None:
    """Cut a stream after every token: the text the original handed out by then is what the replay says the
    client has, and the replay's text from there on is the rest of the original's, held-back stop-string
    characters and half characters included."""
    prompt, answer, stop = list(b"say: "), list("caf\u00e9 END \u20ac ENDING".encode()), ("ENDING",)
    whole = IncrementalDetokenizer(ByteTokenizer(), stop, False, prompt)
    sent: list[str] = []  # what the original had handed out after each token
    for end in range(1, len(answer) + 1):
        matched = whole.update(answer[:end])
        sent.append(whole.take_new_text(finished=matched is not None))
        if matched is not None:
            break
    assert "".join(sent) == "caf\u00e9 END \u20ac " and matched == "ENDING"
    for cut in range(1, len(sent)):
        replayed = IncrementalDetokenizer.replayed(ByteTokenizer(), stop, False, prompt, answer[:cut])
        assert replayed.emitted_text == "".join(sent[:cut])
        rest = ""
        for end in range(cut + 1, len(answer) + 1):
            matched = replayed.update(answer[cut:end])
            rest += replayed.take_new_text(finished=matched is not None)
            if matched is not None:
                break
        assert rest == "".join(sent[cut:]) and matched == "ENDING", cut

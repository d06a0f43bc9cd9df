"""Incremental detokenization: UTF-8 across tokens, stop strings, stop tokens, eos and length."""

from __future__ import annotations

import pytest

from cupyspec.sampling.params import SamplingParams
from cupyspec.text.detokenizer import DetokenizedDelta, IncrementalDetokenizer

EOS = 0
SPECIAL = 1


class FakeTokenizer:
    """Byte-level vocabulary: ids 0/1 are special, then one token per piece, added on demand."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = [b"<|eos|>", b"<|sep|>"]

    def ids(self, *pieces: bytes | str) -> list[int]:
        out = []
        for piece in pieces:
            data = piece.encode() if isinstance(piece, str) else piece
            if data not in self.pieces:
                self.pieces.append(data)
            out.append(self.pieces.index(data))
        return out

    def token_bytes(self, token_id: int) -> bytes:
        return self.pieces[token_id]

    def is_special(self, token_id: int) -> bool:
        return token_id in (EOS, SPECIAL)


def make(tok: FakeTokenizer, max_output_tokens: int = 100, **params) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tok, SamplingParams(**params), (EOS,), max_output_tokens)


def feed_one_by_one(detok: IncrementalDetokenizer, ids: list[int]) -> list[DetokenizedDelta]:
    deltas = []
    for i in ids:
        deltas.append(detok.add([i]))
        if deltas[-1].finish_reason:
            break
    return deltas


def test_multibyte_characters_split_across_tokens() -> None:
    tok = FakeTokenizer()
    text = "a€b😀c"  # 3-byte and 4-byte characters
    data = text.encode()
    splits = [b"a\xe2", b"\x82", b"\xacb\xf0\x9f", b"\x98", b"\x80c"]
    assert b"".join(splits) == data
    detok = make(tok)
    deltas = feed_one_by_one(detok, tok.ids(*splits))
    assert [d.text for d in deltas] == ["a", "", "€b", "", "😀c"]
    assert all("\ufffd" not in d.text for d in deltas)


def test_invalid_bytes_become_replacement_once_proven() -> None:
    tok = FakeTokenizer()
    detok = make(tok)
    assert detok.add(tok.ids(b"x\xe2\x82")).text == "x"  # may still complete
    assert detok.add(tok.ids(b"y")).text == "\ufffdy"  # proven invalid
    assert detok.add(tok.ids(b"\xf0\x9f")).text == ""
    assert detok.flush() == "\ufffd"  # never completed


def test_stop_string_spanning_three_tokens() -> None:
    tok = FakeTokenizer()
    detok = make(tok, stop=("STOP",))
    deltas = feed_one_by_one(detok, tok.ids("Hello S", "T", "O", "P and more"))
    assert "".join(d.text for d in deltas) == "Hello "
    assert [d.text for d in deltas] == ["Hello ", "", "", ""]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == "STOP"
    assert detok.finished


def test_held_prefix_released_when_continuation_diverges() -> None:
    tok = FakeTokenizer()
    detok = make(tok, stop=("STOP",))
    deltas = feed_one_by_one(detok, tok.ids("go ST", "O", "NE", " ok"))
    assert [d.text for d in deltas] == ["go ", "", "STONE", " ok"]
    assert all(d.finish_reason is None for d in deltas)


def test_overlapping_stop_prefixes_and_earliest_completion() -> None:
    tok = FakeTokenizer()
    detok = make(tok, stop=("aab", "ba"))
    deltas = feed_one_by_one(detok, tok.ids("a", "a", "a", "b", "a"))
    assert "".join(d.text for d in deltas) == "a"
    assert deltas[-1].stop_reason == "aab"
    # two stops completing in one token: the one that ends first wins, whatever the split
    detok = make(tok, stop=("xyz", "y"))
    delta = detok.add(tok.ids("wxyz!"))
    assert (delta.text, delta.stop_reason) == ("wx", "y")


def test_include_stop_str_in_output() -> None:
    tok = FakeTokenizer()
    detok = make(tok, stop=("END",), include_stop_str_in_output=True)
    deltas = feed_one_by_one(detok, tok.ids("one E", "N", "Dtwo"))
    assert "".join(d.text for d in deltas) == "one END"
    assert deltas[-1].stop_reason == "END"


def test_eos_counts_but_emits_no_text() -> None:
    tok = FakeTokenizer()
    detok = make(tok, stop=("zz",))
    assert detok.add(tok.ids("hi z")).text == "hi "
    delta = detok.add([EOS])
    assert (delta.text, delta.num_tokens_accepted, delta.finish_reason, delta.stop_reason) == ("z", 1, "stop", None)
    assert detok.num_output_tokens == 2
    with pytest.raises(RuntimeError):
        detok.add(tok.ids("more"))


def test_ignore_eos_treats_eos_as_a_special_token() -> None:
    tok = FakeTokenizer()
    detok = make(tok, ignore_eos=True)
    delta = detok.add([EOS, *tok.ids("x")])
    assert (delta.text, delta.num_tokens_accepted, delta.finish_reason) == ("x", 2, None)
    shown = make(tok, ignore_eos=True, skip_special_tokens=False)
    assert shown.add([EOS, SPECIAL]).text == "<|eos|><|sep|>"


def test_skipped_special_tokens_still_count() -> None:
    tok = FakeTokenizer()
    detok = make(tok, max_output_tokens=3)
    delta = detok.add([SPECIAL, *tok.ids("a"), SPECIAL, *tok.ids("b")])
    assert (delta.text, delta.num_tokens_accepted, delta.finish_reason) == ("a", 3, "length")


def test_a_stop_token_ends_the_output_without_its_text_or_what_follows() -> None:
    tok = FakeTokenizer()
    a, b, c = tok.ids("a", "b", "c")
    detok = make(tok, stop_token_ids=(b,))
    delta = detok.add([a, b, c])
    assert (delta.text, delta.num_tokens_accepted, delta.finish_reason, delta.stop_reason) == ("a", 2, "stop", b)


def test_length_limit_flushes_held_text() -> None:
    tok = FakeTokenizer()
    detok = make(tok, max_output_tokens=2, stop=("xyz",))
    first = detok.add(tok.ids("ab x"))
    assert (first.text, first.finish_reason) == ("ab ", None)
    last = detok.add(tok.ids("y", "z"))
    assert (last.text, last.num_tokens_accepted, last.finish_reason, last.stop_reason) == ("xy", 1, "length", None)


def test_stop_string_beats_length_on_the_same_token() -> None:
    tok = FakeTokenizer()
    delta = make(tok, max_output_tokens=1, stop=("b",)).add(tok.ids("abc"))
    assert (delta.text, delta.finish_reason, delta.stop_reason) == ("a", "stop", "b")


def test_run_with_stop_string_in_the_middle() -> None:
    tok = FakeTokenizer()
    detok = make(tok, stop=("<end>",))
    delta = detok.add(tok.ids("x", "y<e", "nd", ">z", "w"))
    assert (delta.text, delta.num_tokens_accepted, delta.finish_reason) == ("xy", 4, "stop")  # ">z" completes it


def test_run_with_stop_token_in_the_middle() -> None:
    tok = FakeTokenizer()
    ids = tok.ids("p", "q", "r")
    delta = make(tok).add([ids[0], ids[1], EOS, ids[2], ids[2]])
    assert (delta.text, delta.num_tokens_accepted, delta.finish_reason) == ("pq", 3, "stop")


def test_flush_returns_held_text_for_abort() -> None:
    tok = FakeTokenizer()
    detok = make(tok, stop=("STOP",))
    assert detok.add(tok.ids("abc ST")).text == "abc "
    assert detok.flush() == "ST"


def test_output_equals_whole_decode_for_any_split() -> None:
    tok = FakeTokenizer()
    data = "Grüße, 世界! stop? no: 🚀 done".encode()
    for step in (1, 2, 3, 5):
        detok = make(tok, stop=("stop!",))
        pieces = [data[i:i + step] for i in range(0, len(data), step)]
        text = "".join(d.text for d in feed_one_by_one(detok, tok.ids(*pieces))) + detok.flush()
        assert text == data.decode()


def test_a_max_output_tokens_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_output_tokens"):
        make(FakeTokenizer(), max_output_tokens=0)


def test_may_end_within_names_the_tokens_that_end_a_sequence_without_decoding_them():
    """Stop tokens, eos (unless ignored) and the length limit end a sequence whatever the text;
    `may_end_within` tells them without changing the detokenizer, and `add` then ends there."""
    tok = FakeTokenizer()
    a, b, stop = tok.ids("a", "b", "!")
    detok = make(tok, max_output_tokens=5, stop_token_ids=(stop,))
    assert not detok.may_end_within([a, b, a])
    assert detok.may_end_within([a, EOS]) and detok.may_end_within([stop])
    assert not make(tok, ignore_eos=True).may_end_within([a, EOS])
    detok.add([a, b, a])
    assert not detok.may_end_within([b]) and detok.may_end_within([b, a])  # the fifth token is the last
    assert detok.add([b, a]).finish_reason == "length"

"""Stop strings matched across piece boundaries, never emitted, with hold-back released at the end."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from engine.output.detokenizer import StopStringMatcher


def run(pieces: list[str], stops: tuple[str, ...]) -> tuple[str, str | None]:
    matcher = StopStringMatcher(stops)
    emitted = []
    for piece in pieces:
        check = matcher.feed(piece)
        emitted.append(check.text)
        if check.stop is not None:
            return "".join(emitted), check.stop
    return "".join(emitted) + matcher.flush(), None


def test_stop_split_across_pieces_is_not_emitted():
    assert run(["Hello wo", "rl", "d! more"], ("world",)) == ("Hello ", "world")


def test_partial_match_is_held_then_released():
    matcher = StopStringMatcher(("</end>",))
    assert matcher.feed("abc</e").text == "abc"
    assert matcher.feed("x").text == "</ex"
    assert matcher.flush() == ""


def test_earliest_of_several_stops_wins():
    assert run(["a STOP b END"], ("END", "STOP")) == ("a ", "STOP")


def test_held_text_is_flushed_when_generation_ends_without_stop():
    assert run(["value: ", "<"], ("<|im_end|>",)) == ("value: <", None)


def test_no_stops_passes_text_through():
    matcher = StopStringMatcher(())
    assert matcher.feed("anything").text == "anything"


@given(
    text=st.text(alphabet="ab<>/x", max_size=40),
    stop=st.text(alphabet="ab<>/", min_size=1, max_size=4),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=8),
)
def test_any_split_equals_unsplit_reference(text, stop, cuts):
    positions = sorted(set(c for c in cuts if c <= len(text)))
    pieces = [text[a:b] for a, b in itertools.pairwise([0, *positions, len(text)])]
    index = text.find(stop)
    expected = (text, None) if index < 0 else (text[:index], stop)
    assert run(pieces, (stop,)) == expected

"""Whisper's decoding rules and the transcript of overlapping windows, in plain Python."""

from __future__ import annotations

from engine.speech.requests import TimestampState, WindowResult
from engine.speech.timestamp_rules import after_sampling, forbidden_next
from engine.speech.transcript import merged_segments, window_offsets, window_segments

EOT, BLANK, NO_TS, TS, VOCAB = 50257, (220,), 50363, 50364, 51865


def _forbidden(state: TimestampState) -> set[tuple[int, int]]:
    return set(forbidden_next(state, True, EOT, BLANK, NO_TS, TS, VOCAB).ranges)


def _sampled(*tokens: int) -> TimestampState:
    state = TimestampState()
    for token in tokens:
        after_sampling(state, token, TS, EOT)
    return state


def test_the_first_token_is_a_timestamp_within_the_first_second_never_blank_or_the_end():
    assert _forbidden(TimestampState()) == {(220, 221), (EOT, EOT + 1), (NO_TS, NO_TS + 1), (0, TS), (TS + 51, VOCAB)}
    plain = forbidden_next(TimestampState(), False, EOT, BLANK, NO_TS, TS, VOCAB)
    assert set(plain.ranges) == {(220, 221), (EOT, EOT + 1)} and not plain.timestamp_rule


def test_timestamps_come_in_pairs_and_never_go_back():
    opened = _sampled(TS + 10)  # the first <|0.20|> opens a segment: text must follow (OpenAI's rule)
    assert _forbidden(opened) == {(NO_TS, NO_TS + 1), (TS, VOCAB), (TS, TS + 11)}
    texted = _sampled(TS + 10, 400, 500)  # text: a closing timestamp after 0.20 s, or more text
    assert _forbidden(texted) == {(NO_TS, NO_TS + 1), (TS, TS + 11)}
    closing = _sampled(TS + 10, 400, TS + 40)  # just closed at 0.80: text or the next opening, never below 0.80
    assert _forbidden(closing) == {(NO_TS, NO_TS + 1), (0, EOT), (TS, TS + 40)}
    paired = _sampled(TS + 10, 400, TS + 40, TS + 40)  # a pair: text must follow
    assert _forbidden(paired) == {(NO_TS, NO_TS + 1), (TS, VOCAB), (TS, TS + 41)}
    assert paired.text_tokens == [400]


def test_windows_cover_the_audio_with_overlap():
    assert window_offsets(16_000 * 10) == [(0.0, 10.0)]
    assert window_offsets(16_000 * 30) == [(0.0, 30.0)]
    assert window_offsets(16_000 * 70) == [(0.0, 30.0), (25.0, 30.0), (50.0, 20.0)]


def _window(index: int, offset: float, duration: float, tokens: list[int]) -> WindowResult:
    return WindowResult(index, offset, duration, tokens, -0.3, 0.01, 0.0)


def test_a_window_splits_into_timed_segments_the_last_one_cut_by_its_end():
    window = _window(1, 25.0, 30.0, [TS, 1, 2, TS + 100, TS + 100, 3, TS + 200, TS + 1400, 4, 5])
    segments = window_segments(window, TS, EOT)
    assert [(s.start, s.end, s.tokens, s.complete) for s in segments] == [
        (25.0, 27.0, (1, 2), True), (27.0, 29.0, (3,), True), (53.0, 55.0, (4, 5), False)]


def test_overlapping_windows_merge_without_losing_or_repeating_a_segment():
    first = _window(0, 0.0, 30.0, [TS, 1, TS + 500, TS + 500, 2, TS + 1300, TS + 1350, 3, TS + 1490])
    # The second window hears segment 3 (26.0-29.8 s) again from its start, and it goes on past the first's end.
    second = _window(1, 25.0, 12.0, [TS + 50, 3, 33, TS + 300, TS + 300, 4, TS + 550])
    merged = merged_segments([second, first], TS, EOT)
    assert [(round(s.start, 2), round(s.end, 2), s.tokens) for s in merged] == [
        (0.0, 10.0, (1,)), (10.0, 26.0, (2,)), (26.0, 31.0, (3, 33)), (31.0, 36.0, (4,))]


def test_a_later_window_that_hears_the_last_words_again_adds_only_what_follows():
    # The first window's last kept segment ends at 27.6 s ("... by Friday ."); the second window (from 25 s) hears
    # "Friday . The train" as one segment from 25.0 s: only "The train" is new.
    by, friday, dot, the, train, tomatoes = 538, 6984, 13, 440, 3847, 9660
    first = _window(0, 0.0, 30.0, [TS + 1200, by, friday, dot, TS + 1380, TS + 1380, tomatoes, TS + 1500])
    second = _window(1, 25.0, 10.0, [TS, friday, dot, the, train, TS + 400])
    merged = merged_segments([first, second], TS, EOT)
    assert [(round(s.start, 2), s.tokens) for s in merged] == [(24.0, (by, friday, dot)), (27.6, (the, train))]
    # Nothing repeated: a segment that repeats none of the words is kept whole rather than lost.
    other = _window(1, 25.0, 10.0, [TS, tomatoes, the, TS + 400])
    assert [s.tokens for s in merged_segments([first, other], TS, EOT)] == [(by, friday, dot), (tomatoes, the)]

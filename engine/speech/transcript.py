"""Windows' tokens as a transcript: segments with times (plain Python, no MLX).

Long audio is decoded as 30 s windows that overlap by OVERLAP_S, all at once (so they batch); each window is
decoded with timestamps, so its tokens split into timed segments. Where two windows overlap, the earlier one keeps
its complete segments that end by the middle of the overlap (or began before the later window's audio), and the
later one contributes what starts after the last segment kept.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from engine.speech.requests import WindowResult

WINDOW_S = 30.0
OVERLAP_S = 5.0
STRIDE_S = WINDOW_S - OVERLAP_S
SECONDS_PER_TIMESTAMP = 0.02
SAMPLE_RATE = 16_000


@dataclass(frozen=True)
class Segment:
    start: float  # seconds into the audio
    end: float
    tokens: tuple[int, ...]  # text tokens
    complete: bool  # closed by a timestamp (not cut off by the window's end)
    avg_logprob: float = 0.0
    no_speech_prob: float = 0.0
    temperature: float = 0.0


def window_offsets(samples: int) -> list[tuple[float, float]]:
    """(offset, duration) in seconds of each window over `samples` at 16 kHz."""
    total = samples / SAMPLE_RATE
    offsets, start = [], 0.0
    while True:
        offsets.append((start, min(WINDOW_S, total - start)))
        if start + WINDOW_S >= total:
            return offsets
        start += STRIDE_S


def window_segments(window: WindowResult, timestamp_begin: int, eot: int) -> list[Segment]:
    """A window's tokens as segments in the audio's time: text between a timestamp pair is one segment."""
    segments: list[Segment] = []
    opened: float | None = None
    text: list[int] = []

    def close(end: float, complete: bool) -> None:
        if text:  # times past the audio (silence the window was padded with) are cut to its end
            start = min(opened if opened is not None else 0.0, window.duration_s)
            end = max(min(end, window.duration_s), start)
            segments.append(Segment(window.offset_s + start, window.offset_s + end, tuple(text), complete,
                                    window.avg_logprob, window.no_speech_prob, window.temperature))

    for token in window.tokens:
        if token >= timestamp_begin:
            seconds = (token - timestamp_begin) * SECONDS_PER_TIMESTAMP
            if text:
                close(seconds, True)
                text, opened = [], None
            else:
                opened = seconds
        elif token < eot:
            text.append(token)
    close(window.duration_s, False)
    return segments


def merged_segments(windows: list[WindowResult], timestamp_begin: int, eot: int) -> list[Segment]:
    """The transcript's segments across overlapping windows (in window order)."""
    merged: list[Segment] = []
    for index, window in enumerate(sorted(windows, key=lambda w: w.index)):
        last = index == len(windows) - 1
        next_start = window.offset_s + STRIDE_S  # where the next window's audio begins
        for segment in window_segments(window, timestamp_begin, eot):
            if not last and not _kept_before_next(segment, next_start):
                continue  # the next window hears it whole
            covered = merged[-1].end if merged else 0.0
            if segment.start + SECONDS_PER_TIMESTAMP < covered:
                segment = _past(segment, covered, [t for s in merged[-3:] for t in s.tokens])
                if segment is None:
                    continue  # the earlier window has all of it
            merged.append(segment)
    return merged


def _past(segment: Segment, covered: float, before: list[int]) -> Segment | None:
    """What a segment that begins inside the audio already transcribed adds: its tokens after those that repeat
    the end of the transcript so far (the earlier window's last words, heard again). One that ends inside the
    covered audio adds nothing; one whose words repeat none of it is kept whole: better twice than lost."""
    if segment.end <= covered + SECONDS_PER_TIMESTAMP:
        return None
    tokens = list(segment.tokens)
    for skip in range(min(3, len(tokens))):  # the later window may begin inside a word: skip its first pieces
        for length in range(min(len(tokens) - skip, len(before)), 1, -1):
            if tokens[skip:skip + length] == before[-length:]:
                rest = tuple(tokens[skip + length:])
                return dataclasses.replace(segment, start=covered, tokens=rest) if rest else None
    return segment


def _kept_before_next(segment: Segment, next_start: float) -> bool:
    """A window keeps a complete segment that ends by the middle of its overlap with the next window, or that
    began before the next window's audio does (the next one would hear it cut)."""
    return segment.complete and (segment.end <= next_start + OVERLAP_S / 2 or segment.start < next_start)


def transcript_text(segments: list[Segment], decode: Callable[[list[int]], str]) -> str:
    return "".join(decode(list(s.tokens)) for s in segments).strip()

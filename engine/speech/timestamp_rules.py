"""Which tokens a window may not sample next, as ranges of token ids (plain Python, one window at a time).

OpenAI's rules (whisper/decoding.py: SuppressBlank, SuppressTokens, ApplyTimestampRules), expressed as up to
MAX_RANGES half-open intervals per window so one batched mask applies them all (batch_sampler.py). The rule
"sample a timestamp when timestamps together outweigh every text token" needs the logits: it is a flag here.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.speech.requests import TimestampState

MAX_RANGES = 6
MAX_INITIAL_TIMESTAMP_INDEX = 50  # the first timestamp at most 1.0 s into the window (OpenAI's default)


@dataclass(frozen=True)
class Forbidden:
    ranges: tuple[tuple[int, int], ...]  # [lo, hi) token ids
    timestamp_rule: bool  # apply "timestamps outweigh text: sample a timestamp"


def forbidden_next(state: TimestampState, timestamps: bool, eot: int, blank: tuple[int, ...], no_timestamps: int,
                   timestamp_begin: int, vocab: int) -> Forbidden:
    ranges: list[tuple[int, int]] = []
    first = state.sampled == 0
    if first:  # SuppressBlank: no leading space, no empty transcript
        ranges += [(t, t + 1) for t in blank] + [(eot, eot + 1)]
    if not timestamps:
        return Forbidden(tuple(ranges), False)
    ranges.append((no_timestamps, no_timestamps + 1))
    if state.last_was_timestamp:
        if state.penultimate_was_timestamp:  # a pair closed: text (or the end) must follow
            ranges.append((timestamp_begin, vocab))
        else:  # an opening timestamp: its closing one (or the end) must follow
            ranges.append((0, eot))
    if state.last_timestamp is not None:  # never backwards; a segment has a nonzero length
        closing = state.last_was_timestamp and not state.penultimate_was_timestamp
        ranges.append((timestamp_begin, state.last_timestamp if closing else state.last_timestamp + 1))
    if first:  # begin with a timestamp, at most 1 s in
        ranges.append((0, timestamp_begin))
        ranges.append((timestamp_begin + MAX_INITIAL_TIMESTAMP_INDEX + 1, vocab))
    return Forbidden(tuple(r for r in ranges if r[0] < r[1]), True)


def after_sampling(state: TimestampState, token: int, timestamp_begin: int, eot: int) -> None:
    """Update the window's state with the token it sampled."""
    is_timestamp = token >= timestamp_begin
    state.penultimate_was_timestamp = state.last_was_timestamp if state.sampled >= 1 else True
    state.last_was_timestamp = is_timestamp
    if is_timestamp:
        state.last_timestamp = token
    elif token < eot:
        state.text_tokens.append(token)
    state.sampled += 1

"""What every text-to-speech backend gives the service: a voice list, a sample rate, and the speech of a text as
pieces (a sentence at a time), so the first sentence can be encoded and sent while the next is synthesised."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator, Protocol

import numpy as np

# A piece of text synthesised in one model call: sentences, cut further at commas or spaces past this length.
MAX_PIECE_CHARS = 400
_SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+|\n+")


@dataclass(frozen=True)
class SpeechSpec:
    """One request's text, in the voice (one of the backend's `voices`) and at the speed (1.0: as trained) it asks."""

    text: str
    voice: str
    speed: float = 1.0


@dataclass
class SpokenPiece:
    samples: np.ndarray  # float32, mono, in [-1, 1], at the backend's sample_rate
    input_tokens: int  # what the model read (phoneme or text tokens)


class Synthesizer(Protocol):
    sample_rate: int
    voices: tuple[str, ...]  # the first is the default

    def pieces(self, spec: SpeechSpec) -> Iterator[SpokenPiece]:
        """The speech of spec.text, a piece at a time (each call to next() runs the model once)."""


def text_pieces(text: str, max_chars: int = MAX_PIECE_CHARS) -> list[str]:
    """The text as sentences, none longer than max_chars (a longer one is cut at its last comma or space)."""
    pieces = []
    for sentence in (s.strip() for s in _SENTENCE_END.split(text)):
        while len(sentence) > max_chars:
            cut = max(sentence.rfind(",", 0, max_chars), sentence.rfind(" ", 0, max_chars))
            cut = cut + 1 if cut > 0 else max_chars
            pieces.append(sentence[:cut].strip())
            sentence = sentence[cut:].strip()
        if sentence:
            pieces.append(sentence)
    return pieces

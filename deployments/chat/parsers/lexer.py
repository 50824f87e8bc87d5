"""Splits a text stream into plain text and markers, holding back only what could still be a marker.

Feeding any split of a text yields the same tokens (text pieces merged) as feeding it whole:
text is released as soon as no marker can start inside it, whatever the chunk boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Marker:
    text: str


Token = Text | Marker


class MarkerLexer:
    """Buffers fed text; `next(markers)` pops the next token given the markers active now.

    The caller may change the active markers between tokens (a parser's state decides which
    markers mean something), so nothing is tokenized ahead of time.
    """

    def __init__(self) -> None:
        self._buffer = ""
        self.finished = False

    def feed(self, text: str) -> None:
        self._buffer += text

    def finish(self) -> None:
        self.finished = True

    def next(self, markers: tuple[str, ...]) -> Token | None:
        """The next token, or None when more input is needed to decide (or nothing is left)."""
        buffer = self._buffer
        if not buffer:
            return None
        found = _earliest(buffer, markers)
        if found is not None and found[0] == 0:
            marker = found[1]
            if not self.finished and _longer_marker_possible(buffer, marker, markers):
                return None
            self._buffer = buffer[len(marker):]
            return Marker(marker)
        end = found[0] if found is not None else len(buffer)
        if found is None and not self.finished:
            end -= _partial_marker_suffix(buffer, markers)
        if end == 0:
            return None
        self._buffer = buffer[end:]
        return Text(buffer[:end])

    def tokens(self, markers_of_state: Callable[[], tuple[str, ...]]) -> Iterator[Token]:
        """The tokens available now, lazily: `markers_of_state()` is asked again before each token,
        after the caller has handled the previous one (and perhaps changed state)."""
        while (token := self.next(markers_of_state())) is not None:
            yield token


def _earliest(buffer: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for marker in markers:
        at = buffer.find(marker)
        if at >= 0 and (best is None or at < best[0] or (at == best[0] and len(marker) > len(best[1]))):
            best = (at, marker)
    return best


def _longer_marker_possible(buffer: str, found: str, markers: tuple[str, ...]) -> bool:
    """`found` starts the buffer, but a longer marker beginning with it may still be arriving."""
    return any(len(m) > len(found) and m.startswith(found) and m.startswith(buffer) for m in markers)


def _partial_marker_suffix(buffer: str, markers: tuple[str, ...]) -> int:
    """Length of the longest buffer suffix that is a proper prefix of some marker."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(buffer)), longest, -1):
            if buffer.endswith(marker[:size]):
                longest = size
                break
    return longest

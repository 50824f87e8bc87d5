"""Stop-string matching across token boundaries, with hold-back of partial matches."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopCheck:
    text: str  # safe to emit now
    stop: str | None = None  # the stop string that ended generation, if any


class StopStringMatcher:
    """Feed text pieces; text that might begin a stop string is held back until decided.

    A stop string is never emitted, nor is anything after it.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""

    def feed(self, text: str) -> StopCheck:
        if not self.stops:
            return StopCheck(text)
        buffer = self._held + text
        match = self._earliest_match(buffer)
        if match is not None:
            position, stop = match
            self._held = ""
            return StopCheck(buffer[:position], stop)
        hold = self._partial_suffix_length(buffer)
        self._held = buffer[len(buffer) - hold :] if hold else ""
        return StopCheck(buffer[: len(buffer) - hold])

    def flush(self) -> str:
        """At the end of generation, held text was not a stop after all."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, buffer: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.stops:
            position = buffer.find(stop)
            if position >= 0 and (best is None or position < best[0]):
                best = (position, stop)
        return best

    def _partial_suffix_length(self, buffer: str) -> int:
        """Length of the longest suffix of buffer that is a proper prefix of some stop."""
        longest = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if stop.startswith(buffer[-length:]):
                    longest = length
                    break
        return longest

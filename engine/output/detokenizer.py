"""Incremental detokenization with stop-string hold-back, one instance per request."""

from __future__ import annotations

from typing import Any

from engine.output.stop import StopCheck, StopStringMatcher


class IncrementalDetokenizer:
    """Wraps mlx-lm's streaming detokenizer (it picks the right one per tokenizer)."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]) -> None:
        self._detokenizer = tokenizer.detokenizer  # a fresh copy per access
        self._stops = StopStringMatcher(stops)

    def add_token(self, token_id: int) -> StopCheck:
        self._detokenizer.add_token(token_id)
        return self._stops.feed(self._detokenizer.last_segment)

    def finish(self) -> StopCheck:
        """Flush what the detokenizer and the stop matcher still hold."""
        self._detokenizer.finalize()
        check = self._stops.feed(self._detokenizer.last_segment)
        if check.stop is not None:
            return check
        return StopCheck(check.text + self._stops.flush())

"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the text's last n tokens.

An index per row maps every n-gram (min_match <= n <= max_match) to the position right after its latest
occurrence, updated as tokens arrive, so a proposal is a few dict lookups whatever the context length.
"""

from __future__ import annotations


class NgramIndex:
    def __init__(self, min_match: int, max_match: int) -> None:
        self.min_match = min_match
        self.max_match = max_match
        self.tokens: list[int] = []
        # n-gram -> e, the position after its latest occurrence tokens[e - n:e] with e < len(tokens)
        self._after: dict[tuple[int, ...], int] = {}

    def extend(self, token_ids) -> None:
        for token_id in token_ids:
            self._index_last_position()
            self.tokens.append(token_id)

    def _index_last_position(self) -> None:
        """Before a token is appended: the n-grams ending where it goes now have a known successor."""
        end = len(self.tokens)
        for n in range(self.min_match, min(self.max_match, end) + 1):
            self._after[tuple(self.tokens[end - n : end])] = end

    def match_end(self) -> int | None:
        """Where the continuation of the longest earlier match of the text's suffix starts (None: no match)."""
        tokens = self.tokens
        for n in range(min(self.max_match, len(tokens)), self.min_match - 1, -1):
            end = self._after.get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return end
        return None

    def propose(self, k: int) -> list[int]:
        """Up to k draft tokens; a match near the end repeats its own continuation (a periodic text)."""
        start = self.match_end()
        if start is None or k <= 0:
            return []
        period = len(self.tokens) - start
        return [self.tokens[start + i % period] for i in range(k)]

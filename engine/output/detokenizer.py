"""Incremental detokenization with stop-string hold-back, one instance per request.

The streamed text always equals `tokenizer.decode(all_ids, skip_special_tokens=True)`
(leading spaces kept, so /v1/completions concatenates correctly). Byte-level BPE
tokenizers (GPT-2, Llama 3, Qwen, SmolLM) use a precomputed id -> bytes table and
an incremental UTF-8 decoder; other tokenizers re-decode a short window of tokens.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from engine.token_bytes import byte_level_table, is_byte_level


class TextSource(Protocol):
    def add_token(self, token_id: int) -> str: ...

    def finalize(self) -> str: ...


class ByteLevelSource:
    def __init__(self, table: list[bytes]) -> None:
        self._table = table
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def add_token(self, token_id: int) -> str:
        piece = self._table[token_id] if token_id < len(self._table) else b""
        return self._utf8.decode(piece)

    def finalize(self) -> str:
        return self._utf8.decode(b"", final=True)


class WindowSource:
    """Any tokenizer: decode a sliding window and emit what it adds once the text is complete."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._decode_ids = _decoder(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_start = 0
        self._read_start = 0
        self._prefix_text = ""  # decode of ids[prefix_start:read_start], kept to decode once per token

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self._skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._decode(self._ids[self._prefix_start :])
        if len(text) <= len(self._prefix_text) or text.endswith("\ufffd"):
            return ""
        new_text = text[len(self._prefix_text) :]
        self._prefix_start, self._read_start = self._read_start, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_start : self._read_start])
        return new_text

    def finalize(self) -> str:
        text = self._decode(self._ids[self._prefix_start :])
        new_text = text[len(self._prefix_text) :]
        self._prefix_start = self._read_start = len(self._ids)
        self._prefix_text = ""
        return new_text


def _decoder(tokenizer: Any) -> Callable[..., str]:
    """The tokenizer's decode, or its Rust backend's where that returns the same text (no space clean-up): the
    Python wrapper cost ~10x the decode itself, twice per token (at 128 rows, a third of a CPU step's host time)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return backend.decode
    return tokenizer.decode


def text_source_factory(tokenizer: Any) -> Callable[[bool], TextSource]:
    """Built once per model: the id -> bytes tables (special tokens skipped or kept) are shared by
    every request; the one keeping special tokens is built when first asked for."""
    if is_byte_level(tokenizer):
        tables: dict[bool, list[bytes]] = {True: byte_level_table(tokenizer, True)}

        def byte_level(skip_special_tokens: bool = True) -> TextSource:
            if skip_special_tokens not in tables:
                tables[skip_special_tokens] = byte_level_table(tokenizer, skip_special_tokens)
            return ByteLevelSource(tables[skip_special_tokens])

        return byte_level
    return lambda skip_special_tokens=True: WindowSource(tokenizer, skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, source: TextSource, stops: tuple[str, ...]) -> None:
        self._source = source
        self._stops = StopStringMatcher(stops)

    def add_token(self, token_id: int) -> StopCheck:
        return self._stops.feed(self._source.add_token(token_id))

    def finish(self) -> StopCheck:
        """Flush what the decoder and the stop matcher still hold."""
        check = self._stops.feed(self._source.finalize())
        if check.stop is not None:
            return check
        return StopCheck(check.text + self._stops.flush())


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

"""Pages -> overlapping chunks of at most chunk_tokens tokens, by whole words, never across a page break."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import InvalidRequestError

from .extract import Page

TokenCounter = Callable[[str], int]
_WORD = re.compile(r"\S+")


@dataclass(frozen=True)
class ChunkParams:
    chunk_tokens: int = 200  # MiniLM reads 256 word pieces; room left for [CLS]/[SEP] and counting slack
    overlap_tokens: int = 40

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise InvalidRequestError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}", param="chunk_tokens")
        if not 0 <= self.overlap_tokens < self.chunk_tokens:
            raise InvalidRequestError(
                f"overlap_tokens must be in [0, chunk_tokens={self.chunk_tokens}), got {self.overlap_tokens}",
                param="overlap_tokens",
            )


@dataclass(frozen=True)
class Chunk:
    page: int
    index: int  # position in the whole document, from 0
    text: str
    char_start: int  # span within its page's text
    char_end: int


@dataclass(frozen=True)
class _Word:
    start: int
    end: int
    tokens: int


def distinct_words(pages: list[Page]) -> list[str]:
    """Every word of the pages once, in first-seen order: what chunk_pages asks the counter about."""
    return list(dict.fromkeys(m.group() for page in pages for m in _WORD.finditer(page.text)))


def chunk_pages(pages: list[Page], count_tokens: TokenCounter, params: ChunkParams = ChunkParams()) -> list[Chunk]:
    """Deterministic: the same pages, counter and params give the same chunks."""
    # Words repeat a lot; counting each distinct one once keeps a 1,000-page document fast.
    counts: dict[str, int] = {}

    def word_tokens(word: str) -> int:
        if word not in counts:
            counts[word] = max(1, count_tokens(word))
        return counts[word]

    chunks: list[Chunk] = []
    for page in pages:
        words = [_Word(m.start(), m.end(), word_tokens(m.group())) for m in _WORD.finditer(page.text)]
        for first, last in _windows(words, params):
            start, end = words[first].start, words[last].end
            chunks.append(Chunk(page.number, len(chunks), page.text[start:end], start, end))
    return chunks


def _windows(words: list[_Word], params: ChunkParams) -> list[tuple[int, int]]:
    """(first, last) word indexes of each chunk; a single word over the limit is a chunk of its own."""
    windows: list[tuple[int, int]] = []
    first = 0
    while first < len(words):
        last, total = first, words[first].tokens
        while last + 1 < len(words) and total + words[last + 1].tokens <= params.chunk_tokens:
            last += 1
            total += words[last].tokens
        windows.append((first, last))
        if last == len(words) - 1:
            break
        # The repeated tail leaves room for the next word, so every chunk brings something new.
        room = params.chunk_tokens - words[last + 1].tokens
        first = _overlap_start(words, first, last, min(params.overlap_tokens, room))
    return windows


def _overlap_start(words: list[_Word], first: int, last: int, overlap_tokens: int) -> int:
    """The next chunk repeats the previous chunk's tail of at most overlap_tokens, yet always moves forward."""
    start, tail = last + 1, 0
    while start - 1 > first and tail + words[start - 1].tokens <= overlap_tokens:
        start -= 1
        tail += words[start].tokens
    return start

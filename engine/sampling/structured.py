"""Structured output: token vocabularies, compiled guides (cached), and per-row guide state.

A GuidedDecoding becomes a regex (guided_regex.py), then an outlines-core Index over the
model's real token bytes, built in a child process under a memory cap and a deadline
(guide_builder.py). A build takes 0.01-5 s, so callers compile in a worker thread; the engine
thread only advances guides and writes bitmasks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from outlines_core import Guide, Index, Vocabulary

from engine.errors import InvalidRequestError
from engine.token_bytes import byte_level_table, is_byte_level
from engine.sampling.guide_builder import GuideBuildError, GuideBuilder
from engine.sampling.guided import GuidedDecoding
from engine.sampling.guided_regex import guided_regex

logger = logging.getLogger(__name__)
# Compiled guides kept per process, at most this many and this many bytes (an index over a 49k vocabulary took
# 0.3 MB for a small schema, 6 MB for any JSON object, 200 MB for a 1,024-character string).
INDEX_CACHE_SIZE = 32
INDEX_CACHE_BYTES = 1 << 30
# Child processes building indexes at once (the engine client's compile threads).
BUILD_WORKERS = 2
MASKS_PER_GUIDE = 64
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@dataclass(frozen=True)
class TokenVocabulary:
    """The model's tokens as bytes, as outlines-core sees them; `key` identifies the tokenizer."""

    vocabulary: Vocabulary
    eos_token_id: int
    mask_words: int  # int32 words of one row's bitmask (covers the model's whole vocabulary)
    key: str


def _sentencepiece_table(tokenizer: Any, size: int) -> list[bytes]:
    """SentencePiece: '▁' is a space and <0xNN> pieces are raw bytes."""
    table = []
    for token in tokenizer.convert_ids_to_tokens(list(range(size))):
        match = _BYTE_FALLBACK.match(token or "")
        table.append(bytes([int(match.group(1), 16)]) if match else (token or "").replace("\u2581", " ").encode())
    return table


def _is_sentencepiece(tokenizer: Any) -> bool:
    try:
        decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    except (AttributeError, ValueError):
        return False
    return decoder.get("type") == "Metaspace" or "\u2581" in json.dumps(decoder, ensure_ascii=False)


def _token_table(tokenizer: Any) -> list[bytes]:
    if is_byte_level(tokenizer):
        return byte_level_table(tokenizer)
    if _is_sentencepiece(tokenizer):
        return _sentencepiece_table(tokenizer, len(tokenizer))
    # Word-level and other vocabularies join tokens with text of their own: bytes are unknowable.
    raise InvalidRequestError(
        "Structured output needs a byte-level BPE or SentencePiece tokenizer; this model has neither",
        param="response_format",
    )


def build_vocabulary(tokenizer: Any, model_vocab_size: int, eos_token_ids: frozenset[int]) -> TokenVocabulary:
    """Every non-special token the model can emit, keyed by its bytes; EOS ends the output."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos not in eos_token_ids:
        eos = min(eos_token_ids)
    specials = {i for i, added in tokenizer.added_tokens_decoder.items() if added.special}
    by_bytes: dict[bytes, list[int]] = {}
    digest = hashlib.sha256(f"{eos}:{model_vocab_size}".encode())
    for token_id, piece in enumerate(_token_table(tokenizer)[:model_vocab_size]):
        if piece and token_id not in specials and token_id not in eos_token_ids:
            by_bytes.setdefault(piece, []).append(token_id)
            digest.update(token_id.to_bytes(4, "little") + piece)
    vocabulary = Vocabulary(eos, by_bytes)
    return TokenVocabulary(vocabulary, eos, (model_vocab_size + 31) // 32, digest.hexdigest()[:16])


_VOCABULARIES: "weakref.WeakKeyDictionary[Any, TokenVocabulary]" = weakref.WeakKeyDictionary()
_VOCABULARIES_LOCK = threading.Lock()


def vocabulary_for(tokenizer: Any, model_vocab_size: int, eos_token_ids: frozenset[int]) -> TokenVocabulary:
    """Built once per tokenizer object (~0.3 s for 50k tokens)."""
    with _VOCABULARIES_LOCK:
        found = _VOCABULARIES.get(tokenizer)
        if found is None:
            found = build_vocabulary(tokenizer, model_vocab_size, eos_token_ids)
            _VOCABULARIES[tokenizer] = found
        return found


@dataclass(frozen=True, eq=False)
class CompiledGuide:
    """A guided request's automaton over one vocabulary; shared by every request that asks for it."""

    index: Index
    eos_token_id: int
    mask_words: int
    size_bytes: int = 0  # the index's pickled size (the cache's byte bound)
    # Bitmask rows by automaton state, filled by the engine thread only: writing a state that allows
    # most of a 150k vocabulary (inside a string) costs ~0.3 ms; copying a cached row ~1 us.
    masks: dict[int, np.ndarray] = field(default_factory=dict)

    def mask_of(self, state: int, guide: Guide) -> np.ndarray:
        row = self.masks.get(state)
        if row is None:
            row = np.empty(self.mask_words, dtype=np.int32)
            guide.write_mask_into(row.ctypes.data, row.size, row.itemsize)
            if len(self.masks) < MASKS_PER_GUIDE:
                self.masks[state] = row
        return row


class _IndexCache:
    """Process-wide LRU of compiled guides keyed by (vocabulary key, kind, spec); one build per key."""

    def __init__(self, capacity: int, capacity_bytes: int) -> None:
        self.capacity = capacity
        self.capacity_bytes = capacity_bytes
        self._done: OrderedDict[tuple, CompiledGuide] = OrderedDict()
        self._building: dict[tuple, Future] = {}
        self._lock = threading.Lock()

    def get(self, key: tuple) -> CompiledGuide | None:
        with self._lock:
            index = self._done.get(key)
            if index is not None:
                self._done.move_to_end(key)
            return index

    def get_or_build(self, key: tuple, build) -> CompiledGuide:
        with self._lock:
            if key in self._done:
                self._done.move_to_end(key)
                return self._done[key]
            future = self._building.get(key)
            owner = future is None
            if owner:
                future = self._building[key] = Future()
        if not owner:
            return future.result()
        try:
            index = build()
        except BaseException as exc:
            future.set_exception(exc)
            raise
        finally:
            with self._lock:
                self._building.pop(key, None)
        with self._lock:
            self._done[key] = index
            while len(self._done) > self.capacity or (
                len(self._done) > 1 and sum(g.size_bytes for g in self._done.values()) > self.capacity_bytes
            ):
                self._done.popitem(last=False)
        future.set_result(index)
        return index


_INDEXES = _IndexCache(INDEX_CACHE_SIZE, INDEX_CACHE_BYTES)


@dataclass
class GuideCompileStats:
    """Guides this compiler built (cache misses, failed ones too) and the seconds the builds took."""

    compiles: int = 0
    seconds_total: float = 0.0


class GuideCompiler:
    """Turns GuidedDecoding specs into CompiledGuides for one model's tokenizer."""

    def __init__(self, tokenizer: Any, model_vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = model_vocab_size
        self._eos_token_ids = eos_token_ids
        self._stats = GuideCompileStats()
        self._stats_lock = threading.Lock()  # builds run in the compile pool's threads
        self._builder: GuideBuilder | None = None

    def stats(self) -> GuideCompileStats:
        with self._stats_lock:
            return GuideCompileStats(self._stats.compiles, self._stats.seconds_total)

    @property
    def vocabulary(self) -> TokenVocabulary:
        return vocabulary_for(self._tokenizer, self._vocab_size, self._eos_token_ids)

    def warm(self) -> None:
        """Build the vocabulary ahead of the first guided request (background; errors wait for it)."""
        try:
            self.vocabulary
        except InvalidRequestError:
            pass

    def cached(self, guided: GuidedDecoding) -> CompiledGuide | None:
        """The compiled guide if it is already built (never builds)."""
        with _VOCABULARIES_LOCK:
            vocab = _VOCABULARIES.get(self._tokenizer)
        if vocab is None:
            return None
        return _INDEXES.get((vocab.key, guided.kind, guided.spec))

    def compile(self, guided: GuidedDecoding) -> CompiledGuide:
        """Build (or reuse) the guide; 0.01-1 s on a miss, so call it off the engine thread."""
        regex = guided_regex(guided)
        vocab = self.vocabulary

        def timed_build() -> CompiledGuide:
            started = time.perf_counter()
            try:
                return self._build(guided, regex, vocab)
            finally:
                with self._stats_lock:
                    self._stats.compiles += 1
                    self._stats.seconds_total += time.perf_counter() - started

        return _INDEXES.get_or_build((vocab.key, guided.kind, guided.spec), timed_build)

    def _build(self, guided: GuidedDecoding, regex: str, vocab: TokenVocabulary) -> CompiledGuide:
        with self._stats_lock:
            if self._builder is None:
                self._builder = GuideBuilder(vocab.vocabulary, BUILD_WORKERS)
            builder = self._builder
        try:
            built = builder.build(regex, guided.param)
        except GuideBuildError as exc:  # bad regex syntax, or no token can start it
            raise InvalidRequestError(
                f"Invalid '{guided.param}': cannot build the output constraint ({exc})", param=guided.param
            ) from None
        return CompiledGuide(built.index, vocab.eos_token_id, vocab.mask_words, built.size_bytes)

    def close(self) -> None:
        """Stop the build processes (a later compile starts new ones)."""
        with self._stats_lock:
            builder, self._builder = self._builder, None
        if builder is not None:
            builder.close()


class GuideState:
    """One request's position in its guide; advanced with each token actually sampled."""

    def __init__(self, compiled: CompiledGuide, replay: Sequence[int] = ()) -> None:
        self.compiled = compiled
        self._guide = Guide(compiled.index, max_rollback=0)
        self.finished = False  # EOS sampled (or the guide was left): later masks allow anything
        for token_id in replay:  # a preempted request rejoining: catch up with what it already wrote
            self.advance(token_id)

    def advance(self, token_id: int) -> None:
        if self.finished:
            return
        if token_id == self.compiled.eos_token_id:
            self.finished = True
            return
        try:
            self._guide.advance(token_id, return_tokens=False)
        except (ValueError, RuntimeError) as exc:  # a token the mask did not allow: never expected
            logger.error("structured output: token %d left the guide (%s)", token_id, exc)
            self.finished = True

    def write_mask(self, row: np.ndarray) -> None:
        """Set the bits of the allowed next tokens in one row of an int32 bitmask (all ones if finished)."""
        if self.finished:
            row.fill(-1)
            return
        row[:] = self.compiled.mask_of(self._guide.get_state(), self._guide)


__all__ = ["CompiledGuide", "GuideCompiler", "GuideState", "TokenVocabulary", "build_vocabulary", "vocabulary_for"]

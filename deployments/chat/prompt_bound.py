"""The fewest tokens a text can take, from its length alone: a prompt that certainly exceeds the context is refused
before the chat template and the tokenizer run on it (a 31-million-character prompt cost the tokenizer ~7 GB and
50 s of CPU before the exact check refused it).

The bound: no token covers more characters than the longest entry of the vocabulary (added tokens included), so a
text of C characters takes at least ceil(C / longest) tokens, C counting neither the characters the tokenizer drops
nor those its normalizer may compose away. It holds only for tokenizers that cover every character by its bytes
(byte-level BPE, byte_fallback): `token_bound` returns None for the others (WordLevel or WordPiece, whose one
unknown-word token covers any length; normalizers or pre-tokenizers that delete text).
"""

from __future__ import annotations

import json
import math
import unicodedata
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from engine.errors import ContextLengthExceededError
from engine.token_bytes import bytes_to_unicode

# Unicode composition (NFC, NFKC) joins at most 4 code points into one (U+1F82's decomposition is the longest).
MAX_COMPOSED = 4
_COMPOSING = {"NFC": "NFC", "NFKC": "NFKC"}
# Normalizers that never shorten a text (decompositions, case mapping, prefixes).
_LENGTHENING = frozenset({"NFD", "NFKD", "Lowercase", "Prepend"})
# Bytes that valid UTF-8 holds (never 0xC0, 0xC1 or 0xF5-0xFF): a vocabulary may lack the others.
UTF8_BYTES = frozenset(range(0xC0)) | frozenset(range(0xC2, 0xF5))
# What an added token with lstrip/rstrip swallows next to it (Rust's char::is_whitespace), however long the run.
WHITESPACE = frozenset("\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000") | frozenset(
    chr(code) for code in range(0x2000, 0x200B))
# Pre-tokenizers that keep every character (Split and Punctuation only while their behavior is not "Removed").
_KEEPING = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"})


@dataclass(frozen=True)
class TokenBound:
    longest_token_chars: int  # the most characters of text one token covers
    composes: str | None = None  # the tokenizer's normalizer composes characters ("NFC" / "NFKC"), else None
    # Characters that become no token at all: ASCII bytes missing from a byte-level vocabulary (SmolLM2 has no
    # token for \x04, \x06, \x13, \x14, \x16 or \x1d and drops them).
    vanishing: frozenset[str] = frozenset()

    def chars(self, text: str) -> int:
        """The characters of `text` the bound may count: those neither dropped nor removed by composition."""
        kept = len(text) - sum(text.count(char) for char in self.vanishing)
        if self.composes is None or text.isascii():
            return kept
        if unicodedata.is_normalized(self.composes, text):  # only leading marks may join the text before it
            return max(0, kept - (MAX_COMPOSED - 1))
        return kept // MAX_COMPOSED

    def min_tokens(self, texts: Iterable[str]) -> tuple[int, int]:
        """(the fewest tokens these texts take together, the characters counted)."""
        chars = sum(self.chars(text) for text in texts)
        return math.ceil(chars / self.longest_token_chars), chars


@dataclass(frozen=True)
class PromptLimit:
    """A model's context against the bound: refuses, in milliseconds, a prompt that cannot fit."""

    bound: TokenBound
    context_length: int

    def check(self, texts: Iterable[str], param: str) -> None:
        at_least, chars = self.bound.min_tokens(texts)
        if at_least > self.context_length:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.context_length} tokens, but the prompt takes at "
                f"least {at_least} tokens ({chars} characters; no token covers more than "
                f"{self.bound.longest_token_chars})",
                param=param,
            )

    def exceeds(self, text: str, tokens: int) -> bool:
        """Whether `text` certainly takes more than `tokens` tokens."""
        return self.bound.min_tokens([text])[0] > tokens


def message_texts(messages: list[dict[str, Any]]) -> Iterator[str]:
    """The messages' content text (strings, and text parts): every chat template shows it, so it is certainly in
    the rendered prompt (tool definitions and past reasoning may be dropped or shortened, so they are not)."""
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    yield part["text"]


def prompt_limit(tokenizer: Any, context_length: int) -> PromptLimit | None:
    bound = token_bound(tokenizer)
    return PromptLimit(bound, context_length) if bound is not None else None


def token_bound(tokenizer: Any) -> TokenBound | None:
    """The bound for this tokenizer (a Hugging Face fast tokenizer, or mlx-lm's wrapper of one); None where its
    pieces cannot give one."""
    try:
        spec = json.loads(tokenizer.backend_tokenizer.to_str())
    except (AttributeError, ValueError):
        return None
    model, added = spec.get("model") or {}, spec.get("added_tokens") or []
    ok, composes = _normalizer(spec.get("normalizer"))
    vanishing = _vanishing_characters(model, spec)
    if not (ok and _keeps_text(spec.get("pre_tokenizer"))) or vanishing is None:
        return None
    if any(token.get("lstrip") or token.get("rstrip") for token in added):  # Phi-3's specials eat whitespace
        vanishing |= WHITESPACE
    longest = max(_entry_lengths(model, added), default=0)
    return TokenBound(longest, composes, vanishing) if longest > 0 else None


def _normalizer(spec: dict[str, Any] | None) -> tuple[bool, str | None]:
    """(whether it never deletes text, the composition form it applies if any)."""
    if spec is None:
        return True, None
    kind = spec.get("type")
    if kind == "Sequence":
        parts = [_normalizer(part) for part in spec.get("normalizers") or []]
        forms = [form for _, form in parts if form is not None]
        # Two compositions in a row still join at most MAX_COMPOSED code points: the first form stands for both.
        return all(ok for ok, _ in parts), forms[0] if forms else None
    if kind in _COMPOSING:
        return True, _COMPOSING[kind]
    if kind == "Replace":  # a literal replaced by one at least as long (SentencePiece's " " -> "▁")
        pattern, content = (spec.get("pattern") or {}).get("String"), spec.get("content")
        return isinstance(pattern, str) and isinstance(content, str) and len(content) >= len(pattern), None
    return kind in _LENGTHENING, None


def _keeps_text(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    if spec.get("type") == "Sequence":
        return all(_keeps_text(part) for part in spec.get("pretokenizers") or [])
    return spec.get("type") in _KEEPING and spec.get("behavior") != "Removed"


def _vanishing_characters(model: dict[str, Any], spec: dict[str, Any]) -> frozenset[str] | None:
    """The characters that become no token, where every other character becomes tokens of its own bytes: a
    byte-level vocabulary, or a model falling back to byte tokens. None where a character may become no token or
    share one unknown token with any number of others (fuse_unk): the bound would not hold."""
    vocab = model.get("vocab") or {}
    entries = set(vocab) if isinstance(vocab, dict) else {entry[0] for entry in vocab}  # Unigram: [piece, score]
    if model.get("byte_fallback"):
        covered = model.get("type") in ("BPE", "Unigram") and all(f"<0x{b:02X}>" in entries for b in UTF8_BYTES)
        return frozenset() if covered else None
    byte_level = any(part.get("type") == "ByteLevel" for part in _flattened(spec.get("pre_tokenizer")))
    if model.get("type") != "BPE" or not byte_level:
        return None
    missing = {byte for byte, char in bytes_to_unicode().items() if byte in UTF8_BYTES and char not in entries}
    if any(byte >= 0x80 for byte in missing if byte < 0xC0):  # a continuation byte: whole characters could vanish
        return None
    # A missing lead byte (SmolLM2's 0xF1) leaves its character's continuation bytes; a missing ASCII byte drops it.
    return frozenset(chr(byte) for byte in missing if byte < 0x80)


def _flattened(spec: dict[str, Any] | None) -> list[dict[str, Any]]:
    if spec is None:
        return []
    if spec.get("type") == "Sequence":
        return [leaf for part in spec.get("pretokenizers") or [] for leaf in _flattened(part)]
    return [spec]


def _entry_lengths(model: dict[str, Any], added: list[dict[str, Any]]) -> Iterator[int]:
    """The characters each entry covers, at most: a byte-level entry's string has one character per byte (a text's
    character is one or more bytes), SentencePiece's "▁" is one space, a byte-fallback "<0x0A>" over-counts."""
    vocab = model.get("vocab") or {}
    entries = vocab.keys() if isinstance(vocab, dict) else (entry[0] for entry in vocab)  # Unigram: [piece, score]
    yield from (len(entry) for entry in entries)
    yield from (len(token.get("content") or "") for token in added)

"""Token ids to bytes for byte-level BPE vocabularies (GPT-2, Llama 3, Qwen, SmolLM): what the detokenizer
streams and what structured-output automata match, from one table per model (plain Python, no MLX)."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {byte: chr(code) for byte, code in zip(printable, codes)}


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    return {char: byte for byte, char in bytes_to_unicode().items()}


def _token_bytes(token: str) -> bytes:
    table = _unicode_to_byte()
    return b"".join(bytes([table[ch]]) if ch in table else ch.encode("utf-8") for ch in token)


def is_byte_level(tokenizer: Any) -> bool:
    try:
        decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    except (AttributeError, ValueError):
        return False
    return decoder.get("type") == "ByteLevel"


def byte_level_table(tokenizer: Any, skip_special_tokens: bool = True) -> list[bytes]:
    size = len(tokenizer)
    table = [_token_bytes(t or "") for t in tokenizer.convert_ids_to_tokens(list(range(size)))]
    for token_id, added in tokenizer.added_tokens_decoder.items():
        if token_id < size:
            table[token_id] = b"" if added.special and skip_special_tokens else added.content.encode("utf-8")
    return table

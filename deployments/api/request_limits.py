"""What every API's request body is held to before its fields are read: counts, 32-bit numbers, valid Unicode, and
the lengths of the strings a response echoes or the Responses store keeps that are not prompt content.

The counts are far above what real clients send (Claude Code: hundreds of messages, 20-60 tools; OpenAI: 4 stop
strings), so only a runaway or hostile body meets them. Prompt content needs no length here: the context check
bounds it. Ids and keys do (a 7 MB `user` cost 7 MB per stored response, echoed in every answer), generously: OpenAI
caps prompt_cache_key and safety_identifier at 64 characters, yet clients built for other servers send a session id
and a suffix (69-97 characters), and Claude Code's metadata.user_id is a JSON string of about 150.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import Field

from engine.errors import InvalidRequestError
from engine.sampling.params import INT32_MAX

MAX_MESSAGES = 10_000
MAX_TOOLS = 1_024
MAX_STOP_STRINGS = 64  # OpenAI's stop, Anthropic's stop_sequences
MAX_SYSTEM_BLOCKS = 1_024  # Anthropic's system as a list of text blocks
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seed: any int64 (the engine reduces it to 32 bits)
# user, prompt_cache_key, safety_identifier, previous_response_id, service_tier, metadata.user_id, container, ...
MAX_ID_CHARS = 512
# OpenAI's documented bounds on `metadata` (Responses, chat completions).
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512

IdString = Annotated[str, Field(max_length=MAX_ID_CHARS)]  # pydantic's error names the field: 400 with its `param`

_SURROGATE = re.compile("[\ud800-\udfff]")


def at_most(values: Any, limit: int, what: str) -> Any:
    """A pydantic field check for list members of unions (whose own max_length errors would name the member)."""
    if isinstance(values, list) and len(values) > limit:
        raise ValueError(f"at most {limit} {what} are allowed, got {len(values)}")
    return values


def at_most_chars(value: Any, limit: int, param: str) -> Any:
    """A length check naming `param`, for a string inside a union (whose own max_length error would name the member)."""
    if isinstance(value, str) and len(value) > limit:
        raise InvalidRequestError(f"Invalid '{param}': at most {limit} characters are allowed, got {len(value)}",
                                  param=param)
    return value


def bounded_metadata(metadata: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's bounds on `metadata`. Checked here rather than by pydantic's constraints, whose error for a long key
    would put the key itself, however long, in the field's name."""
    if metadata is None:
        return None
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequestError(f"Invalid 'metadata': at most {MAX_METADATA_PAIRS} key-value pairs are allowed, "
                                  f"got {len(metadata)}", param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise InvalidRequestError(f"Invalid 'metadata': a key has {len(key)} characters, at most "
                                      f"{MAX_METADATA_KEY_CHARS} are allowed", param="metadata")
        at_most_chars(value, MAX_METADATA_VALUE_CHARS, f"metadata.{key}")
    return metadata


def refuse_invalid_unicode(body: Any) -> Any:
    """Refuse a body holding a lone UTF-16 surrogate, naming the first field that does.

    json.loads keeps an unpaired escape such as "\\ud800" as a Python str that no UTF-8 encoder accepts: the
    tokenizer and every response writer would fail on it. InvalidRequestError is not a ValueError, so pydantic
    lets it through as it is and the error handler answers 400 with its `param`.
    """
    pending: list[tuple[tuple[str | int, ...], Any]] = [((), body)]
    while pending:  # a loop, not recursion: JSON nested near the parser's depth limit stays within Python's
        path, value = pending.pop()
        if isinstance(value, str):
            if not value.isascii() and _SURROGATE.search(value):
                _refuse(path, "the text is not valid Unicode")
        elif isinstance(value, dict):
            children = []
            for key, item in value.items():
                if isinstance(key, str) and not key.isascii() and _SURROGATE.search(key):
                    _refuse(path, "a key is not valid Unicode")
                children.append(((*path, key), item))
            pending.extend(reversed(children))  # popped in document order, so the first bad field is named
        elif isinstance(value, list):
            pending.extend(reversed([((*path, index), item) for index, item in enumerate(value)]))
    return body


def _refuse(path: tuple[str | int, ...], problem: str) -> None:
    param = ".".join(str(part) for part in path) or "body"
    raise InvalidRequestError(f"Invalid '{param}': {problem} (it holds a lone surrogate such as \\ud800)", param=param)


__all__ = [
    "INT32_MAX", "INT64_MAX", "INT64_MIN", "MAX_ID_CHARS", "MAX_MESSAGES", "MAX_METADATA_KEY_CHARS",
    "MAX_METADATA_PAIRS", "MAX_METADATA_VALUE_CHARS", "MAX_STOP_STRINGS", "MAX_SYSTEM_BLOCKS", "MAX_TOOLS", "IdString",
    "at_most", "at_most_chars", "bounded_metadata", "refuse_invalid_unicode",
]

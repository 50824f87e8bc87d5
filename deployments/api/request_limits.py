"""What every API's request body is held to before its fields are read: counts, 32-bit numbers, valid Unicode.

The counts are far above what real clients send (Claude Code: hundreds of messages, 20-60 tools; OpenAI: 4 stop
strings), so only a runaway or hostile body meets them.
"""

from __future__ import annotations

import re
from typing import Any

from engine.errors import InvalidRequestError
from engine.sampling.params import INT32_MAX

MAX_MESSAGES = 10_000
MAX_TOOLS = 1_024
MAX_STOP_STRINGS = 64  # OpenAI's stop, Anthropic's stop_sequences
MAX_SYSTEM_BLOCKS = 1_024  # Anthropic's system as a list of text blocks
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seed: any int64 (the engine reduces it to 32 bits)

_SURROGATE = re.compile("[\ud800-\udfff]")


def at_most(values: Any, limit: int, what: str) -> Any:
    """A pydantic field check for list members of unions (whose own max_length errors would name the member)."""
    if isinstance(values, list) and len(values) > limit:
        raise ValueError(f"at most {limit} {what} are allowed, got {len(values)}")
    return values


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
    "INT32_MAX", "INT64_MAX", "INT64_MIN", "MAX_MESSAGES", "MAX_STOP_STRINGS", "MAX_SYSTEM_BLOCKS", "MAX_TOOLS",
    "at_most", "refuse_invalid_unicode",
]

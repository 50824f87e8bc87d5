"""Forward-compatible parsing: clients (Claude Code, Codex, the SDKs) add top-level request fields with every
release, and refusing them broke every user at each upgrade. A top-level field we do not know is accepted and
ignored: logged once per name, counted in /v1/queue/stats. A field we know would change the answer and cannot
honour keeps a 400 naming it."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

from engine.errors import InvalidRequestError

logger = logging.getLogger("ray.serve.orchard")

# Fields that would change the answer, which Orchard cannot honour (yet): why each is refused.
UNHONOURED = {
    "openai": {
        "functions": "legacy function calling is not supported: send 'tools'",
        "function_call": "legacy function calling is not supported: send 'tool_choice'",
        "audio": "audio output is not supported",
    },
    "anthropic": {},
    "rag": {},
    "responses": {
        "conversation": "the Conversations API is not supported: chain responses with 'previous_response_id'",
        "prompt": "stored prompt templates are not supported: send 'instructions' and 'input'",
    },
}

_counts: Counter[str] = Counter()
_lock = threading.Lock()  # the routes run on one loop, but tests and tools may parse from threads


def accept_unknown_fields(api: str, extra: dict[str, Any] | None) -> None:
    """Check a request's unknown top-level fields (pydantic's model_extra): refuse an unhonourable one,
    record the others as ignored."""
    for name, value in (extra or {}).items():
        _refuse_if_unhonoured(api, name, value)
        if _count(f"{api}.{name}"):
            logger.info("ignoring the unknown request field '%s' (%s API): it does not change the answer", name, api)


def accept_unknown_type(api: str, where: str, type_name: str) -> None:
    """The same rule one level down: an input item or content part of a type we do not know (a newer client's)
    is ignored, logged once per type, counted as "api.where:type"."""
    if _count(f"{api}.{where}:{type_name}"):
        logger.info("ignoring %s of the unknown type '%s' (%s API): it does not change the answer",
                    where, type_name, api)


def _count(key: str) -> bool:
    """Count one more use of `key`; True the first time."""
    with _lock:
        first = key not in _counts
        _counts[key] += 1
    return first


def _refuse_if_unhonoured(api: str, name: str, value: Any) -> None:
    why = UNHONOURED[api].get(name)
    if why is not None and value is not None:
        raise InvalidRequestError(f"'{name}': {why}", param=name)
    text_only = isinstance(value, list) and all(m == "text" for m in value)
    if name == "modalities" and value is not None and not text_only:  # OpenAI's output kinds
        raise InvalidRequestError("'modalities': only [\"text\"] can be produced", param=name)


def ignored_field_counts() -> dict[str, int]:
    """How many requests carried each ignored field since this process started ("api.field" -> count)."""
    with _lock:
        return dict(sorted(_counts.items()))

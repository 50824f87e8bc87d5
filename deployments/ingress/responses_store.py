"""Stored Responses (`store: true`, OpenAI's default) for GET / DELETE /v1/responses/{id} and previous_response_id.

In the ingress's memory: one ingress replica serves them (the default; with several replicas a chained request may
reach one that never saw its previous response). Bounded by count and by bytes (a request may carry 32 MiB of images:
a thousand such would fill the machine), least recently used first out, and by a time to live counted from the last
use, so a conversation in progress keeps its chain while idle ones expire. A response larger than the whole byte
bound is answered but not stored. Its bytes are what it holds: the Response object as JSON (output and echoed request
fields: instructions, tools, metadata, user, prompt_cache_key, ...), its items as JSON, and each item's and content
part's own weight as Python objects.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deployments.api.errors import PreviousResponseNotFoundError, ResponseNotFoundError
from deployments.api.responses_schemas import INPUT_ITEMS, InputItem

logger = logging.getLogger("ray.serve.orchard")
DEFAULT_MAX_RESPONSES = 1_000
DEFAULT_MAX_BYTES = 256 << 20
DEFAULT_TTL_S = 24 * 3600.0
# What an input item or content part weighs beyond its JSON: a pydantic model with its __dict__, its set of fields
# and the headers of its short strings (430-525 bytes measured, pydantic 2.14). A body of a million empty text parts
# is 32 MB of JSON, no tokens at all, and half a gigabyte held: counted by JSON alone it would pass as 32 MB.
ITEM_OBJECT_BYTES = 640


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the Response object as it was answered
    items: list[InputItem]  # its request's own input items, then its output as input items
    previous_id: str | None  # the response it continued: its items come before these
    used_at: float
    size_bytes: int  # what it holds, near enough (stored_size)


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.stored_bytes = 0
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response: dict[str, Any], input_items: list[InputItem], previous_id: str | None) -> None:
        # Output items are valid input items (message, function_call, reasoning): the next turn reads them back.
        items = [*input_items, *INPUT_ITEMS.validate_python(response["output"])]
        size = stored_size(response, items)
        if size > self.max_bytes:
            logger.warning("response %s not stored: %d bytes, over the store's %d", response["id"], size, self.max_bytes)
            return
        self._drop(response["id"])
        self._entries[response["id"]] = StoredResponse(response, items, previous_id, self._clock(), size)
        self.stored_bytes += size
        self._expire()

    def get(self, response_id: str) -> dict[str, Any]:
        return self._use(response_id).response

    def delete(self, response_id: str) -> None:
        self._expire()
        if self._drop(response_id) is None:
            raise ResponseNotFoundError(f"Response with id '{response_id}' not found.")

    def history(self, response_id: str) -> list[InputItem]:
        """The conversation up to and including `response_id`: every input and output item of its chain."""
        chain: list[list[InputItem]] = []
        current: str | None = response_id
        while current is not None:
            try:
                entry = self._use(current)
            except ResponseNotFoundError:
                expired = "" if current == response_id else f" (its earlier response '{current}' is gone)"
                raise PreviousResponseNotFoundError(
                    f"Previous response with id '{response_id}' not found.{expired}", param="previous_response_id"
                ) from None
            chain.append(entry.items)
            current = entry.previous_id
        return [item for items in reversed(chain) for item in items]

    def _use(self, response_id: str) -> StoredResponse:
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None:
            raise ResponseNotFoundError(f"Response with id '{response_id}' not found.")
        entry.used_at = self._clock()
        self._entries.move_to_end(response_id)
        return entry

    def _drop(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.stored_bytes -= entry.size_bytes
        return entry

    def _expire(self) -> None:
        deadline = self._clock() - self.ttl_s
        while self._entries and (
            len(self._entries) > self.max_responses or self.stored_bytes > self.max_bytes
            or next(iter(self._entries.values())).used_at < deadline
        ):
            self._drop(next(iter(self._entries)))


def stored_size(response: dict[str, Any], items: list[InputItem]) -> int:
    """The bytes a stored response holds, near enough: its JSON, and the weight of its items' objects. Counted in
    O(items), not O(parts): a part list's length is enough, and this runs on the ingress's event loop."""
    objects = sum(1 + sum(len(value) for value in vars(item).values() if isinstance(value, list)) for item in items)
    return len(json.dumps(response)) + len(INPUT_ITEMS.dump_json(items)) + ITEM_OBJECT_BYTES * objects

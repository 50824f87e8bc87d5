"""The per-request single-slot mailbox: what arrived since the consumer last took, merged into one item.

Pending is the one merge helper for streamed items (the engine's RequestOutputs in the engine clients; StreamChunks
on the serving side, deployments/transport): while the consumer is behind, what arrives merges into one item, so a
slow consumer wakes once for many steps instead of once per token. Plain asyncio, no engine imports: both sides
import it.
"""

from __future__ import annotations

import asyncio
from typing import Generic, Protocol, TypeVar


class Mergeable(Protocol):
    @property
    def is_last(self) -> bool: ...

    def merge(self, later: "Mergeable") -> None: ...


T = TypeVar("T", bound=Mergeable)


def merged(current: T | None, later: T) -> T:
    """`later` appended to `current` (which is changed in place), or `later` where there is nothing yet."""
    if current is None:
        return later
    current.merge(later)
    return current


class Pending(Generic[T]):
    """What arrived since the consumer last took, merged into one item."""

    def __init__(self) -> None:
        self._item: T | None = None
        self.ready = asyncio.Event()
        self._ended = asyncio.Event()

    def add(self, item: T) -> None:
        self._item = merged(self._item, item)
        self.ready.set()
        if item.is_last:
            self._ended.set()

    @property
    def ended(self) -> bool:
        """The last item has arrived (taken or not)."""
        return self._ended.is_set()

    def take(self) -> T:
        item, self._item = self._item, None
        self.ready.clear()
        assert item is not None
        return item

    async def wait_end(self, timeout_s: float | None) -> None:
        """Return when the last item has arrived, or after timeout_s (None: no limit)."""
        if self.ended:
            return
        try:
            await asyncio.wait_for(self._ended.wait(), timeout_s)
        except TimeoutError:
            pass

"""The asyncio side of an engine client's streams: one Pending slot per request, filled a step at a time.

Pending is the one merge helper for streamed items (here the engine's RequestOutputs; on the serving side
StreamChunks): while the consumer is behind, what arrives merges into one item, so a slow consumer wakes
once for many steps instead of once per token.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, Generic, Protocol, TypeVar

from engine.errors import InvalidRequestError, OrchardError
from engine.output.request_output import Finish, RequestOutput, TextDelta


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


class RequestStream:
    """Async iterator of TextDelta items then one Finish; raises the request's OrchardError.

    Closing it early (client gone) aborts the request through `abort`.
    """

    def __init__(self, request_id: str, pending: Pending[RequestOutput], abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._pending = pending
        self._abort = abort

    def __aiter__(self) -> AsyncIterator[TextDelta | Finish]:
        return self._iterate()

    async def hold(self, timeout_s: float | None) -> None:
        """Wait until the request ends or timeout_s passes, taking nothing: meanwhile the engine's
        outputs merge, so a consumer that holds between reads wakes once, not per token."""
        await self._pending.wait_end(timeout_s)

    async def _iterate(self) -> AsyncIterator[TextDelta | Finish]:
        ended = False
        try:
            while not ended:
                await self._pending.ready.wait()
                output = self._pending.take()
                ended = output.is_last
                if output.delta is not None:
                    yield output.delta
                if output.error is not None:
                    raise output.error
                if output.finish is not None:
                    yield output.finish
        finally:
            if not ended:
                self._abort(self.request_id)


class StreamRouter:
    """Request id -> its Pending slot; a step's outputs are routed in one call."""

    def __init__(self) -> None:
        self._pending: dict[str, Pending[RequestOutput]] = {}

    def open(self, request_id: str, abort: Callable[[str], None]) -> RequestStream:
        if request_id in self._pending:
            raise InvalidRequestError(f"Duplicate request id '{request_id}'", param="request_id")
        pending = self._pending[request_id] = Pending()
        return RequestStream(request_id, pending, abort)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            pending = self._pending.get(output.request_id)
            if pending is None:
                continue
            pending.add(output)
            if output.is_last:
                del self._pending[output.request_id]

    def fail_all(self, error: OrchardError) -> None:
        for request_id, pending in self._pending.items():
            pending.add(RequestOutput(request_id, error=error))
        self._pending.clear()

"""Per-request single-slot mailbox on the asyncio side.

The engine thread posts outputs; while the consumer is behind, deltas merge into
one, so a slow consumer (or a Ray handle stream) gets fewer, larger items.
"""

from __future__ import annotations

import asyncio

from engine.errors import OrchardError
from engine.output.events import Finish, RequestOutput, TextDelta


class Mailbox:
    def __init__(self) -> None:
        self._delta: TextDelta | None = None
        self._finish: Finish | None = None
        self._error: OrchardError | None = None
        self._ready = asyncio.Event()
        self._ended = asyncio.Event()
        self.closed = False

    def put(self, output: RequestOutput) -> None:
        if output.delta is not None:
            if self._delta is None:
                self._delta = output.delta
            else:
                self._delta.merge(output.delta)
        if output.finish is not None:
            self._finish = output.finish
        if output.error is not None:
            self._error = output.error
        self._ready.set()
        if self.has_ended:
            self._ended.set()

    def put_error(self, error: OrchardError) -> None:
        self._error = error
        self._ready.set()
        self._ended.set()

    async def wait_end(self, timeout_s: float | None) -> None:
        """Return when the request has ended (finish or error) or after timeout_s (None: no limit)."""
        if self.has_ended:
            return
        try:
            await asyncio.wait_for(self._ended.wait(), timeout_s)
        except TimeoutError:
            pass

    @property
    def has_ended(self) -> bool:
        return self._finish is not None or self._error is not None

    async def take(self) -> TextDelta | Finish:
        """Next item: merged delta first, then the finish; raises the request's error."""
        await self._ready.wait()
        if self._delta is not None:
            delta, self._delta = self._delta, None
            if not self.has_ended:
                self._ready.clear()
            return delta
        self.closed = True
        if self._error is not None:
            raise self._error
        assert self._finish is not None
        return self._finish

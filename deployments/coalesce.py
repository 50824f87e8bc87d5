"""Time-coalescing of a request's stream: first chunk at once, then at most one chunk per window.

A Ray handle stream carries only ~2,000 items/s in total (DESIGN.md), while batched decoding
makes several thousand tokens/s; sending one item per engine step would make Ray the bottleneck.
Given a `hold` (the engine stream's), the source is also read only once per window: the engine's
mailbox merges the deltas meanwhile, so the replica's event loop does not wake for every token of
every stream (which took the GIL from the engine thread: HTTP ran at 0.69x the in-process rate).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Awaitable, Callable

from deployments.protocol import StreamChunk


class PendingChunk:
    """What arrived since the last chunk was sent, merged into one."""

    def __init__(self) -> None:
        self._chunk: StreamChunk | None = None
        self.ready = asyncio.Event()

    def add(self, chunk: StreamChunk) -> None:
        if self._chunk is None:
            self._chunk = chunk
        else:
            self._chunk.merge(chunk)
        self.ready.set()

    @property
    def ended(self) -> bool:
        return self._chunk is not None and self._chunk.is_last

    def take(self) -> StreamChunk:
        chunk, self._chunk = self._chunk, None
        self.ready.clear()
        assert chunk is not None
        return chunk


Hold = Callable[[float | None], Awaitable[None]]


async def _pump(
    source: AsyncIterator[StreamChunk], pending: PendingChunk, window_s: Callable[[], float | None], hold: Hold | None
) -> None:
    async with contextlib.aclosing(source):
        async for chunk in source:
            pending.add(chunk)
            if chunk.is_last:
                return
            if hold is not None:  # until the window is over or the request ends (None: until it ends)
                await hold(window_s())


async def coalesce(
    source: AsyncIterator[StreamChunk], window_s: Callable[[], float | None], hold: Hold | None = None
) -> AsyncIterator[StreamChunk]:
    """Re-chunk `source` by time. window_s() None: a single chunk at the end.

    Closing this iterator early cancels the pump, which closes `source` (aborting the request).
    """
    pending = PendingChunk()
    pump = asyncio.create_task(_pump(source, pending, window_s, hold))
    loop = asyncio.get_running_loop()
    sent_at: float | None = None
    try:
        while True:
            await _wait_ready(pending, pump)
            window = window_s()
            if not pending.ended:
                if window is None:
                    pending.ready.clear()  # keep merging until the last chunk arrives
                    continue
                if sent_at is not None:  # the first chunk goes at once (time to first token)
                    await asyncio.sleep(max(0.0, sent_at + window - loop.time()))
            chunk = pending.take()
            sent_at = loop.time()
            yield chunk
            if chunk.is_last:
                return
    finally:
        pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pump


async def _wait_ready(pending: PendingChunk, pump: asyncio.Task) -> None:
    """Wait for data; if the source ended without a last chunk, re-raise its failure."""
    waiter = asyncio.ensure_future(pending.ready.wait())
    try:
        await asyncio.wait({waiter, pump}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if not pending.ready.is_set():
        pump.result()  # raises the pump's exception, if any
        raise RuntimeError("the model's stream ended without a finish event")

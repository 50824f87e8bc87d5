"""Time-coalescing of a request's stream on the model replica: first chunk at once, then at most one per window.
An admission chunk (the request queued or taken in, no output yet) starts no window: the first output after it is
still a first chunk (time to first token). It waits up to ADMISSION_GRACE_S for what follows it, so that a short
prompt's stream opens with one chunk, not three.

A Ray handle stream carries only ~2,000 items/s in total (docs/decisions.md, "Coalescing"), while batched decoding
makes several thousand tokens/s; one item per engine step would make Ray (or the channel's frames) the bottleneck.
Given a `hold` (the engine stream's), the source is also read only once per window: the engine's outputs merge
meanwhile, so the replica's event loop does not wake for every token of every stream (which took the GIL
from the engine thread: HTTP ran at 0.69x the in-process rate).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Awaitable, Callable

from engine.mailbox import Pending
from deployments.model_calls import StreamChunk

Hold = Callable[[float | None], Awaitable[None]]
# How long an admission chunk waits to merge with what follows (the admission of a queued request, its first output):
# every chunk costs ~1-2 ms of CPU across replica, ingress and proxy, and a short reply is only a handful of chunks at
# 256 streams (a window of ~1 s). A stream that opens this much later loses nothing.
ADMISSION_GRACE_S = 0.05


async def _pump(
    source: AsyncIterator[StreamChunk], pending: Pending[StreamChunk], window_s: Callable[[], float | None],
    hold: Hold | None,
) -> None:
    async with contextlib.aclosing(source):
        async for chunk in source:
            pending.add(chunk)
            if chunk.is_last:
                return
            if hold is not None and not chunk.is_admission_only:
                await hold(window_s())  # until the window is over or the request ends (None: until it ends)


async def coalesce(
    source: AsyncIterator[StreamChunk], window_s: Callable[[], float | None], hold: Hold | None = None
) -> AsyncIterator[StreamChunk]:
    """Re-chunk `source` by time. window_s() None: a single chunk at the end.

    Closing this iterator early cancels the pump, which closes `source` (aborting the request).
    """
    pending: Pending[StreamChunk] = Pending()
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
            if chunk.is_admission_only:
                chunk = await _with_what_follows(chunk, pending, pump, loop.time() + ADMISSION_GRACE_S)
            if not chunk.is_admission_only:
                sent_at = loop.time()
            yield chunk
            if chunk.is_last:
                return
    finally:
        pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pump


async def _with_what_follows(
    chunk: StreamChunk, pending: Pending[StreamChunk], pump: asyncio.Task, deadline: float
) -> StreamChunk:
    """The admission chunk merged with what arrives before `deadline`, until it holds output (sent at once then)."""
    loop = asyncio.get_running_loop()
    while chunk.is_admission_only and (remaining := deadline - loop.time()) > 0:
        waiter = asyncio.ensure_future(pending.ready.wait())
        try:
            await asyncio.wait({waiter, pump}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if not pending.ready.is_set():
            break  # nothing came in time, or the source ended (the next _wait_ready tells why)
        chunk.merge(pending.take())
    return chunk


async def _wait_ready(pending: Pending[StreamChunk], pump: asyncio.Task) -> None:
    """Wait for data; if the source ended without a last chunk, re-raise its failure."""
    waiter = asyncio.ensure_future(pending.ready.wait())
    try:
        await asyncio.wait({waiter, pump}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if not pending.ready.is_set():
        pump.result()  # raises the pump's exception, if any
        raise RuntimeError("the model's stream ended without a finish event")

"""How a generation route answers: one JSON body, or an SSE stream opened once the engine accepted the request.

Shared by the OpenAI, Anthropic and Responses routes and by RAG's answers, whatever client produced the chunks.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

from fastapi.responses import JSONResponse, Response, StreamingResponse

from deployments.api.errors import WireError, wire_error
from deployments.api.sse import SSE_HEADERS
from deployments.ingress.edge import REQUEST_ID
from deployments.metrics.ingress_metrics import RequestOutcome, RequestTally, untracked
from deployments.model_calls import GenerateJob, StreamChunk

logger = logging.getLogger("ray.serve.orchard")

# While a stream has nothing to send (a long prefill takes minutes on a slow CPU), a keep-alive goes out this
# often, so clients' and proxies' idle timeouts see a live connection (Anthropic's API pings about as often).
KEEPALIVE_S = 10.0


class Renderer(Protocol):
    """How a route writes its answer: one JSON body, or an SSE stream that opens at admission (before any
    output), renders the chunks, keeps itself alive while none comes, and ends (or reports an error)."""

    def completion(self, parts: list[StreamChunk]) -> dict[str, Any]:
        """The whole answer from its chunks in order (an MCP tool loop's text, calls and results interleave)."""

    def sse_start(self, first: StreamChunk) -> str: ...

    def sse(self, chunk: StreamChunk) -> str: ...

    def sse_waiting(self) -> str: ...

    def sse_keepalive(self) -> str: ...

    def sse_error(self, error: WireError) -> str: ...

    def sse_end(self) -> str: ...


class ChunkReader:
    """A model's chunk stream read with a timeout: a read that times out stays pending for the next one (the
    stream is not cancelled between chunks); close() ends that read before it closes the stream."""

    def __init__(self, chunks: AsyncIterator[StreamChunk]) -> None:
        self._chunks = chunks
        self._reading: asyncio.Task | None = None

    async def next(self, timeout_s: float | None) -> StreamChunk | None:
        """The next chunk; None if none came within timeout_s (None: no limit)."""
        if self._reading is None:
            self._reading = asyncio.ensure_future(anext(self._chunks))
        done, _ = await asyncio.wait({self._reading}, timeout=timeout_s)
        if not done:
            return None
        reading, self._reading = self._reading, None
        return reading.result()

    async def aclose(self) -> None:
        reading, self._reading = self._reading, None
        if reading is not None:  # the stream cannot be closed while a read runs in it
            reading.cancel()
            await asyncio.wait({reading})
            if not reading.cancelled():
                reading.exception()  # retrieved: a failed read is no error once the response is over
        await self._chunks.aclose()


class ClosingStreamingResponse(StreamingResponse):
    """Closes the model stream however the response ends, even if its body never started."""

    def __init__(self, content: AsyncIterator[str], close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._close = close

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await super().__call__(scope, _disconnect_on_failure(receive), send)
        finally:
            await self._close()


def _disconnect_on_failure(receive: Callable) -> Callable:
    """A receive that reports a failure to read from the client as its disconnect: Serve's proxy raises
    TaskCancelledError there when the client goes away, which logged a full traceback as an unexpected error."""

    async def receive_or_disconnect() -> dict:
        try:
            return await receive()
        except Exception as exc:
            logger.info("client disconnected (%s) [request %s]", type(exc).__name__, REQUEST_ID.get())
            return {"type": "http.disconnect"}

    return receive_or_disconnect


class ChunkSource(Protocol):
    def generate(self, job: GenerateJob) -> AsyncIterator[StreamChunk]: ...


async def answer(
    client: ChunkSource, job: GenerateJob, renderer: Renderer, keepalive_s: float = KEEPALIVE_S,
    tally: RequestTally | None = None,
) -> Response:
    """Wait for the first chunk (a stream's: the engine accepted it into its queue; else the whole answer), so that
    refusals (queue full, invalid, too long) get their own status before any byte is sent; answer. `tally` counts
    the request's outcome once it is known (a stream's when it ends)."""
    tally = tally or untracked()
    chunks = ChunkReader(client.generate(job))
    handed_to_response = False
    try:
        first = await chunks.next(None)
        if first.error is not None:
            raise first.error
        if job.stream:
            handed_to_response = True
            body = _sse_body(first, chunks, renderer, keepalive_s, tally)
            return ClosingStreamingResponse(body, close=lambda: _close_stream(chunks, tally))
        parts = await _parts(first, chunks)
        tally.end_with(parts[-1])
        return JSONResponse(renderer.completion(parts))
    except BaseException as exc:
        tally.end_by_exception(exc)
        raise
    finally:
        if not handed_to_response:
            await chunks.aclose()  # on errors and cancellation too: aborts the request in the engine


async def _close_stream(chunks: ChunkReader, tally: RequestTally) -> None:
    tally.end(RequestOutcome.ABORTED)  # a stream closed before its last chunk: the client went away
    await chunks.aclose()


async def _parts(first: StreamChunk, chunks: ChunkReader) -> list[StreamChunk]:
    parts = [first]
    while not parts[-1].is_last:
        parts.append(await chunks.next(None))
    if parts[-1].error is not None:
        raise parts[-1].error
    return parts


async def _sse_body(
    first: StreamChunk, chunks: ChunkReader, renderer: Renderer, keepalive_s: float = KEEPALIVE_S,
    tally: RequestTally | None = None,
) -> AsyncIterator[str]:
    """The stream's events. While the request waits in the engine's queue (headers are out): the renderer's
    waiting text after every keepalive_s (an SSE comment, or the Responses API's response.queued). The opening event
    at admission (the prefix-cache hit is known then), or with the first output; then each chunk's, with a
    keep-alive after every keepalive_s without one."""
    tally = tally or untracked()
    chunk: StreamChunk | None = first
    while _queued_only(chunk):
        later = await chunks.next(keepalive_s)
        if later is None:
            yield renderer.sse_waiting()
        else:  # merged, not dropped: what the queued chunk told (the prompt's count) opens the stream too
            chunk.merge(later)
    text = renderer.sse_start(chunk) if chunk.error is None else ""
    while True:
        if chunk.is_last:
            tally.end_with(chunk)
        if chunk.error is not None:  # headers are sent: report the error in the stream, as OpenAI does
            logger.info("stream failed: %s [request %s]", chunk.error.message, REQUEST_ID.get())
            yield text + renderer.sse_error(wire_error(chunk.error))
            break
        text += renderer.sse(chunk)
        if text:
            yield text
        if chunk.is_last:
            break
        text, chunk = "", await chunks.next(keepalive_s)
        while chunk is None:
            yield renderer.sse_keepalive()
            chunk = await chunks.next(keepalive_s)
    end = renderer.sse_end()
    if end:
        yield end


def _queued_only(chunk: StreamChunk) -> bool:
    return chunk.is_admission_only and not chunk.admitted



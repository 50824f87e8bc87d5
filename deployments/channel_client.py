"""The ingress's end of a model replica's stream channel (stream_channel.py): many streams over one connection."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import pickle
from typing import AsyncIterator

from engine.errors import EngineDeadError
from deployments.coalesce import PendingChunk
from deployments.protocol import GenerateJob, StreamChunk
from deployments.stream_channel import (
    ChannelAddress,
    ChannelBatch,
    ChannelHello,
    CloseStream,
    OpenStream,
    encode_frame,
    read_frame,
)

logger = logging.getLogger("ray.serve.orchard")


class ChannelClient:
    def __init__(self, model_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._model_id = model_id
        self._writer = writer
        # Per stream, what the reader handed over and its consumer has not taken yet, merged into one chunk.
        self._inboxes: dict[int, PendingChunk] = {}
        self._ids = itertools.count(1)
        self.closed = False
        self._reading = asyncio.create_task(self._read_batches(reader))

    @classmethod
    async def connect(cls, model_id: str, address: ChannelAddress) -> "ChannelClient":
        reader, writer = await asyncio.open_unix_connection(address.path)
        writer.write(encode_frame(ChannelHello(address.token)))
        await writer.drain()
        return cls(model_id, reader, writer)

    async def stream(self, job: GenerateJob) -> AsyncIterator[StreamChunk]:
        """The job's chunks; closing this early (the HTTP client went away) aborts the request in the model."""
        if self.closed:
            yield self._lost_chunk()
            return
        stream_id = next(self._ids)
        inbox = self._inboxes[stream_id] = PendingChunk()
        finished = False
        try:
            self._writer.write(encode_frame(OpenStream(stream_id, job)))
            while not finished:
                await inbox.ready.wait()
                chunk = inbox.take()
                finished = chunk.is_last
                yield chunk
        finally:
            self._inboxes.pop(stream_id, None)
            if not finished and not self.closed:
                with contextlib.suppress(ConnectionError, RuntimeError):
                    self._writer.write(encode_frame(CloseStream(stream_id)))

    async def close(self) -> None:
        self._reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reading

    async def _read_batches(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                batch = await read_frame(reader)
                if isinstance(batch, ChannelBatch):
                    for item in batch.items:
                        inbox = self._inboxes.get(item.stream_id)
                        if inbox is not None:  # else: closed by its consumer meanwhile
                            inbox.add(item.chunk)
        except (asyncio.IncompleteReadError, ConnectionError, pickle.UnpicklingError) as exc:
            logger.info("stream channel to model '%s' closed: %s", self._model_id, type(exc).__name__)
        finally:
            self.closed = True
            self._writer.close()
            for inbox in self._inboxes.values():  # streams in flight end with the model's failure
                if not inbox.ended:  # one whose last chunk already came keeps its finish
                    inbox.add(self._lost_chunk())

    def _lost_chunk(self) -> StreamChunk:
        return StreamChunk(error=model_process_died(self._model_id))


def model_process_died(model_id: str) -> EngineDeadError:
    """The error of a stream whose model replica went away, over the channel or a Ray handle alike."""
    return EngineDeadError(f"The process of model '{model_id}' died")

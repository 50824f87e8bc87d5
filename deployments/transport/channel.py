"""The stream channel: GenerateJobs and their StreamChunks between the ingress and a model replica on one node,
over a Unix socket, instead of one Ray handle stream per request. Both ends live here: ChannelServer (the
replica's) and ChannelClient (the ingress's), with the messages and framing they share.

Under load most of the CPU of the ingress and the model replica went to Ray Serve's per-request and per-item
work (a handle call, a streaming generator, serialization threads, metrics), and every busy core beside the
engine slows its steps (docs/decisions.md: the in-process engine ran 10.8 ms steps alone, 13.1 and 15.7 ms
with 3 and 6 busy processes beside it). Here one connection carries every stream: a frame per message, each
stream's chunks tagged with its id, and whatever chunks are ready go out together in one frame.

The socket lies in a directory only this user can enter (transport/socket_dirs.py: removed when the channel closes
or its process exits, swept at a later start if its process died), and a connection must first show the replica's
token.
Ray handles stay the control plane: the ingress asks the replica for its ChannelAddress with one handle call.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import pickle
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable

from engine.errors import EngineDeadError, ModelUnloadedError
from engine.mailbox import Pending, merged
from deployments.model_calls import GenerateJob, StreamChunk
from deployments.transport.errors import model_process_died
from deployments.transport.socket_dirs import (
    SOCKET_NAME, make_socket_dir, remove_socket_dir, sweep_stale_socket_dirs,
)

logger = logging.getLogger("ray.serve.orchard")
MAX_FRAME_BYTES = 1 << 30  # a frame's length field beyond this means a broken peer, not a message

Generate = Callable[[GenerateJob], AsyncIterator[StreamChunk]]


# ---- messages --------------------------------------------------------------------------------
@dataclass
class ChannelAddress:
    """Where a replica's channel listens; `node_id` is Ray's, so only a client on that node connects."""

    node_id: str
    path: str
    token: str


@dataclass
class ChannelHello:
    token: str


@dataclass
class OpenStream:
    stream_id: int
    job: GenerateJob


@dataclass
class CloseStream:
    """The client went away: the replica aborts the request."""

    stream_id: int


@dataclass
class ChannelBatch:
    """Every stream's chunks that were ready when the replica's writer woke up, merged into one per stream."""

    chunks: dict[int, StreamChunk]  # stream id -> its chunk


# ---- framing ---------------------------------------------------------------------------------
def encode_frame(message: object) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return len(data).to_bytes(4, "big") + data


async def read_frame(reader: asyncio.StreamReader) -> object:
    """The next message; raises asyncio.IncompleteReadError at the end of the stream."""
    size = int.from_bytes(await reader.readexactly(4), "big")
    if size > MAX_FRAME_BYTES:
        raise ConnectionError(f"stream channel frame of {size} bytes")
    return pickle.loads(await reader.readexactly(size))


# ---- the replica's end -----------------------------------------------------------------------
class ChannelConnection:
    """One ingress connection: its streams' tasks and the writer that batches their chunks."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._pending: dict[int, StreamChunk] = {}  # per stream, what is not written yet, merged
        self._ready = asyncio.Event()
        self.tasks: dict[int, asyncio.Task] = {}
        self.handler = asyncio.current_task()  # the server's task reading this connection

    def hang_up(self) -> None:
        """Cancel the streams still open; chunks already pushed (a stream's last, say) still go out first."""
        for task in list(self.tasks.values()):
            task.cancel()
        if self._pending and not self._writer.is_closing():
            self._write_pending()
        self._writer.close()

    def push(self, stream_id: int, chunk: StreamChunk) -> None:
        self._pending[stream_id] = merged(self._pending.get(stream_id), chunk)
        self._ready.set()

    async def write_batches(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            self._write_pending()
            await self._writer.drain()

    def _write_pending(self) -> None:
        pending, self._pending = self._pending, {}
        self._writer.write(_batch_frame(pending))


def _batch_frame(chunks: dict[int, StreamChunk]) -> bytes:
    """One frame for the batch; a chunk that cannot be pickled becomes an error of its own stream."""
    try:
        return encode_frame(ChannelBatch(chunks))
    except Exception:  # noqa: BLE001 - whatever pickle raises, the other streams go on
        kept = {}
        for stream_id, chunk in chunks.items():
            try:
                pickle.dumps(chunk)
                kept[stream_id] = chunk
            except Exception as exc:  # noqa: BLE001
                error = EngineDeadError(f"The model sent an unserializable chunk: {type(exc).__name__}")
                kept[stream_id] = StreamChunk(error=error)
        return encode_frame(ChannelBatch(kept))


class ChannelServer:
    """Serves `generate` to the ingress over a Unix socket in a private directory."""

    def __init__(self, generate: Generate, node_id: str) -> None:
        self._generate = generate
        self._node_id = node_id
        self._token = secrets.token_hex(16)
        self._dir: Path | None = None
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[ChannelConnection] = set()
        self._accepting = True
        self.streams_served = 0
        self.address: ChannelAddress | None = None  # set once listening

    async def start(self) -> ChannelAddress:
        sweep_stale_socket_dirs()  # a SIGKILLed replica's directory, found by the next one to start
        self._dir = make_socket_dir()
        path = self._dir / SOCKET_NAME
        try:
            self._server = await asyncio.start_unix_server(self._serve_connection, path=str(path))
            os.chmod(path, 0o600)
        except OSError:
            remove_socket_dir(self._dir)
            raise
        self.address = ChannelAddress(self._node_id, str(path), self._token)
        return self.address

    @property
    def open_streams(self) -> int:
        return sum(len(c.tasks) for c in self._connections)

    def stop_accepting(self) -> None:
        """New streams are refused (model_unloaded); open ones go on."""
        self._accepting = False

    async def close(self, drain_s: float) -> None:
        """Refuse new streams, give open ones up to `drain_s` to finish, then cancel the rest."""
        self._accepting = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_s
        while self.open_streams and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self._server is not None:
            self._server.close()
        connections = list(self._connections)
        for connection in connections:
            connection.hang_up()
        handlers = [c.handler for c in connections if c.handler is not None]
        if handlers:
            await asyncio.wait(handlers, timeout=5.0)
        if self._dir is not None:
            remove_socket_dir(self._dir)

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = ChannelConnection(writer)
        writing = asyncio.create_task(connection.write_batches())
        try:
            hello = await read_frame(reader)
            if not isinstance(hello, ChannelHello) or not secrets.compare_digest(hello.token, self._token):
                logger.warning("stream channel: a connection without the token was closed")
                return
            self._connections.add(connection)
            await self._read_commands(reader, connection)
        except (asyncio.IncompleteReadError, ConnectionError, pickle.UnpicklingError):
            pass  # the ingress went away (or broke the protocol): its streams end below
        finally:
            self._connections.discard(connection)
            connection.hang_up()
            writing.cancel()

    async def _read_commands(self, reader: asyncio.StreamReader, connection: ChannelConnection) -> None:
        while True:
            message = await read_frame(reader)
            if isinstance(message, OpenStream):
                self._open(connection, message)
            elif isinstance(message, CloseStream):
                task = connection.tasks.get(message.stream_id)
                if task is not None:
                    task.cancel()

    def _open(self, connection: ChannelConnection, message: OpenStream) -> None:
        if not self._accepting:
            refusal = ModelUnloadedError("The model is being unloaded", param="model")
            connection.push(message.stream_id, StreamChunk(error=refusal))
            return
        self.streams_served += 1
        task = asyncio.create_task(self._pump(connection, message.stream_id, message.job))
        connection.tasks[message.stream_id] = task
        task.add_done_callback(lambda _: connection.tasks.pop(message.stream_id, None))

    async def _pump(self, connection: ChannelConnection, stream_id: int, job: GenerateJob) -> None:
        try:
            # aclosing: a cancelled stream closes the model's generator at once, aborting the request.
            async with contextlib.aclosing(self._generate(job)) as chunks:
                async for chunk in chunks:
                    connection.push(stream_id, chunk)
        except Exception as exc:  # a bug below ModelService's own error chunks: the stream still ends
            logger.exception("stream channel: request %s failed", job.request_id)
            connection.push(stream_id, StreamChunk(error=EngineDeadError(f"The model failed: {type(exc).__name__}")))


# ---- the ingress's end -----------------------------------------------------------------------
class ChannelClient:
    """Many streams over one connection to a replica's ChannelServer."""

    def __init__(self, model_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._model_id = model_id
        self._writer = writer
        # Per stream, what the reader handed over and its consumer has not taken yet, merged into one chunk.
        self._inboxes: dict[int, Pending[StreamChunk]] = {}
        self._ids = itertools.count(1)
        self.closed = False
        self._reading = asyncio.create_task(self._read_batches(reader))

    @classmethod
    async def connect(cls, model_id: str, address: ChannelAddress) -> "ChannelClient":
        reader, writer = await asyncio.open_unix_connection(address.path)
        writer.write(encode_frame(ChannelHello(address.token)))
        await writer.drain()
        return cls(model_id, reader, writer)

    @property
    def open_streams(self) -> int:
        return len(self._inboxes)

    async def stream(self, job: GenerateJob) -> AsyncIterator[StreamChunk]:
        """The job's chunks; closing this early (the HTTP client went away) aborts the request in the model."""
        if self.closed:
            yield self._lost_chunk()
            return
        stream_id = next(self._ids)
        inbox = self._inboxes[stream_id] = Pending()
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
                    for stream_id, chunk in batch.chunks.items():
                        inbox = self._inboxes.get(stream_id)
                        if inbox is not None:  # else: closed by its consumer meanwhile
                            inbox.add(chunk)
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

"""ServeModelClient: the ingress's client of one model application, over Ray Serve handles and the stream channel.

Streams take the replica's stream channel when the ingress runs on the replica's node and the replica has one;
otherwise (several replicas, the channel off, another node, no socket) they take the Ray handle, one handle
stream per request. `_channel_for_streams` is where that choice is made. Everything else (counting tokens, info,
stats, the channel's address) is a handle call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator, Callable

import ray
from ray.exceptions import RayError
from ray.serve.exceptions import RayServeException

from engine.errors import ModelUnloadedError
from deployments.model_calls import (
    AdapterListing, ChatPrompt, EmbedJob, EmbedResult, GenerateJob, MetricsSnapshot, ModelInfo, QueueStats, StreamChunk,
    TextTokenCounts, TextTokensJob, TokenCount,
)
from deployments.transport.channel import ChannelClient
from deployments.image_calls import ImageEvent, ImageJob
from deployments.speech_calls import SpeakJob, SpeechAudioEvent, TranscribeJob, TranscriptEvent
from deployments.transport.embed_calls import EmbedCalls
from deployments.transport.errors import model_call_failure
from deployments.transport.replica_board import ReplicaReport, merged_metrics, merged_queue_stats, read_board
from deployments.transport.replica_routing import ReplicaChannels

logger = logging.getLogger("ray.serve.orchard")
# A model without a reachable stream channel is streamed through its handle; asked again after this long.
CHANNEL_RETRY_S = 30.0


def _ray_node_id() -> str:
    return ray.get_runtime_context().get_node_id()


class ServeModelClient:
    def __init__(self, model_id: str, handle: Any, node_id: Callable[[], str] = _ray_node_id,
                 app_name: str | None = None) -> None:
        self._model_id = model_id
        # A model with several replicas (their rows on the replica board): streams over their channels, picked here.
        self._replicas = (ReplicaChannels(model_id, lambda: read_board(app_name), node_id)
                          if app_name is not None else None)
        self._handle = handle
        self._stream_handle = handle.options(stream=True)
        self._node_id = node_id
        self._channel: ChannelClient | None = None
        self._channel_lock = asyncio.Lock()
        self._no_channel_until = 0.0
        self._embed_calls = EmbedCalls(self._embed_many)

    async def generate(self, job: GenerateJob) -> AsyncIterator[StreamChunk]:
        async with contextlib.aclosing(await self._stream_source(job)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _stream_source(self, job: GenerateJob) -> AsyncIterator[StreamChunk]:
        """Where this stream goes: a sole replica's channel; among several replicas (rows on the board) the one picked
        here; else the Ray handle (also a LoRA request on several replicas: Serve's multiplexed routing)."""
        rows = await self._replica_rows()
        if not rows:
            channel = await self._channel_for_streams()
            return channel.stream(job) if channel is not None else self._handle_stream(job)
        picked = self._replicas.pick(job) if job.adapter is None and self._replicas.usable else None
        return self._replica_stream(picked, job) if picked is not None else self._handle_stream(job)

    async def _replica_stream(self, channel: ChannelClient, job: GenerateJob) -> AsyncIterator[StreamChunk]:
        """A stream over the picked replica's channel. One that replica refuses because it is stopping (scaled down
        or replaced since the board was read), or loses because it died before the stream began, goes to another
        replica's channel, else through Serve's router: nothing of it ran, so nothing is lost or repeated."""
        async with contextlib.aclosing(channel.stream(job)) as chunks:
            first = True
            async for chunk in chunks:
                if first and chunk.error is not None and (isinstance(chunk.error, ModelUnloadedError) or channel.closed):
                    async with contextlib.aclosing(self._elsewhere(channel, job)) as rerouted:
                        async for again in rerouted:
                            yield again
                    return
                first = False
                yield chunk

    def _elsewhere(self, failed: ChannelClient, job: GenerateJob) -> AsyncIterator[StreamChunk]:
        other = self._replicas.pick(job) if self._replicas is not None and self._replicas.usable else None
        return other.stream(job) if other is not None and other is not failed else self._handle_stream(job)

    async def _handle_stream(self, job: GenerateJob) -> AsyncIterator[StreamChunk]:
        handle = self._stream_handle
        if job.adapter is not None:  # Serve's model multiplexing: a replica that holds the adapter, where one does
            handle = handle.options(multiplexed_model_id=job.adapter.name)
        response = handle.generate.remote(job)
        finished = False
        try:
            async for chunk in response:
                finished = chunk.is_last
                yield chunk
        except (RayServeException, RayError) as exc:  # replica died, refused, or raised
            finished = True
            yield StreamChunk(error=model_call_failure(self._model_id, exc))
        finally:
            if not finished:  # the client went away: cancel the replica's generator, aborting the request
                response.cancel()

    async def _replica_rows(self) -> list[ReplicaReport]:
        if self._replicas is None:
            return []
        await self._replicas.refresh()
        return self._replicas.rows

    async def _channel_for_streams(self) -> ChannelClient | None:
        """The replica's stream channel, connected on first use; None: stream through the handle."""
        if self._channel is not None and not self._channel.closed:
            return self._channel
        if asyncio.get_running_loop().time() < self._no_channel_until:
            return None
        async with self._channel_lock:  # a burst's first requests wait for one connection
            if self._channel is None or self._channel.closed:
                self._channel = await self._connect_channel()
                if self._channel is None:
                    self._no_channel_until = asyncio.get_running_loop().time() + CHANNEL_RETRY_S
            return self._channel

    async def _connect_channel(self) -> ChannelClient | None:
        try:
            address = await self._handle.channel_address.remote()
        except (RayServeException, RayError):
            return None  # the handle path reports what is wrong with the model
        if address is None or address.node_id != self._node_id():
            return None
        try:
            return await ChannelClient.connect(self._model_id, address)
        except OSError as exc:
            logger.warning("stream channel of model '%s' unreachable (%s): streaming through Ray", self._model_id, exc)
            return None

    async def load_adapter(self, name: str, path: str) -> AdapterListing:
        try:
            return await self._handle.load_adapter.remote(name, path)
        except (RayServeException, RayError) as exc:
            return AdapterListing(error=model_call_failure(self._model_id, exc))

    async def unload_adapter(self, name: str) -> AdapterListing:
        try:
            return await self._handle.unload_adapter.remote(name)
        except (RayServeException, RayError) as exc:
            return AdapterListing(error=model_call_failure(self._model_id, exc))

    async def count_tokens(self, prompt: ChatPrompt) -> TokenCount:
        try:
            return await self._handle.count_tokens.remote(prompt)
        except (RayServeException, RayError) as exc:
            return TokenCount(error=model_call_failure(self._model_id, exc))

    async def embed(self, job: EmbedJob) -> EmbedResult:
        return await self._embed_calls.embed(job)

    async def _embed_many(self, jobs: list[EmbedJob]) -> list[EmbedResult]:
        try:
            return await self._handle.embed_many.remote(jobs)
        except (RayServeException, RayError) as exc:
            return [EmbedResult(error=model_call_failure(self._model_id, exc)) for _ in jobs]

    async def count_text_tokens(self, job: TextTokensJob) -> TextTokenCounts:
        try:
            return await self._handle.count_text_tokens.remote(job)
        except (RayServeException, RayError) as exc:
            return TextTokenCounts(error=model_call_failure(self._model_id, exc))

    def transcribe(self, job: TranscribeJob) -> AsyncIterator[TranscriptEvent]:
        return self._events("transcribe", job, TranscriptEvent, lambda event: event.transcript is not None)

    def speak(self, job: SpeakJob) -> AsyncIterator[SpeechAudioEvent]:
        return self._events("speak", job, SpeechAudioEvent, lambda event: event.done)

    def generate_images(self, job: ImageJob) -> AsyncIterator[ImageEvent]:
        return self._events("generate_images", job, ImageEvent, lambda event: event.done)

    async def _events(self, method: str, job: Any, event_type: type, last: Callable[[Any], bool]) -> AsyncIterator[Any]:
        """A replica's event stream (speech, images) through Ray's handle; a Ray failure becomes an error event, and
        a client gone before the last event cancels the replica's generator (its next window, sentence or step)."""
        response = getattr(self._stream_handle, method).remote(job)
        finished = False
        try:
            async for event in response:
                finished = last(event) or event.error is not None
                yield event
        except (RayServeException, RayError) as exc:
            finished = True
            yield event_type(error=model_call_failure(self._model_id, exc))
        finally:
            if not finished:
                response.cancel()

    async def info(self) -> ModelInfo:
        return await self._handle.info.remote()

    async def queue_stats(self) -> QueueStats:
        rows = await self._replica_rows()
        merged = merged_queue_stats(self._model_id, rows) if rows else None
        return merged if merged is not None else await self._handle.queue_stats.remote()

    async def metrics(self) -> MetricsSnapshot:
        rows = await self._replica_rows()
        merged = merged_metrics(rows) if rows else None
        return merged if merged is not None else await self._handle.metrics.remote()

"""ModelServer: the Serve deployment of one model (its own replica process, its engine in a child process).

Each model is its own Serve application, named by its model id (config.serve_app_name), so loading or
unloading one never redeploys another. Its handle stream yields coalesced StreamChunks (transport/chunks.py);
an ingress on the same node streams over the replica's stream channel instead (transport/channel.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from typing import Any, AsyncIterator

import ray
from ray import serve
from ray.serve import Application

from deployments.config import MODEL_SERVER_DEPLOYMENT, NO_ENGINE_MODEL_TYPES, ModelConfig, serve_app_name
from deployments.model.services import adapter_call, images_with, new_model_service, speak_with, transcribe_with
from deployments.model_calls import (
    AdapterListing, AdapterRef, ChatPrompt, EmbedJob, EmbedResult, GenerateJob, MetricsSnapshot, ModelInfo,
    QueueStats, StreamChunk, TextTokenCounts, TextTokensJob, TokenCount,
)
from deployments.ray_loopback import keep_replica_grpc_on_loopback
from deployments.image_calls import ImageEvent, ImageJob
from deployments.speech_calls import SpeakJob, SpeechAudioEvent, TranscribeJob, TranscriptEvent
from deployments.transport.channel import ChannelAddress, ChannelServer
from deployments.transport.replica_board import REPORT_EVERY_S, ReplicaReport, board_handle

logger = logging.getLogger("ray.serve.orchard")
# After the unload's drain, the channel's streams have this long to send their last chunks.
CHANNEL_FLUSH_S = 2.0
# Ray's metrics agent holds what a replica last set: the engine's levels (running, KV, memory) are read this often.
METRICS_REFRESH_S = 5.0


@serve.deployment(name=MODEL_SERVER_DEPLOYMENT)
class ModelServer:
    async def __init__(self, config: dict[str, Any]) -> None:
        keep_replica_grpc_on_loopback()
        self.config = ModelConfig.model_validate(config)
        app_name = serve.get_replica_context().app_name
        if app_name != serve_app_name(self.config.id):
            raise ValueError(
                f"application '{app_name}' must be named '{serve_app_name(self.config.id)}' after its model_id"
            )
        self.service = new_model_service(self.config)
        await self.service.start()  # the app stays DEPLOYING (clients get 503) until the model is warm
        self.channel: ChannelServer | None = None
        # With several replicas each one's channel is found on the replica board, where the ingress picks the
        # replica per stream; channel_address (a handle call: any replica) names a sole replica's only.
        # An embedding model has no streams.
        streams = self.config.model_type not in NO_ENGINE_MODEL_TYPES
        if streams and self.config.advanced.stream_channel:
            channel = ChannelServer(self.service.generate, ray.get_runtime_context().get_node_id())
            try:
                await channel.start()
                self.channel = channel
            except OSError as exc:  # no socket here (e.g. no writable temp dir): the handle path still serves
                logger.warning("model %s: no stream channel (%s); streams go through Ray", self.config.id, exc)
        # A sole replica refreshes its metrics every few seconds; one of several reports them (and more) every second.
        self.metrics_refresh = asyncio.create_task(
            self._refresh_metrics() if self.config.single_replica else self._report_to_board())
        self._adapter_loader: Any = None  # Serve's multiplexed loader, made at the first multiplexed request

    async def generate(self, job: GenerateJob) -> AsyncIterator[StreamChunk]:
        if job.adapter is not None and serve.get_multiplexed_model_id():
            await self._multiplexed_adapter(job.adapter)
        async for chunk in self.service.generate(job):
            yield chunk

    async def _multiplexed_adapter(self, ref: AdapterRef) -> None:
        """Serve's model multiplexing (several replicas): the ingress names the adapter as the multiplexed model id,
        Serve routes to a replica that holds it, and this replica tells Serve what it holds (LRU, max_loras)."""
        if self._adapter_loader is None:
            async def resident(name: str) -> ResidentAdapter:
                return ResidentAdapter(self.service, name)

            self._adapter_loader = serve.multiplexed(max_num_models_per_replica=max(1, self.config.max_loras))(resident)
        await self._adapter_loader(ref.name)

    async def load_adapter(self, name: str, path: str) -> AdapterListing:
        return await adapter_call(self.service, self.config, name, path)

    async def unload_adapter(self, name: str) -> AdapterListing:
        return await adapter_call(self.service, self.config, name, None)

    async def channel_address(self) -> ChannelAddress | None:
        return self.channel.address if self.channel is not None and self.config.single_replica else None

    async def count_tokens(self, prompt: ChatPrompt) -> TokenCount:
        return await self.service.count_tokens(prompt)

    async def embed(self, job: EmbedJob) -> EmbedResult:
        return await self.service.embed(job)

    async def embed_many(self, jobs: list[EmbedJob]) -> list[EmbedResult]:
        """Several requests' jobs in one call (the ingress's EmbedCalls); the service batches them together."""
        return list(await asyncio.gather(*(self.service.embed(job) for job in jobs)))

    async def count_text_tokens(self, job: TextTokensJob) -> TextTokenCounts:
        return await self.service.count_text_tokens(job)

    async def transcribe(self, job: TranscribeJob) -> AsyncIterator[TranscriptEvent]:
        async for event in transcribe_with(self.service, self.config, job):
            yield event

    async def speak(self, job: SpeakJob) -> AsyncIterator[SpeechAudioEvent]:
        async for event in speak_with(self.service, self.config, job):
            yield event

    async def generate_images(self, job: ImageJob) -> AsyncIterator[ImageEvent]:
        async for event in images_with(self.service, self.config, job):
            yield event

    async def info(self) -> ModelInfo:
        info = self.service.info()
        if self.config.single_replica:
            info = dataclasses.replace(info, sole_replica_node=ray.get_runtime_context().get_node_id())
        return info

    async def metrics(self) -> MetricsSnapshot:
        return self.service.metrics_snapshot()

    async def _refresh_metrics(self) -> None:
        while True:
            await asyncio.sleep(METRICS_REFRESH_S)
            self.service.metrics_snapshot()

    async def _report_to_board(self) -> None:
        """A replica of a model with several: its channel, stats, metrics and health to the board, every second."""
        context = serve.get_replica_context()
        app_name, replica_id = context.app_name, context.replica_id.unique_id
        node_id = ray.get_runtime_context().get_node_id()
        while True:
            try:
                report = ReplicaReport(app_name, replica_id, node_id, os.getpid(),
                                       self.channel.address if self.channel is not None else None,
                                       await self.queue_stats(), self.service.metrics_snapshot(),
                                       self.service.info().health)
                await board_handle().report.remote(report)
            except Exception as exc:  # noqa: BLE001 - the board is best effort; the next report may get through
                logger.warning("model %s: no report to the replica board: %r", self.config.id, exc)
            await asyncio.sleep(REPORT_EVERY_S)

    def _leave_board(self) -> None:
        context = serve.get_replica_context()
        with contextlib.suppress(Exception):  # best effort: an unrefreshed row is dropped after ROW_TTL_S anyway
            board_handle().leave.remote(context.app_name, context.replica_id.unique_id)

    async def queue_stats(self) -> QueueStats:
        stats = self.service.queue_stats()
        if self.channel is not None:
            stats = dataclasses.replace(stats, channel_streams_total=self.channel.streams_served)
        return stats

    async def __del__(self) -> None:
        """Serve is unloading this model (or replacing the replica): refuse new streams, let open ones finish
        for advanced.unload_drain_s, end the rest with model_unloaded, then stop the engine (before the process exits,
        else MLX may abort)."""
        refresh = getattr(self, "metrics_refresh", None)
        if refresh is not None:
            refresh.cancel()
            if not self.config.single_replica:
                self._leave_board()
        channel = getattr(self, "channel", None)
        if channel is not None:
            channel.stop_accepting()
        service = getattr(self, "service", None)
        if service is not None:
            await service.unload()
        if channel is not None:
            await channel.close(drain_s=CHANNEL_FLUSH_S)  # the streams' last (error) chunks reach the ingress


class ResidentAdapter:
    """What Serve's multiplexing holds for an adapter on this replica: the engine loads it when a request runs on
    it (ServiceAdapters.held) and unloads idle ones least recently used first; Serve's own LRU only routes."""

    def __init__(self, service: Any, name: str) -> None:
        self.service, self.name = service, name


def build_model_application(config: ModelConfig) -> Application:
    return ModelServer.options(**config.deployment_options()).bind(config.model_dump())


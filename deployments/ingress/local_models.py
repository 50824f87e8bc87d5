"""An in-process backend of the model registry: models run as ModelServices in this process (no Ray), each
engine on a thread of it. Used by the fast ingress tests and handy for debugging the HTTP layer."""

from __future__ import annotations

import asyncio
import os
from typing import AsyncIterator

from engine.errors import ModelLoadError, ModelNotFoundError
from deployments.config import NO_ENGINE_MODEL_TYPES, ModelConfig
from deployments.model.service import EngineClientFactory, ModelService, thread_engine_client
from deployments.embeddings.service import EmbeddingService
from deployments.model.services import adapter_call, images_with, new_model_service, speak_with, transcribe_with
from deployments.image_calls import ImageEvent, ImageJob
from deployments.speech_calls import SpeakJob, SpeechAudioEvent, TranscribeJob, TranscriptEvent
from deployments.model_calls import (
    AdapterListing, ChatPrompt, EmbedJob, EmbedResult, GenerateJob, MetricsSnapshot, ModelInfo, QueueStats, StreamChunk,
    TextTokenCounts, TextTokensJob, TokenCount,
)
from deployments.ingress.load_limits import ClusterCapacity, NodeCapacity
from deployments.ingress.model_entries import DeploymentState, ModelStatus


class LocalModelClient:
    def __init__(self, service: ModelService | EmbeddingService) -> None:
        self._service = service

    def generate(self, job: GenerateJob) -> AsyncIterator[StreamChunk]:
        return self._service.generate(job)

    async def count_tokens(self, prompt: ChatPrompt) -> TokenCount:
        return await self._service.count_tokens(prompt)

    async def embed(self, job: EmbedJob) -> EmbedResult:
        return await self._service.embed(job)

    async def count_text_tokens(self, job: TextTokensJob) -> TextTokenCounts:
        return await self._service.count_text_tokens(job)

    def transcribe(self, job: TranscribeJob) -> AsyncIterator[TranscriptEvent]:
        return transcribe_with(self._service, self._service.config, job)

    def speak(self, job: SpeakJob) -> AsyncIterator[SpeechAudioEvent]:
        return speak_with(self._service, self._service.config, job)

    def generate_images(self, job: ImageJob) -> AsyncIterator[ImageEvent]:
        return images_with(self._service, self._service.config, job)

    async def info(self) -> ModelInfo:
        return self._service.info()

    async def queue_stats(self) -> QueueStats:
        return self._service.queue_stats()

    async def metrics(self) -> MetricsSnapshot:
        return self._service.metrics_snapshot()

    async def load_adapter(self, name: str, path: str) -> AdapterListing:
        return await adapter_call(self._service, self._service.config, name, path)

    async def unload_adapter(self, name: str) -> AdapterListing:
        return await adapter_call(self._service, self._service.config, name, None)


# The ingress's application name in process, as serve_config.yaml names it under Serve.
LOCAL_INGRESS_APP = "orchard"


class LocalBackend:
    def __init__(self, new_engine_client: EngineClientFactory = thread_engine_client) -> None:
        self._new_engine_client = new_engine_client
        self._services: dict[str, ModelService | EmbeddingService] = {}
        self._states: dict[str, DeploymentState] = {}

    async def deploy(self, config: ModelConfig) -> None:
        self._states[config.id] = DeploymentState(ModelStatus.LOADING)
        service: ModelService | EmbeddingService
        if config.model_type in NO_ENGINE_MODEL_TYPES:
            service = new_model_service(config)
        else:
            service = ModelService(config, self._new_engine_client)
        try:
            await service.start()
        except asyncio.CancelledError:  # an unload or a load's deadline: nothing it started may outlive it
            self._states.pop(config.id, None)
            await asyncio.shield(service.shutdown())
            raise
        except Exception as exc:
            message = getattr(exc, "message", None) or repr(exc)
            self._states[config.id] = DeploymentState(ModelStatus.FAILED, message)
            raise ModelLoadError(message) from exc
        self._services[config.id] = service
        self._states[config.id] = DeploymentState(ModelStatus.RUNNING)

    async def undeploy(self, model_id: str) -> None:
        self._states.pop(model_id, None)
        service = self._services.pop(model_id, None)
        if service is not None:
            await service.unload()

    async def deployments(self) -> dict[str, DeploymentState]:
        return dict(self._states)

    async def reserved_names(self) -> set[str]:
        return {LOCAL_INGRESS_APP}

    def replica_died(self, info: ModelInfo) -> bool:
        return False  # in this process: it answers or raises

    async def capacity(self) -> ClusterCapacity:
        """This machine, as Ray would count it: its CPUs and memory, no GPU (MLX's CPU build here)."""
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return ClusterCapacity((NodeCapacity(cpus=float(os.cpu_count() or 1), gpus=0.0, memory_bytes=float(memory)),))

    async def client(self, model_id: str) -> LocalModelClient:
        service = self._services.get(model_id)
        if service is None:
            raise ModelNotFoundError(f"The model '{model_id}' does not exist", param="model")
        return LocalModelClient(service)

    async def close(self) -> None:
        for model_id in list(self._services):
            self._states.pop(model_id, None)
            await self._services.pop(model_id).shutdown()

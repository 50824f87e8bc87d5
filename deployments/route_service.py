"""What the service of a model that answers one route of its own shares (speech-to-text, text-to-speech, image
generation): the 400s it answers on the chat and embedding routes, the drain on unload, and its memory as
loaded-models shows it."""

from __future__ import annotations

import asyncio
import os
import time
from typing import AsyncIterator, Callable

from deployments.config import ModelConfig
from deployments.metrics.recorder import MetricsRecorder
from deployments.model_calls import (
    ChatPrompt, EmbedJob, EmbedResult, GenerateJob, MemoryUsage, MetricsSnapshot, ModelInfo, StreamChunk,
    TextTokenCounts, TextTokensJob, TokenCount,
)
from engine.errors import InvalidRequestError
from engine.process_memory import process_rss_bytes

MIB = 1024 * 1024


async def drained(active: Callable[[], int], within_s: float) -> None:
    """Wait until no request is active (an unload's drain), at most within_s seconds."""
    deadline = time.monotonic() + within_s
    while active() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


class OneRouteService:
    kind = "speech"  # what the model is, as the 400s say it ("a speech-to-text model")
    route = ""  # the route it answers

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.model_id = config.id
        self._unloading = False
        self._active = 0
        self._metrics = MetricsRecorder(self.model_id)
        self.created_at = 0

    def _not_that_model(self, route: str) -> InvalidRequestError:
        return InvalidRequestError(f"The model '{self.model_id}' is a {self.kind} model: use POST {self.route}, "
                                   f"not {route}", param="model")

    async def generate(self, job: GenerateJob) -> AsyncIterator[StreamChunk]:
        yield StreamChunk(error=self._not_that_model("a chat or completion route"))

    async def count_tokens(self, prompt: ChatPrompt) -> TokenCount:
        return TokenCount(error=self._not_that_model("token counting"))

    async def embed(self, job: EmbedJob) -> EmbedResult:
        return EmbedResult(error=self._not_that_model("/v1/embeddings"))

    async def count_text_tokens(self, job: TextTokensJob) -> TextTokenCounts:
        return TextTokenCounts(error=self._not_that_model("/v1/embeddings"))

    async def unload(self) -> None:
        self._unloading = True
        await drained(lambda: self._active, self.config.advanced.unload_drain_s)
        await self.shutdown()

    async def shutdown(self) -> None:
        self._unloading = True

    def _info(self, model_path: str, context_length: int) -> ModelInfo:
        import mlx.core as mx

        rss = round(process_rss_bytes() / MIB, 1)
        return ModelInfo(
            model_id=self.model_id, model_type=self.config.model_type, model_path=model_path,
            context_length=context_length, created_at=self.created_at, pid=os.getpid(),
            memory=MemoryUsage(mlx_active_mb=round(mx.get_active_memory() / MIB, 1),
                               mlx_cache_mb=round(mx.get_cache_memory() / MIB, 1),
                               mlx_peak_mb=round(mx.get_peak_memory() / MIB, 1), rss_mb=rss, total_mb=rss),
        )

    def metrics_snapshot(self) -> MetricsSnapshot:
        return self._metrics.snapshot()

"""ModelServer: the Serve deployment of one model (its own replica process, its own engine).

Each model is its own Serve application, named by its model id (config.serve_app_name), so
loading or unloading one never redeploys another. The handle stream yields coalesced StreamChunks (see coalesce.py).
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from ray import serve
from ray.serve import Application

from deployments.config import ModelConfig, serve_app_name
from deployments.model_service import ModelService
from deployments.protocol import ChatPrompt, GenerateJob, ModelInfo, QueueStats, StreamChunk, TokenCount

MODEL_SERVER_DEPLOYMENT = "ModelServer"  # the registry recognises model applications by this name


@serve.deployment(name=MODEL_SERVER_DEPLOYMENT)
class ModelServer:
    async def __init__(self, config: dict[str, Any]) -> None:
        self.config = ModelConfig.model_validate(config)
        app_name = serve.get_replica_context().app_name
        if app_name != serve_app_name(self.config.id):
            raise ValueError(
                f"application '{app_name}' must be named '{serve_app_name(self.config.id)}' after its model_id"
            )
        self.service = ModelService(self.config)
        await self.service.start()  # the app stays DEPLOYING (clients get 503) until the model is warm

    async def generate(self, job: GenerateJob) -> AsyncIterator[StreamChunk]:
        async for chunk in self.service.generate(job):
            yield chunk

    async def count_tokens(self, prompt: ChatPrompt) -> TokenCount:
        return await self.service.count_tokens(prompt)

    async def info(self) -> ModelInfo:
        return self.service.info()

    async def queue_stats(self) -> QueueStats:
        return self.service.queue_stats()

    async def check_health(self) -> None:
        """Serve's periodic health check: a dead engine thread gets the replica replaced."""
        self.service.check_health()

    async def __del__(self) -> None:
        # Stop the MLX thread and free its objects before the process exits (else MLX may abort).
        service = getattr(self, "service", None)
        if service is not None:
            await service.shutdown()


def build_model_application(config: ModelConfig) -> Application:
    return ModelServer.options(**config.deployment_options()).bind(config.model_dump())

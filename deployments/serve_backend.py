"""The Ray Serve backend of the registry: one Serve application per model, reached by handles.

serve.run / serve.delete / serve.status / get_app_handle block on the controller (1-3 s for
run and delete), so they run in threads: the ingress loop keeps streaming meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator

import ray
from ray import serve
from ray.exceptions import RayActorError, RayError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RayServeException
from ray.serve.schema import ApplicationStatus

from engine.errors import EngineDeadError, ModelLoadError, ModelNotFoundError, OrchardError, QueueFullError
from deployments.channel_client import ChannelClient, model_process_died
from deployments.config import ModelConfig, model_id_of_app, serve_app_name
from deployments.model_server import MODEL_SERVER_DEPLOYMENT, build_model_application
from deployments.protocol import ChatPrompt, GenerateJob, ModelInfo, QueueStats, StreamChunk, TokenCount
from deployments.registry import DeploymentState, ModelStatus

logger = logging.getLogger("ray.serve.orchard")
MAX_ERROR_CHARS = 600
# A model without a reachable stream channel is streamed through its handle; asked again after this long.
CHANNEL_RETRY_S = 30.0

_STATUS = {
    ApplicationStatus.NOT_STARTED: ModelStatus.LOADING,
    ApplicationStatus.DEPLOYING: ModelStatus.LOADING,
    ApplicationStatus.RUNNING: ModelStatus.RUNNING,
    ApplicationStatus.DEPLOY_FAILED: ModelStatus.FAILED,
    ApplicationStatus.UNHEALTHY: ModelStatus.UNHEALTHY,
    ApplicationStatus.DELETING: ModelStatus.UNLOADING,
}


class RayModelClient:
    def __init__(self, model_id: str, handle: Any) -> None:
        self._model_id = model_id
        self._handle = handle
        self._stream_handle = handle.options(stream=True)
        self._channel: ChannelClient | None = None
        self._channel_lock = asyncio.Lock()
        self._no_channel_until = 0.0

    async def generate(self, job: GenerateJob) -> AsyncIterator[StreamChunk]:
        channel = await self._stream_channel()
        if channel is not None:
            async with contextlib.aclosing(channel.stream(job)) as chunks:
                async for chunk in chunks:
                    yield chunk
            return
        response = self._stream_handle.generate.remote(job)
        finished = False
        try:
            async for chunk in response:
                finished = chunk.is_last
                yield chunk
        except (RayServeException, RayError) as exc:  # replica died, refused, or raised
            finished = True
            yield StreamChunk(error=ray_failure(self._model_id, exc))
        finally:
            if not finished:  # the client went away: cancel the replica's generator, aborting the request
                response.cancel()

    async def _stream_channel(self) -> ChannelClient | None:
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
        if address is None or address.node_id != ray.get_runtime_context().get_node_id():
            return None
        try:
            return await ChannelClient.connect(self._model_id, address)
        except OSError as exc:
            logger.warning("stream channel of model '%s' unreachable (%s): streaming through Ray", self._model_id, exc)
            return None

    async def count_tokens(self, prompt: ChatPrompt) -> TokenCount:
        try:
            return await self._handle.count_tokens.remote(prompt)
        except (RayServeException, RayError) as exc:
            return TokenCount(error=ray_failure(self._model_id, exc))

    async def info(self) -> ModelInfo:
        return await self._handle.info.remote()

    async def queue_stats(self) -> QueueStats:
        return await self._handle.queue_stats.remote()


def ray_failure(model_id: str, exc: BaseException) -> OrchardError:
    """Ray's errors on a model call, as our typed errors."""
    if isinstance(exc, BackPressureError):
        return QueueFullError(f"The model '{model_id}' has too many queued requests")
    if isinstance(exc, DeploymentUnavailableError):
        return ModelNotFoundError(f"The model '{model_id}' is not available", param="model")
    if isinstance(exc, RayActorError):
        return model_process_died(model_id)
    return EngineDeadError(f"The model '{model_id}' failed: {type(exc).__name__}")


class ServeBackend:
    def __init__(self) -> None:
        self._clients: dict[str, RayModelClient] = {}

    async def deploy(self, config: ModelConfig) -> None:
        self._clients.pop(config.id, None)
        app = build_model_application(config)
        try:
            await asyncio.to_thread(serve.run, app, name=serve_app_name(config.id), route_prefix=None)
        except Exception as exc:  # serve.run's RuntimeError only says "failed"; the deployment says why
            state = (await self.deployments()).get(config.id)
            detail = state.message if state is not None and state.message else summarize_failure(str(exc))
            raise ModelLoadError(detail) from exc

    async def undeploy(self, model_id: str) -> None:
        # Streams in flight keep the old client: the replica drains its channel, then closes it.
        self._clients.pop(model_id, None)
        await asyncio.to_thread(serve.delete, serve_app_name(model_id))

    async def deployments(self) -> dict[str, DeploymentState]:
        status = await asyncio.to_thread(serve.status)
        states = {}
        for name, app in status.applications.items():
            if MODEL_SERVER_DEPLOYMENT not in app.deployments:
                continue  # the ingress, or an application that is not a model
            model_status = _STATUS.get(app.status, ModelStatus.LOADING)
            message = None
            if model_status in (ModelStatus.FAILED, ModelStatus.UNHEALTHY):
                detail = app.deployments[MODEL_SERVER_DEPLOYMENT].message or app.message
                message = summarize_failure(detail)
            states[model_id_of_app(name)] = DeploymentState(model_status, message)
        return states

    async def client(self, model_id: str) -> RayModelClient:
        client = self._clients.get(model_id)
        if client is None:
            try:
                handle = await asyncio.to_thread(serve.get_app_handle, serve_app_name(model_id))
            except RayServeException as exc:  # deleted between the status check and now
                raise ModelNotFoundError(f"The model '{model_id}' does not exist", param="model") from exc
            client = self._clients[model_id] = RayModelClient(model_id, handle)
        return client


def summarize_failure(message: str) -> str:
    """The informative line of a Serve failure message (its last 'SomeError: why' line)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if ":" in line and (head.endswith("Error") or head.endswith("Exception")):
            return line[:MAX_ERROR_CHARS]
    return (lines[-1] if lines else "unknown error")[:MAX_ERROR_CHARS]

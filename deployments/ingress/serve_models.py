"""The Ray Serve backend of the model registry: one Serve application per model, reached by its client.

serve.run / serve.delete / serve.status / get_app_handle block on the controller (1-3 s for
run and delete; serve.run of a failing model until Serve gives up), so they run in threads: the
ingress loop keeps streaming meanwhile. Status questions have threads of their own, so that loads
and unloads in flight (or anything else on the loop's default executor) never keep them waiting.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from ray import serve
from ray.serve.exceptions import RayServeException
from ray.serve.schema import ApplicationStatus, ReplicaState

from engine.errors import ModelLoadError, ModelNotFoundError
from deployments.config import MODEL_SERVER_DEPLOYMENT, ModelConfig, model_id_of_app, serve_app_name
from deployments.ingress.model_entries import DeploymentState, ModelStatus
from deployments.model.deployment import build_model_application
from deployments.transport.model_client import ServeModelClient

logger = logging.getLogger("ray.serve.orchard")
MAX_ERROR_CHARS = 600

_STATUS = {
    ApplicationStatus.NOT_STARTED: ModelStatus.LOADING,
    ApplicationStatus.DEPLOYING: ModelStatus.LOADING,
    ApplicationStatus.RUNNING: ModelStatus.RUNNING,
    ApplicationStatus.DEPLOY_FAILED: ModelStatus.FAILED,
    ApplicationStatus.UNHEALTHY: ModelStatus.UNHEALTHY,
    ApplicationStatus.DELETING: ModelStatus.UNLOADING,
}


# Loads and unloads at once (each holds a thread until Serve answers); status and handle lookups.
_DEPLOY_THREADS = ThreadPoolExecutor(8, thread_name_prefix="orchard-serve-deploy")
_STATUS_THREADS = ThreadPoolExecutor(2, thread_name_prefix="orchard-serve-status")


async def _in(executor: ThreadPoolExecutor, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(executor, functools.partial(call, *args, **kwargs))


class ServeBackend:
    def __init__(self) -> None:
        self._clients: dict[str, ServeModelClient] = {}
        # Built in the ingress's replica: its own application (serve_config.yaml's `orchard`) is learned, not assumed.
        self._own_app_name = serve.get_replica_context().app_name

    async def deploy(self, config: ModelConfig) -> None:
        self._clients.pop(config.id, None)
        app = build_model_application(config)
        try:
            await _in(_DEPLOY_THREADS, serve.run, app, name=serve_app_name(config.id), route_prefix=None)
        except Exception as exc:  # serve.run's RuntimeError only says "failed"; the deployment says why
            state = (await self.deployments()).get(config.id)
            detail = state.message if state is not None and state.message else summarize_failure(str(exc))
            raise ModelLoadError(detail) from exc

    async def undeploy(self, model_id: str) -> None:
        # Streams in flight keep the old client: the replica drains its channel, then closes it.
        self._clients.pop(model_id, None)
        await _in(_DEPLOY_THREADS, serve.delete, serve_app_name(model_id))

    async def deployments(self) -> dict[str, DeploymentState]:
        status = await _in(_STATUS_THREADS, serve.status)
        states = {}
        for name, app in status.applications.items():
            if MODEL_SERVER_DEPLOYMENT not in app.deployments:
                continue  # the ingress, or an application that is not a model
            model_status = _STATUS.get(app.status, ModelStatus.LOADING)
            deployment = app.deployments[MODEL_SERVER_DEPLOYMENT]
            message = None
            if model_status in (ModelStatus.FAILED, ModelStatus.UNHEALTHY):
                message = summarize_failure(deployment.message or app.message)
            elif model_status == ModelStatus.RUNNING and not deployment.replica_states.get(ReplicaState.RUNNING):
                # Its replica died (Serve starts another): requests get 503 + Retry-After until one runs again.
                model_status, message = ModelStatus.LOADING, "restarting: its process died"
            states[model_id_of_app(name)] = DeploymentState(model_status, message)
        return states

    async def reserved_names(self) -> set[str]:
        status = await _in(_STATUS_THREADS, serve.status)
        others = {name for name, app in status.applications.items() if MODEL_SERVER_DEPLOYMENT not in app.deployments}
        return others | {self._own_app_name}

    async def client(self, model_id: str) -> ServeModelClient:
        client = self._clients.get(model_id)
        if client is None:
            try:
                handle = await _in(_STATUS_THREADS, serve.get_app_handle, serve_app_name(model_id))
            except RayServeException as exc:  # deleted between the status check and now
                raise ModelNotFoundError(f"The model '{model_id}' does not exist", param="model") from exc
            client = self._clients[model_id] = ServeModelClient(model_id, handle)
        return client


def summarize_failure(message: str) -> str:
    """The informative line of a Serve failure message (its last 'SomeError: why' line)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if ":" in line and (head.endswith("Error") or head.endswith("Exception")):
            return line[:MAX_ERROR_CHARS]
    return (lines[-1] if lines else "unknown error")[:MAX_ERROR_CHARS]

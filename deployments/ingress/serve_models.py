"""The Ray Serve backend of the model registry: one Serve application per model, reached by its client.

A load submits its application without waiting (serve.run waits until the application runs, which for a replica
that cannot be placed is forever, holding a thread: stuck loads once used up the pool and hung every admin call)
and then watches Serve's status, which one fetch at a time serves to every caller (SharedStatus). serve.delete and
serve.status block on the controller, so they run in threads of their own: the ingress loop keeps streaming.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import ray
from ray import serve
from ray.serve.context import _get_global_client
from ray.serve.exceptions import RayServeException
from ray.serve.schema import (ApplicationStatus, ApplicationStatusOverview, DeploymentStatus, DeploymentStatusOverview,
                              DeploymentStatusTrigger, ReplicaState, ServeStatus)

from engine.errors import ModelLoadError, ModelNotFoundError
from deployments.config import MODEL_SERVER_DEPLOYMENT, ModelConfig, model_id_of_app, serve_app_name
from deployments.ingress.load_limits import ClusterCapacity, NodeCapacity
from deployments.ingress.model_entries import DeploymentState, ModelStatus
from deployments.ingress.replica_watch import process_gone
from deployments.model_calls import ModelInfo
from deployments.model.deployment import build_model_application
from deployments.transport.model_client import ServeModelClient

logger = logging.getLogger("ray.serve.orchard")
MAX_ERROR_CHARS = 600
RESERVED_VIEW_AGE_S = 1.0  # a load's name check may use a view this old (the load refreshed just before)

_STATUS = {
    ApplicationStatus.NOT_STARTED: ModelStatus.LOADING,
    ApplicationStatus.DEPLOYING: ModelStatus.LOADING,
    ApplicationStatus.RUNNING: ModelStatus.RUNNING,
    ApplicationStatus.DEPLOY_FAILED: ModelStatus.FAILED,
    ApplicationStatus.UNHEALTHY: ModelStatus.UNHEALTHY,
    ApplicationStatus.DELETING: ModelStatus.UNLOADING,
}


# Each kind of blocking call has threads of its own, so that one kind stalling (a delete waits out a replica's
# graceful shutdown, serve.status a busy controller) never keeps another waiting: submits, deletes, the one
# status fetch, handle lookups (a request's first call to a model), node lookups (an admin load's check).
_SUBMIT_THREADS = ThreadPoolExecutor(4, thread_name_prefix="orchard-serve-submit")
_DELETE_THREADS = ThreadPoolExecutor(8, thread_name_prefix="orchard-serve-delete")
_STATUS_THREADS = ThreadPoolExecutor(1, thread_name_prefix="orchard-serve-status")
_HANDLE_THREADS = ThreadPoolExecutor(2, thread_name_prefix="orchard-serve-handle")
_NODE_THREADS = ThreadPoolExecutor(1, thread_name_prefix="orchard-serve-nodes")
DEPLOY_POLL_S = 0.5  # how often a load looks at its application's status


async def _in(executor: ThreadPoolExecutor, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(executor, functools.partial(call, *args, **kwargs))


class SharedStatus:
    """Serve's status, one serve.status call at a time whoever asks: a caller gets a view fetched no earlier
    than it asks for, joining the fetch in flight when that one is recent enough."""

    def __init__(self) -> None:
        self._view: Any = None
        self._view_started = -math.inf
        self._task: asyncio.Future | None = None
        self._task_started = -math.inf

    async def get(self, not_before: float) -> Any:
        while True:
            if self._view is not None and self._view_started >= not_before:
                return self._view
            if self._task is None or self._task.done():
                self._task_started = time.monotonic()
                self._task = asyncio.ensure_future(self._fetch(self._task_started))
            if self._task_started >= not_before:
                return await asyncio.shield(self._task)
            await asyncio.wait([self._task])  # too old for this caller: the next one starts after it

    async def _fetch(self, started: float) -> Any:
        view = await _in(_STATUS_THREADS, serve_status)
        if started >= self._view_started:
            self._view, self._view_started = view, started
        return view


def serve_status() -> ServeStatus:
    """What serve.status() returns, read from the controller's details without validating them whole: serve.status
    parses every deployment's config, cloudpickling each one's request router class again, and so took 2/3 of an idle
    ingress's CPU (20% of a core, polling ten applications every 2 s)."""
    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return ServeStatus()
    return ServeStatus(applications={
        name: ApplicationStatusOverview(
            status=ApplicationStatus(app["status"]), message=app.get("message", ""),
            last_deployed_time_s=app.get("last_deployed_time_s", 0.0),
            deployments={deployment_name: _deployment_status(deployment)
                         for deployment_name, deployment in app.get("deployments", {}).items()})
        for name, app in client.get_serve_details().get("applications", {}).items()})


def _deployment_status(deployment: dict[str, Any]) -> DeploymentStatusOverview:
    replica_states = Counter(ReplicaState(replica["state"]).value for replica in deployment.get("replicas", ()))
    trigger = DeploymentStatusTrigger(deployment.get("status_trigger", DeploymentStatusTrigger.UNSPECIFIED))
    return DeploymentStatusOverview(status=DeploymentStatus(deployment["status"]), status_trigger=trigger,
                                    replica_states=dict(replica_states), message=deployment.get("message", ""))


class ServeBackend:
    def __init__(self) -> None:
        self._clients: dict[str, ServeModelClient] = {}
        self._status = SharedStatus()
        self._submits: dict[str, asyncio.Future] = {}  # application name -> its submit in flight
        # Built in the ingress's replica: its own application (serve_config.yaml's `orchard`) is learned, not assumed.
        self._own_app_name = serve.get_replica_context().app_name
        self._node_id = ray.get_runtime_context().get_node_id()

    async def deploy(self, config: ModelConfig) -> None:
        """Submit the model's application, then wait until it runs (ModelLoadError if Serve gives up on it);
        cancelling the wait leaves the application to the unload that cancelled it."""
        self._clients.pop(config.id, None)
        name = serve_app_name(config.id)
        target = serve.RunTarget(build_model_application(config), name=name, route_prefix=None)
        submit = asyncio.ensure_future(
            _in(_SUBMIT_THREADS, serve.run_many, [target], wait_for_applications_running=False))
        self._submits[name] = submit
        submit.add_done_callback(functools.partial(self._forget_submit, name))
        submitted_at, seen = time.monotonic(), False
        try:
            await asyncio.shield(submit)
        except Exception as exc:  # the controller refused the application
            raise ModelLoadError(summarize_failure(str(exc))) from exc
        while True:
            # A view at most DEPLOY_POLL_S old (shared with other loads' polls), never one from before the submit.
            fresh_since = max(submitted_at, time.monotonic() - DEPLOY_POLL_S)
            app = (await self._status.get(not_before=fresh_since)).applications.get(name)
            if app is None and seen:
                raise ModelLoadError(f"The application of model '{config.id}' disappeared while it loaded")
            # Serve lists a submitted application from its controller's next loop on: not there yet is not gone.
            seen = seen or app is not None
            if app is not None and _running(app):
                return
            await asyncio.sleep(DEPLOY_POLL_S)

    def _forget_submit(self, name: str, done: asyncio.Future) -> None:
        if self._submits.get(name) is done:
            del self._submits[name]

    async def undeploy(self, model_id: str) -> None:
        # Streams in flight keep the old client: the replica drains its channel, then closes it.
        self._clients.pop(model_id, None)
        name = serve_app_name(model_id)
        submit = self._submits.get(name)
        if submit is not None:  # a cancelled load's submit still in its thread: delete what it creates
            await asyncio.wait([submit])
        await _in(_DELETE_THREADS, serve.delete, name)

    def replica_died(self, info: ModelInfo) -> bool:
        return info.sole_replica_node == self._node_id and process_gone(info.pid)

    async def capacity(self) -> ClusterCapacity:
        nodes = await _in(_NODE_THREADS, ray.nodes)
        return ClusterCapacity(tuple(_node_capacity(node["Resources"]) for node in nodes if node.get("Alive")))

    async def deployments(self) -> dict[str, DeploymentState]:
        status = await self._status.get(not_before=time.monotonic())
        states = {}
        for name, app in status.applications.items():
            if MODEL_SERVER_DEPLOYMENT not in app.deployments:
                continue  # the ingress, or an application that is not a model
            model_status = _STATUS.get(app.status, ModelStatus.LOADING)
            deployment = app.deployments[MODEL_SERVER_DEPLOYMENT]
            message = None
            if model_status in (ModelStatus.LOADING, ModelStatus.UNHEALTHY) and _serves_beside_others(deployment):
                model_status = ModelStatus.RUNNING  # one of several replicas dies or is replaced: the others serve
            if model_status in (ModelStatus.FAILED, ModelStatus.UNHEALTHY):
                message = summarize_failure(deployment.message or app.message)
            elif model_status == ModelStatus.RUNNING and not deployment.replica_states.get(ReplicaState.RUNNING):
                # Its replica died (Serve starts another): requests get 503 + Retry-After until one runs again.
                model_status, message = ModelStatus.LOADING, "restarting: its process died"
            states[model_id_of_app(name)] = DeploymentState(model_status, message)
        return states

    async def reserved_names(self) -> set[str]:
        status = await self._status.get(not_before=time.monotonic() - RESERVED_VIEW_AGE_S)
        others = {name for name, app in status.applications.items() if MODEL_SERVER_DEPLOYMENT not in app.deployments}
        return others | {self._own_app_name}

    async def client(self, model_id: str) -> ServeModelClient:
        client = self._clients.get(model_id)
        if client is None:
            try:
                handle = await _in(_HANDLE_THREADS, serve.get_app_handle, serve_app_name(model_id))
            except RayServeException as exc:  # deleted between the status check and now
                raise ModelNotFoundError(f"The model '{model_id}' does not exist", param="model") from exc
            client = self._clients[model_id] = ServeModelClient(model_id, handle, app_name=serve_app_name(model_id))
        return client


def _serves_beside_others(deployment: Any) -> bool:
    """A replica runs while another one starts, stops or fails (a replica of several died, an update rolls):
    Serve routes to the running ones. Not a sole replica in trouble: it alone is no reason to send requests."""
    states = deployment.replica_states
    return states.get(ReplicaState.RUNNING, 0) >= 1 and sum(states.values()) >= 2


def _running(app: Any) -> bool:
    """Whether the application runs; ModelLoadError with Serve's reason if it failed."""
    if app.status == ApplicationStatus.DEPLOY_FAILED:
        deployment = app.deployments.get(MODEL_SERVER_DEPLOYMENT)
        raise ModelLoadError(summarize_failure((deployment.message if deployment else "") or app.message))
    return app.status == ApplicationStatus.RUNNING


def _node_capacity(resources: dict[str, float]) -> NodeCapacity:
    # Ray's own names for its standard resources, and its per-node markers, are not custom resources.
    custom = {name: amount for name, amount in resources.items()
              if name not in _RAY_STANDARD_RESOURCES and not name.startswith(("node:", "accelerator_type:"))}
    return NodeCapacity(cpus=resources.get("CPU", 0.0), gpus=resources.get("GPU", 0.0),
                        memory_bytes=resources.get("memory", 0.0), custom=custom)


_RAY_STANDARD_RESOURCES = {"CPU", "GPU", "memory", "object_store_memory"}


def summarize_failure(message: str) -> str:
    """The informative line of a Serve failure message (its last 'SomeError: why' line)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if ":" in line and (head.endswith("Error") or head.endswith("Exception")):
            return line[:MAX_ERROR_CHARS]
    return (lines[-1] if lines else "unknown error")[:MAX_ERROR_CHARS]

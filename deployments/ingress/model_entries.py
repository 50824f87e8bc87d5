"""A model as the registry knows it: its status, where it came from, its last info; what a backend answers.

Each API load and unload is an AdminOperation whose `settled` event is set once it has finished either way, so an
admin route can wait for the outcome (Bodega's load answers "loaded" once the model serves)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from deployments.config import ModelConfig
from deployments.model_calls import ModelClient, ModelInfo, QueueStats
from engine.health import EngineStatus

if TYPE_CHECKING:
    from deployments.ingress.load_limits import ClusterCapacity


class ModelStatus(str, Enum):
    LOADING = "loading"
    RUNNING = "running"
    DEGRADED = "degraded"  # serving, but its engine's current step runs far past its expected time
    FAILED = "failed"
    UNHEALTHY = "unhealthy"
    UNLOADING = "unloading"


# A running replica's engine state, as the model reports it, read over Serve's view of the replica.
_ENGINE_STATUS = {
    EngineStatus.DEGRADED: ModelStatus.DEGRADED,
    EngineStatus.RESTARTING: ModelStatus.UNHEALTHY,
    EngineStatus.FAILED: ModelStatus.FAILED,
}


@dataclass
class DeploymentState:
    status: ModelStatus
    message: str | None = None


class ModelBackend(Protocol):
    async def deploy(self, config: ModelConfig) -> None:
        """Start the model; returns once it serves, raises ModelLoadError if it cannot."""

    async def undeploy(self, model_id: str) -> None:
        """Stop the model and free its memory; returns once it is gone."""

    async def deployments(self) -> dict[str, DeploymentState]: ...

    async def client(self, model_id: str) -> ModelClient: ...

    async def reserved_names(self) -> set[str]:
        """Application names a model must not take: the ingress's own and every application that is not a model."""

    async def capacity(self) -> ClusterCapacity:
        """Each node's total resources: what one replica could ever be given."""

    def replica_died(self, info: ModelInfo) -> bool:
        """Whether the sole replica that gave `info` is known dead now (False when it cannot be told from here)."""


@dataclass
class AdminOperation:
    """One admin load or unload: `settled` is set once it has finished either way; failed_with is the typed error a
    failed one raised. Each operation has its own, so a load cancelled by an unload still answers its own outcome."""

    settled: asyncio.Event = field(default_factory=asyncio.Event)
    failed_with: BaseException | None = None

    def finish(self, failure: BaseException | None = None) -> None:
        self.failed_with = failure
        self.settled.set()


@dataclass
class ModelEntry:
    model_id: str
    status: ModelStatus
    source: str  # "config" (serve_config.yaml) or "api" (admin load-model)
    config: ModelConfig | None = None
    error: str | None = None
    info: ModelInfo | None = None
    busy: bool = False  # a load or unload of ours is in flight: the backend's view lags behind
    seen_at: int = 0
    # The folder the backend was given when it is not the model_path sent (a repo id's snapshot): never shown.
    loaded_from: str | None = None
    # This entry's latest load or unload through the API: what a route that waits on it reads.
    operation: AdminOperation = field(default_factory=AdminOperation, repr=False)
    load_task: asyncio.Task | None = field(default=None, repr=False)  # a load in flight, cancelled by an unload
    # The pid of its sole replica once seen dead, until info comes from the replica Serve starts in its place.
    lost_replica_pid: int | None = None
    on_demand: bool = False  # loaded by a request that named it (the ingress's on_demand): requests wait for it

    def as_sent(self, message: str | None) -> str | None:
        """A failure message that names the model's path as it was sent."""
        if message is None or self.loaded_from is None or self.config is None:
            return message
        return message.replace(self.loaded_from, self.config.model_path)

    @property
    def current_status(self) -> ModelStatus:
        """The status to report: Serve's view of the replicas, and for a running one its engine's own."""
        if self.status == ModelStatus.RUNNING and self.lost_replica_pid is not None:
            return ModelStatus.UNHEALTHY
        if self.status == ModelStatus.RUNNING and self.info is not None:
            return _ENGINE_STATUS.get(self.info.health.status, self.status)
        return self.status

    @property
    def current_error(self) -> str | None:
        if self.status == ModelStatus.RUNNING and self.lost_replica_pid is not None:
            return f"its replica's process (pid {self.lost_replica_pid}) died; Serve is starting another"
        if self.current_status != self.status:
            return self.info.health.message
        return self.error


@dataclass
class ModelQueueStats:
    entry: ModelEntry
    stats: QueueStats | None

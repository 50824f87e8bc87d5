"""An engine's health as its clients report it: plain values, so the serving side (model info, the registry, /health)
reads them without importing the engine clients."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class EngineStatus(str, Enum):
    RUNNING = "running"
    DEGRADED = "degraded"  # alive, but no step has ended for far longer than a step takes here
    RESTARTING = "restarting"  # (SupervisedEngine) it died; a new engine is starting in its place
    FAILED = "failed"  # stopped: closed, never started, or died (past the restart budget where supervised)


@dataclass(frozen=True)
class EngineHealth:
    status: EngineStatus
    message: str | None = None  # why, when not running

    @property
    def alive(self) -> bool:
        return self.status in (EngineStatus.RUNNING, EngineStatus.DEGRADED)

"""What the registry reads from running models, each call bounded (a busy or dying model must not hold /health,
/metrics or loaded-models): info (memory, pid), queue stats, metrics."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from deployments.ingress.model_entries import ModelBackend, ModelEntry, ModelStatus
from deployments.model_calls import MetricsSnapshot, ModelInfo, QueueStats

logger = logging.getLogger("ray.serve.orchard")
INFO_TIMEOUT_S = 5.0


class ModelReadings:
    def __init__(self, backend: ModelBackend, lost: Callable[[ModelEntry], bool]) -> None:
        self._backend = backend
        self._lost = lost  # whether an entry's sole replica is known dead (its calls would wait for a new one)

    async def info(self, model_id: str) -> ModelInfo | None:
        return await self._read(model_id, lambda client: client.info(), "info")

    async def metrics(self, model_id: str) -> MetricsSnapshot | None:
        return await self._read(model_id, lambda client: client.metrics(), "metrics")

    async def stats(self, entry: ModelEntry) -> QueueStats | None:
        if entry.status != ModelStatus.RUNNING or self._lost(entry):
            return None
        return await self._read(entry.model_id, lambda client: client.queue_stats(), "queue stats")

    async def _read(self, model_id: str, call: Callable[[Any], Awaitable[Any]], what: str) -> Any:
        try:
            client = await self._backend.client(model_id)
            return await asyncio.wait_for(call(client), INFO_TIMEOUT_S)
        except Exception as exc:  # best effort: one model must not fail the route that reads them all
            logger.warning("no %s from model %s: %r", what, model_id, exc)
            return None


__all__ = ["INFO_TIMEOUT_S", "ModelReadings"]

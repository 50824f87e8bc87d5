"""Loads under the node's memory budget (node_memory.py): serve_config.yaml's running models counted at the memory
they measure, a load's room planned (or, for an on_demand model, waited for), and the least recently used idle
models unloaded first to make it."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Awaitable, Callable

from deployments.config import ModelConfig
from deployments.ingress.footprint import MIB
from deployments.ingress.model_entries import ModelEntry, ModelStatus
from deployments.ingress.model_readings import ModelReadings
from deployments.ingress.node_memory import LoadPlan, NodeMemory
from engine.errors import OrchardError

logger = logging.getLogger("ray.serve.orchard")

# Begins an unload and returns its entry, whose operation settles once the model's memory is free.
Unload = Callable[[str], Awaitable[ModelEntry]]


class BudgetedLoads:
    def __init__(self, memory: NodeMemory, readings: ModelReadings, timeout_s: float) -> None:
        self.memory = memory
        self._readings = readings
        self._timeout_s = timeout_s  # the longest an on_demand load waits for room its requests will free

    def refuse_unless_it_could_fit(self, config: ModelConfig, resolved: ModelConfig) -> None:
        """An on_demand load that could not fit even with every unpinned model gone: its 507 now, naming the pinned
        models that hold the room."""
        if not self.memory.residency.could_fit(self.memory.footprint(resolved)):
            self.memory.plan(config, resolved)

    async def count_configured(self, entries: list[ModelEntry]) -> None:
        """serve_config.yaml's running models, counted at MLX's memory they measure (pinned: the ingress could not
        bring one back)."""
        for entry in entries:
            if entry.source == "config" and not entry.on_demand and entry.status == ModelStatus.RUNNING \
                    and not self.memory.residency.holds(entry.model_id):
                info = await self._readings.info(entry.model_id)
                if info is not None:
                    measured = (info.memory.mlx_active_mb + info.memory.mlx_cache_mb) * MIB
                    self.memory.admit_configured(entry.model_id, int(measured))

    async def measure(self, model_id: str) -> None:
        """What a model's arrays hold once it serves (MLX's active memory: its buffer cache goes back when it idles),
        beside what was counted for it: read where it runs in a process of its own (Serve's replicas); in this
        process (the in-process backend) MLX's counters are every model's."""
        info = await self._readings.info(model_id)
        if info is not None and info.pid != os.getpid():
            self.memory.measured(model_id, int(info.memory.mlx_active_mb * MIB))

    async def make_room(
        self, entry: ModelEntry, config: ModelConfig, resolved: ModelConfig, plan: LoadPlan | None,
        entries: list[ModelEntry], unload: Unload,
    ) -> ModelConfig:
        """Room for the load (its plan, or one made now), the models it evicts unloaded; the config to deploy."""
        await self.count_configured(entries)
        if plan is None:  # an on_demand load waits for room its requests will free; an admin load does not
            plan = (await self.memory.plan_when_room(config, resolved, self._timeout_s)
                    if entry.on_demand else self.memory.plan(config, resolved))
        for model_id in plan.eviction.evict:  # least recently used first; each waited for until its memory is free
            logger.info("evicting model %s to make room under the memory budget", model_id)
            with contextlib.suppress(OrchardError):  # gone or going already: its memory is released by its unload
                evicted = await unload(model_id)
                await evicted.operation.settled.wait()
        self.memory.deploying(config.id)
        return plan.config


__all__ = ["BudgetedLoads"]

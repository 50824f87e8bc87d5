"""The registry's side of the node memory budget (issue 55): a load's footprint and the models to evict for it,
requests counted while they run (a model serving one is never evicted), idle models to unload.

The policy itself is residency.py's (plain Python); footprints are footprint.py's; this module ties them to model
configs and clients. Off unless the ingress's `memory.budget_bytes` is set.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from deployments.config import ModelConfig
from deployments.ingress.footprint import model_footprint, sized_config
from deployments.ingress.residency import GIB, EvictionPlan, Residency

logger = logging.getLogger("ray.serve.orchard")
# The client calls that run work on the model (counted while they run); info, stats and metrics are not.
COUNTED_CALLS = frozenset({"generate", "count_tokens", "embed", "count_text_tokens", "transcribe", "speak",
                           "generate_images", "load_adapter", "unload_adapter"})


@dataclass
class LoadPlan:
    eviction: EvictionPlan
    config: ModelConfig  # what the model loads with: the KV budget and prefix cache it was counted with


@dataclass
class MemoryCounters:
    loads: int = 0
    evictions: int = 0
    idle_unloads: int = 0


class NodeMemory:
    def __init__(self, budget_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.residency = Residency(budget_bytes, clock)
        self.counters = MemoryCounters()

    def plan(self, config: ModelConfig, resolved: ModelConfig) -> LoadPlan:
        """Room for a load (InsufficientMemoryError, 507, when there is none); `resolved` names its local files."""
        folder = None if resolved.uses_embedded_model else Path(resolved.model_path)
        footprint = model_footprint(resolved, folder)
        eviction = self.residency.reserve(config.id, footprint.total_bytes, config.pinned)
        self.counters.loads += 1
        self.counters.evictions += len(eviction.evict)
        logger.info("model %s: %.2f GiB counted against the budget of %.2f GiB%s", config.id,
                    footprint.total_bytes / GIB, self.residency.budget_bytes / GIB,
                    f"; evicting {', '.join(eviction.evict)} (least recently used first)" if eviction.evict else "")
        return LoadPlan(eviction, sized_config(resolved, footprint))

    def released(self, model_id: str) -> None:
        self.residency.release(model_id)

    def idle_models(self, configs: dict[str, ModelConfig]) -> list[str]:
        times = {model_id: c.idle_unload_s for model_id, c in configs.items() if c.idle_unload_s is not None}
        idle = self.residency.idle(times)
        self.residency.mark_evicting(idle)
        self.counters.idle_unloads += len(idle)
        return idle

    def counted(self, client: Any, model_id: str) -> "CountedClient":
        self.residency.touch(model_id)
        return CountedClient(client, model_id, self.residency)


class CountedClient:
    """A model's client whose work calls count as in flight on the model until they end (a stream: until it is
    exhausted or closed)."""

    def __init__(self, client: Any, model_id: str, residency: Residency) -> None:
        self._client, self._model_id, self._residency = client, model_id, residency

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        if name not in COUNTED_CALLS:
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            result = attribute(*args, **kwargs)
            return self._awaited(result) if inspect.isawaitable(result) else self._streamed(result)
        return call

    async def _awaited(self, result: Any) -> Any:
        self._residency.begin(self._model_id)
        try:
            return await result
        finally:
            self._residency.end(self._model_id)

    async def _streamed(self, stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
        self._residency.begin(self._model_id)
        try:
            async with contextlib.aclosing(stream) as items:  # type: ignore[type-var]
                async for item in items:
                    yield item
        finally:
            self._residency.end(self._model_id)


__all__ = ["CountedClient", "LoadPlan", "MemoryCounters", "NodeMemory"]

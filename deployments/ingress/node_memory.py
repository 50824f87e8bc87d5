"""The registry's side of the node memory budget (issue 55): a load's footprint and the models to evict for it,
requests counted while they run (a model serving one is never evicted), idle models to unload.

The policy itself is residency.py's (plain Python); footprints are footprint.py's; this module ties them to model
configs and clients. Off unless the ingress's `memory.budget_bytes` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from deployments.config import ModelConfig
from deployments.ingress.footprint import Footprint, model_footprint, sized_config
from deployments.ingress.residency import GIB, EvictionPlan, Residency
from deployments.metrics import families
from deployments.metrics.recorder import MetricsRecorder
from deployments.model_calls import MetricsSnapshot
from engine.errors import InsufficientMemoryError

logger = logging.getLogger("ray.serve.orchard")
ROOM_POLL_S = 0.1  # how often a waiting on_demand load looks for room
MAX_EVENTS = 50  # the latest loads, evictions and refusals loaded-models shows
# The client calls that run work on the model (counted while they run); info, stats and metrics are not.
COUNTED_CALLS = frozenset({"generate", "count_tokens", "embed", "count_text_tokens", "transcribe", "speak",
                           "generate_images", "load_adapter", "unload_adapter"})


@dataclass
class LoadPlan:
    eviction: EvictionPlan
    config: ModelConfig  # what the model loads with: the KV budget and prefix cache it was counted with


@dataclass
class MemoryCounters:
    """Per model: loads counted against the budget, and unloads to make room or when idle."""

    loads: Counter = field(default_factory=Counter)
    evictions: Counter = field(default_factory=Counter)
    idle_unloads: Counter = field(default_factory=Counter)


@dataclass(frozen=True)
class MemoryEvent:
    """One load, eviction, idle unload or refusal, as /v1/admin/loaded-models lists the latest."""

    at: int  # unix seconds
    event: str  # "load", "evict", "idle_unload", "refused"
    model_id: str
    bytes: int


class NodeMemory:
    def __init__(self, budget_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.residency = Residency(budget_bytes, clock)
        self.counters = MemoryCounters()
        self.events: deque[MemoryEvent] = deque(maxlen=MAX_EVENTS)

    def footprint(self, resolved: ModelConfig) -> int:
        return model_footprint(resolved).total_bytes

    def plan(self, config: ModelConfig, resolved: ModelConfig, waiting: bool = False,
             footprint: Footprint | None = None) -> LoadPlan:
        """Room for a load (InsufficientMemoryError, 507, when there is none); `resolved` names its local files.
        `waiting`: a refusal is not an event yet (the load tries again)."""
        footprint = footprint or model_footprint(resolved)
        held = {m.model_id: m.footprint_bytes for m in self.residency.models()}
        try:
            eviction = self.residency.reserve(config.id, footprint.total_bytes, config.pinned)
        except InsufficientMemoryError:
            if not waiting:
                self._event("refused", config.id, footprint.total_bytes)
            raise
        self.counters.loads[config.id] += 1
        self._event("load", config.id, footprint.total_bytes)
        for victim in eviction.evict:
            self.counters.evictions[victim] += 1
            self._event("evict", victim, held.get(victim, 0))
        logger.info("model %s: %.2f GiB counted against the budget of %.2f GiB%s", config.id,
                    footprint.total_bytes / GIB, self.residency.budget_bytes / GIB,
                    f"; evicting {', '.join(eviction.evict)} (least recently used first)" if eviction.evict else "")
        return LoadPlan(eviction, sized_config(resolved, footprint))

    async def plan_when_room(self, config: ModelConfig, resolved: ModelConfig, timeout_s: float) -> LoadPlan:
        """plan(), waiting while the room is held by models that are busy or loading (an on_demand load: its
        requests wait with it); at once InsufficientMemoryError when only pinned models could make it."""
        deadline = time.monotonic() + timeout_s
        footprint = model_footprint(resolved)  # read once: the files do not change meanwhile
        while True:
            try:
                return self.plan(config, resolved, waiting=True, footprint=footprint)
            except InsufficientMemoryError:
                if not self.residency.could_fit(footprint.total_bytes) or time.monotonic() > deadline:
                    self._event("refused", config.id, footprint.total_bytes)
                    raise
            await asyncio.sleep(ROOM_POLL_S)

    def admit_configured(self, model_id: str, measured_bytes: int) -> None:
        """A model Serve runs from serve_config.yaml: counted at what it measures, never unloaded (the ingress could
        not bring it back)."""
        if not self.residency.holds(model_id):
            self.residency.admit(model_id, measured_bytes, pinned=True)
            logger.info("model %s (serve_config.yaml): %.2f GiB measured, counted against the budget", model_id,
                        measured_bytes / GIB)

    def deploying(self, model_id: str) -> None:
        self.residency.deploying(model_id)

    def loaded(self, model_id: str) -> None:
        self.residency.loaded(model_id)

    def measured(self, model_id: str, measured_bytes: int) -> None:
        """What the model holds once it serves, beside what was counted for it; a model measuring more than its
        estimate is counted at what it measures (a footprint estimate that fell short shows in the log)."""
        estimate = self.residency.measured(model_id, measured_bytes)
        if estimate is None:
            return
        above = measured_bytes > estimate
        logger.log(logging.WARNING if above else logging.INFO,
                   "model %s holds %.2f GiB once loaded (MLX's active memory; its KV grows with its requests) "
                   "against %.2f GiB counted%s", model_id, measured_bytes / GIB, estimate / GIB,
                   ": counted at what it holds from now on" if above else "")

    def released(self, model_id: str) -> None:
        self.residency.release(model_id)

    def idle_models(self, configs: dict[str, ModelConfig]) -> list[str]:
        times = {model_id: c.idle_unload_s for model_id, c in configs.items() if c.idle_unload_s is not None}
        idle = self.residency.idle(times)
        self.residency.mark_evicting(idle)
        held = {m.model_id: m.footprint_bytes for m in self.residency.models()}
        for model_id in idle:
            self.counters.idle_unloads[model_id] += 1
            self.counters.evictions[model_id] += 1
            self._event("idle_unload", model_id, held.get(model_id, 0))
        return idle

    def _event(self, event: str, model_id: str, size: int) -> None:
        self.events.append(MemoryEvent(int(time.time()), event, model_id, size))

    def snapshots(self) -> list[MetricsSnapshot]:
        """orchard:model_loads_total, model_evictions_total and model_resident_bytes, per model."""
        resident = {m.model_id: m.footprint_bytes for m in self.residency.models() if not m.waiting}
        snapshots = []
        for model_id in sorted(set(resident) | set(self.counters.loads) | set(self.counters.evictions)):
            recorder = MetricsRecorder(model_id)
            recorder.set_total(families.MODEL_LOADS, self.counters.loads[model_id])
            recorder.set_total(families.MODEL_EVICTIONS, self.counters.evictions[model_id])
            recorder.set(families.RESIDENT_BYTES, resident.get(model_id, 0))
            snapshots.append(recorder.snapshot())
        return snapshots

    def describe(self) -> dict[str, Any]:
        """What /v1/admin/loaded-models shows of the budget: what it holds, and the latest events."""
        now = self.residency.now()
        return {
            "budget_bytes": self.residency.budget_bytes,
            "counted_bytes": self.residency.counted_bytes(),
            "resident_bytes": self.residency.resident_bytes(),
            "models": [{"id": m.model_id, "footprint_bytes": m.footprint_bytes, "measured_bytes": m.measured_bytes,
                        "pinned": m.pinned, "requests_running": m.in_flight, "idle_s": round(now - m.last_used, 1),
                        "loading": m.loading, "unloading": m.evicting} for m in self.residency.models()],
            "events": [vars(e) for e in self.events],
        }

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


__all__ = ["CountedClient", "LoadPlan", "MemoryCounters", "MemoryEvent", "NodeMemory"]

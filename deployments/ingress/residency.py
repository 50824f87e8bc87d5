"""Which models a node holds in memory, and which to unload to make room for a load: one memory budget across the
node's model applications, least recently used unpinned idle models out first (issue 55).

Plain Python (no Ray, no MLX): the registry tells it what loads, serves, finishes and unloads; it answers with the
models to evict, or refuses a load that cannot fit with a 507 naming the budget, the footprint and what is resident.
A load is counted from the moment it is accepted, so two loads racing for the last room cannot both take it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from engine.errors import InsufficientMemoryError

GIB = 1024**3


@dataclass
class ResidentModel:
    model_id: str
    footprint_bytes: int  # estimated before the load (weights, KV budget, caches)
    pinned: bool = False
    last_used: float = 0.0  # the clock's reading when a request last named it (or its load was accepted)
    in_flight: int = 0  # requests running on it now
    evicting: bool = False  # chosen to make room: its unload is under way
    loading: bool = False  # reserved, not serving yet: another load cannot unload it
    waiting: bool = False  # reserved, its room not free yet (its evictions under way): holds no memory yet
    measured_bytes: int | None = None  # what MLX held in it once it served (NodeMemory.measured)

    @property
    def evictable(self) -> bool:
        return not self.pinned and self.in_flight == 0 and not self.evicting and not self.loading


@dataclass
class EvictionPlan:
    """What a load takes: the models to unload first (least recently used first); its bytes are counted already."""

    model_id: str
    footprint_bytes: int
    evict: list[str] = field(default_factory=list)


class Residency:
    def __init__(self, budget_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.budget_bytes = budget_bytes
        self._clock = clock
        self._models: dict[str, ResidentModel] = {}

    # ---- what the registry tells it ----------------------------------------------
    def reserve(self, model_id: str, footprint_bytes: int, pinned: bool = False) -> EvictionPlan:
        """Room for `model_id`: the idle unpinned models to unload for it, least recently used first; the load is
        counted now. InsufficientMemoryError when even every such model gone would leave too little."""
        if model_id in self._models:  # loaded again (a failed load retried): its old reservation goes first
            self.release(model_id)
        free = self.budget_bytes - self.counted_bytes()
        evict: list[str] = []
        for candidate in sorted((m for m in self._models.values() if m.evictable), key=lambda m: m.last_used):
            if free >= footprint_bytes:
                break
            evict.append(candidate.model_id)
            free += candidate.footprint_bytes
        if free < footprint_bytes:
            raise self._refusal(model_id, footprint_bytes)
        for victim in evict:
            self._models[victim].evicting = True
        self._models[model_id] = ResidentModel(model_id, footprint_bytes, pinned, last_used=self._clock(), loading=True,
                                               waiting=True)
        return EvictionPlan(model_id, footprint_bytes, evict)

    def deploying(self, model_id: str) -> None:
        """Its room is free (its evictions are done): it starts taking memory now."""
        model = self._models.get(model_id)
        if model is not None:
            model.waiting = False

    def loaded(self, model_id: str) -> None:
        """Its load serves: from now on it can be unloaded for another."""
        model = self._models.get(model_id)
        if model is not None:
            model.loading = model.waiting = False
            model.last_used = self._clock()

    def measured(self, model_id: str, measured_bytes: int) -> int | None:
        """What the model holds, read once it serves: above its estimate, it is counted at that from now on (later
        loads are planned against what it really holds). Its footprint before; None: no longer counted."""
        model = self._models.get(model_id)
        if model is None:
            return None
        estimate = model.footprint_bytes
        model.measured_bytes = measured_bytes
        model.footprint_bytes = max(estimate, measured_bytes)
        return estimate

    def admit(self, model_id: str, footprint_bytes: int, pinned: bool = False) -> None:
        """A model found running (serve_config.yaml's, or one the ingress finds at a restart): counted as it is."""
        if model_id not in self._models:
            self._models[model_id] = ResidentModel(model_id, footprint_bytes, pinned, last_used=self._clock())

    def holds(self, model_id: str) -> bool:
        return model_id in self._models

    def release(self, model_id: str) -> None:
        """Its memory is free again (unloaded, evicted, or its load failed)."""
        self._models.pop(model_id, None)

    def touch(self, model_id: str) -> None:
        model = self._models.get(model_id)
        if model is not None:
            model.last_used = self._clock()

    def begin(self, model_id: str) -> None:
        model = self._models.get(model_id)
        if model is not None:
            model.in_flight += 1
            model.last_used = self._clock()

    def end(self, model_id: str) -> None:
        model = self._models.get(model_id)
        if model is not None:
            model.in_flight = max(0, model.in_flight - 1)
            model.last_used = self._clock()

    def mark_evicting(self, model_ids: list[str]) -> None:
        """Their unload is under way (idle ones): no longer candidates, still counted until released."""
        for model_id in model_ids:
            if model_id in self._models:
                self._models[model_id].evicting = True

    # ---- what it answers -----------------------------------------------------------
    def resident_bytes(self) -> int:
        """What the models hold now: serving, loading and unloading ones, not loads still waiting for room."""
        return sum(m.footprint_bytes for m in self._models.values() if not m.waiting)

    def could_fit(self, footprint_bytes: int) -> bool:
        """Whether the load fits once models that are busy or loading now are done (only pinned ones stay)."""
        return footprint_bytes <= self.budget_bytes - sum(m.footprint_bytes for m in self._models.values() if m.pinned)

    def counted_bytes(self) -> int:
        """The footprints of every model counted (evicting ones too, until their unload frees them)."""
        return sum(m.footprint_bytes for m in self._models.values())

    def idle(self, idle_unload_s: dict[str, float]) -> list[str]:
        """The models past their idle time (`idle_unload_s` by model id), not pinned and running nothing."""
        now = self._clock()
        return [m.model_id for m in self._models.values()
                if m.model_id in idle_unload_s and m.evictable and now - m.last_used >= idle_unload_s[m.model_id]]

    def now(self) -> float:
        return self._clock()

    def models(self) -> list[ResidentModel]:
        return sorted(self._models.values(), key=lambda m: m.model_id)

    def _refusal(self, model_id: str, footprint_bytes: int) -> InsufficientMemoryError:
        held = ", ".join(f"{m.model_id} {m.footprint_bytes / GIB:.2f} GiB" + _why_kept(m) for m in self.models())
        return InsufficientMemoryError(
            f"The model '{model_id}' needs about {footprint_bytes / GIB:.2f} GiB; the memory budget is "
            f"{self.budget_bytes / GIB:.2f} GiB and the models it holds cannot make room ({held or 'none'}): unload "
            "one, unpin one, or raise memory.budget_bytes", param="model")


def _why_kept(model: ResidentModel) -> str:
    reasons = [r for r, on in (("pinned", model.pinned), (f"{model.in_flight} requests running", model.in_flight),
                                 ("unloading", model.evicting), ("loading", model.loading)) if on]
    return f" ({', '.join(reasons)})" if reasons else ""


__all__ = ["EvictionPlan", "Residency", "ResidentModel"]

"""Which per-request adapters an engine holds: name -> slot of the adapter bank, least recently used first out.

Plain Python (the bank, bank.py, holds the weights). A slot is free when no named adapter holds it and no live
request still runs on it: an adapter unloaded while requests use it keeps its weights in its slot until they end, so
nothing in flight changes model mid-answer. Each load gets a new uid, which keys its requests' prefix-cache blocks:
a reloaded adapter (new weights, same name) never meets the old one's KV.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

from engine.errors import InvalidRequestError, ModelNotFoundError, RetryLaterError


class AdapterSlotsBusyError(RetryLaterError):
    """Every adapter slot holds an adapter that running requests use."""

    code = "adapter_slots_busy"


@dataclass
class LoadedAdapter:
    name: str
    slot: int
    uid: int
    path: str
    rank: int
    nbytes: int
    last_used: int = 0


class AdapterSlots:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # slots 1..capacity (0: no adapter)
        self._by_name: dict[str, LoadedAdapter] = {}
        self._uids = itertools.count(1)
        self._clock = itertools.count(1)

    def find(self, name: str) -> LoadedAdapter:
        """The loaded adapter of this name, marked used now; ModelNotFoundError if none is loaded."""
        adapter = self._by_name.get(name)
        if adapter is None:
            raise ModelNotFoundError(f"No adapter '{name}' is loaded on this model", param="model")
        adapter.last_used = next(self._clock)
        return adapter

    def get(self, name: str) -> LoadedAdapter | None:
        return self._by_name.get(name)

    def listing(self) -> list[LoadedAdapter]:
        return sorted(self._by_name.values(), key=lambda adapter: adapter.slot)

    def choose_slot(self, in_use: Callable[[int], bool]) -> tuple[int, LoadedAdapter | None]:
        """A slot for a new adapter, and the adapter to evict from it (the least recently used one no request
        uses) when none is free; AdapterSlotsBusyError when every slot is held by an adapter in use."""
        if self.capacity < 1:
            raise InvalidRequestError("This model serves no per-request adapters (max_loras is 0)", param="max_loras")
        held = {adapter.slot for adapter in self._by_name.values()}
        for slot in range(1, self.capacity + 1):
            if slot not in held and not in_use(slot):
                return slot, None
        idle = [adapter for adapter in self._by_name.values() if not in_use(adapter.slot)]
        if not idle:
            raise AdapterSlotsBusyError(
                f"All {self.capacity} adapter slots (max_loras) hold adapters that running requests use; "
                "retry when they finish", retry_after_s=1)
        victim = min(idle, key=lambda adapter: adapter.last_used)
        return victim.slot, victim

    def add(self, name: str, slot: int, path: str, rank: int, nbytes: int) -> LoadedAdapter:
        adapter = LoadedAdapter(name, slot, next(self._uids), path, rank, nbytes, next(self._clock))
        self._by_name[name] = adapter
        return adapter

    def remove(self, name: str) -> LoadedAdapter:
        adapter = self._by_name.pop(name, None)
        if adapter is None:
            raise ModelNotFoundError(f"No adapter '{name}' is loaded on this model", param="model")
        return adapter


__all__ = ["AdapterSlots", "AdapterSlotsBusyError", "LoadedAdapter"]

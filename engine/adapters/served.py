"""A model's per-request adapters as its engine serves them: read and checked, written to a bank slot, named."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import mlx.nn as nn

from engine.adapters.bank import AdapterBank
from engine.adapters.registry import AdapterSlots, LoadedAdapter
from engine.adapters.weights import read_adapter
from engine.errors import InvalidRequestError, ModelExistsError

logger = logging.getLogger(__name__)


class ServedAdapters:
    def __init__(self, model: nn.Module, capacity: int, max_rank: int, refused: str | None = None) -> None:
        """`refused`: why this model takes no per-request adapters (None: it does, up to `capacity` at once)."""
        self._model = model
        self.max_rank = max_rank
        self.refused = refused or ("max_loras is 0" if capacity < 1 else None)
        self.slots = AdapterSlots(capacity if self.refused is None else 0)
        self.bank = AdapterBank(model) if self.refused is None else None

    @property
    def active(self) -> bool:
        """An adapter was ever loaded: only then do forwards look at their rows' slots."""
        return self.bank is not None and self.bank.num_slots > 1

    def load(self, name: str, path: Path, in_use: Callable[[int], bool]) -> LoadedAdapter:
        """Read `path` into a free slot (or the least recently used idle adapter's); raises a typed error naming
        the problem (nothing changes then)."""
        if self.bank is None:
            raise InvalidRequestError(f"This model serves no per-request adapters: {self.refused}", param="model")
        if self.slots.get(name) is not None:
            raise ModelExistsError(f"An adapter '{name}' is already loaded on this model; unload it first",
                                   param="name")
        weights = read_adapter(path, self._model, "adapter_path", self.max_rank)
        slot, evicted = self.slots.choose_slot(in_use)
        if evicted is not None:
            self.slots.remove(evicted.name)
            logger.info("adapter %s unloaded (least recently used) for %s", evicted.name, name)
        self.bank.write(slot, weights)
        adapter = self.slots.add(name, slot, str(path), weights.rank, weights.nbytes)
        logger.info("adapter %s loaded from %s: slot %d, rank %d, %d tensors", name, path, slot, weights.rank,
                    2 * len(weights.deltas))
        return adapter

    def unload(self, name: str) -> LoadedAdapter:
        """New requests can no longer name it; requests already running on it finish on it."""
        return self.slots.remove(name)


__all__ = ["ServedAdapters"]

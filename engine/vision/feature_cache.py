"""The vision tower's output per image, kept across requests and turns: a prompt whose every image is here merges
the kept features instead of running the tower again.

Plain Python: entries are any objects with `nbytes` (MLX arrays in the engine), least recently used first out
once the byte budget is spent. Keyed by an image's digest (its decoded pixels: engine/vision/inputs.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence


@dataclass
class FeatureCacheStats:
    hits: int = 0  # prompts whose every image was kept (no tower run)
    misses: int = 0  # prompts with images that ran the tower
    entries: int = 0
    bytes: int = 0
    budget_bytes: int = 0


@dataclass
class VisionTowerStats:
    """The batched vision tower's runs since the engine started (mlx-vlm's own tower path is not timed apart)."""

    images: int = 0
    # Wall time of its forwards: the first runs' waited for and timed (timed_runs), later ones' at the rate those
    # gave, since they are left lazy (vision/model.py, TIMED_TOWER_RUNS).
    seconds: float = 0.0
    timed_runs: int = 0


class FeatureCache:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = max(0, budget_bytes)
        self._entries: OrderedDict[str, Any] = OrderedDict()
        self._bytes = 0
        self._hits = 0
        self._misses = 0

    def lookup(self, digests: Sequence[str]) -> list[Any] | None:
        """Every image's features in order (each now most recently used), or None if any is missing."""
        if not digests or any(d not in self._entries for d in digests):
            self._misses += bool(digests)
            return None
        self._hits += 1
        for digest in digests:
            self._entries.move_to_end(digest)
        return [self._entries[d] for d in digests]

    def holds(self, digests: Sequence[str]) -> bool:
        """Every image kept (a look that counts nothing and moves nothing)."""
        return bool(digests) and all(d in self._entries for d in digests)

    def put(self, digest: str, features: Any) -> None:
        """Keep one image's features, evicting the least recently used; one larger than the budget is not kept."""
        size = int(features.nbytes)
        if size > self.budget_bytes:
            return
        old = self._entries.pop(digest, None)
        if old is not None:
            self._bytes -= int(old.nbytes)
        while self._entries and self._bytes + size > self.budget_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= int(evicted.nbytes)
        self._entries[digest] = features
        self._bytes += size

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def stats(self) -> FeatureCacheStats:
        return FeatureCacheStats(self._hits, self._misses, len(self._entries), self._bytes, self.budget_bytes)


__all__ = ["FeatureCache", "FeatureCacheStats", "VisionTowerStats"]

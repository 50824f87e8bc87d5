"""The vision-feature cache's bookkeeping (plain Python): least recently used out by bytes, all-or-nothing lookups."""

from __future__ import annotations

from dataclasses import dataclass

from engine.vision.feature_cache import FeatureCache


@dataclass
class Features:
    nbytes: int


def test_lookup_needs_every_image_and_refreshes_them():
    cache = FeatureCache(300)
    cache.put("a", Features(100))
    cache.put("b", Features(100))
    assert cache.lookup(["a", "c"]) is None
    assert cache.lookup([]) is None
    assert [f.nbytes for f in cache.lookup(["b", "a"])] == [100, 100]
    cache.put("c", Features(100))
    cache.put("d", Features(100))  # "b" is the least recently used (the lookup refreshed b then a)
    assert cache.lookup(["b"]) is None
    assert cache.lookup(["a", "c", "d"]) is not None
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.entries, stats.bytes, stats.budget_bytes) == (2, 2, 3, 300, 300)


def test_an_entry_larger_than_the_budget_is_not_kept_and_a_replaced_one_is_counted_once():
    cache = FeatureCache(250)
    cache.put("a", Features(100))
    cache.put("big", Features(251))
    assert cache.lookup(["big"]) is None and cache.lookup(["a"]) is not None
    cache.put("a", Features(200))
    assert cache.stats().bytes == 200 and cache.stats().entries == 1
    cache.put("b", Features(100))  # 300 > 250: "a" goes
    assert cache.lookup(["a"]) is None and cache.stats().bytes == 100
    cache.clear()
    assert cache.stats().entries == 0 and cache.stats().bytes == 0
    assert FeatureCache(0).stats().budget_bytes == 0

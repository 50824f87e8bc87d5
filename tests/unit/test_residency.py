"""The node's memory budget across models (deployments/ingress/residency.py): least recently used idle unpinned
models make room for a load; pinned and busy ones never do; a load that cannot fit is refused naming why."""

from __future__ import annotations

import pytest

from deployments.api.errors import wire_error
from deployments.ingress.residency import Residency
from engine.errors import InsufficientMemoryError

GIB = 1024**3


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0  # every reading later than the last
        return self.now


class Served(Residency):
    """Loads that serve at once (the registry tells `loaded` when a load's model serves)."""

    def reserve(self, model_id, footprint_bytes, pinned=False):
        plan = super().reserve(model_id, footprint_bytes, pinned)
        self.loaded(model_id)
        return plan


def residency(budget_gib: float = 10) -> Residency:
    return Served(int(budget_gib * GIB), Clock())


def test_loads_that_fit_evict_nothing_and_the_least_recently_used_goes_first():
    r = residency(10)
    for name in ("a", "b", "c"):
        assert r.reserve(name, 3 * GIB).evict == []
    r.touch("a")  # b is now the least recently used
    plan = r.reserve("d", 3 * GIB)
    assert plan.evict == ["b"]
    r.release("b")
    assert r.counted_bytes() == 9 * GIB
    assert r.reserve("e", 5 * GIB).evict == ["c", "a"]  # c, then a (touched before d was loaded)


def test_pinned_and_busy_models_are_never_evicted_and_the_refusal_names_them():
    r = residency(10)
    r.reserve("pinned", 4 * GIB, pinned=True)
    r.reserve("busy", 4 * GIB)
    r.begin("busy")
    with pytest.raises(InsufficientMemoryError) as refused:
        r.reserve("new", 3 * GIB)
    message = refused.value.message
    assert wire_error(refused.value).status == 507
    for words in ("'new' needs about 3.00 GiB", "budget is 10.00 GiB", "pinned 4.00 GiB (pinned)",
                  "busy 4.00 GiB (1 requests running)"):
        assert words in message, message
    r.end("busy")
    assert r.reserve("new", 3 * GIB).evict == ["busy"]


def test_a_model_larger_than_the_budget_is_refused_even_with_nothing_loaded():
    with pytest.raises(InsufficientMemoryError, match="budget is 2.00 GiB"):
        residency(2).reserve("huge", 3 * GIB)


def test_two_loads_racing_for_the_last_room_cannot_both_take_it():
    r = residency(10)
    r.reserve("a", 6 * GIB, pinned=True)
    r.reserve("b", 3 * GIB)  # counted from its reservation, before it serves
    with pytest.raises(InsufficientMemoryError):
        r.reserve("c", 5 * GIB)  # b could go, but 1 + 3 < 5
    assert r.reserve("d", 4 * GIB).evict == ["b"]
    with pytest.raises(InsufficientMemoryError):  # b is already being evicted (for d): not counted twice
        r.reserve("e", 4 * GIB)


def test_idle_models_past_their_time_unload_unless_pinned_or_busy():
    clock = Clock()
    r = Served(10 * GIB, clock)
    r.reserve("quiet", GIB)
    r.reserve("pinned", GIB, pinned=True)
    r.reserve("busy", GIB)
    r.begin("busy")
    clock.now += 100
    assert r.idle({"quiet": 50, "pinned": 50, "busy": 50}) == ["quiet"]
    assert r.idle({"quiet": 500}) == []
    r.touch("quiet")
    assert r.idle({"quiet": 50}) == []


def test_a_model_found_running_is_counted_once_and_a_retried_load_replaces_its_reservation():
    r = residency(10)
    r.admit("configured", 2 * GIB)
    r.admit("configured", 2 * GIB)
    assert r.counted_bytes() == 2 * GIB
    r.reserve("x", 3 * GIB)
    r.reserve("x", 4 * GIB)
    assert r.counted_bytes() == 6 * GIB


def test_a_model_still_loading_is_not_unloaded_for_another_load():
    r = Residency(10 * GIB, Clock())
    r.reserve("first", 6 * GIB)  # not serving yet
    with pytest.raises(InsufficientMemoryError, match=r"first 6.00 GiB \(loading\)"):
        r.reserve("second", 6 * GIB)
    r.loaded("first")
    assert r.reserve("second", 6 * GIB).evict == ["first"]


def test_a_model_measuring_more_than_its_estimate_is_counted_at_what_it_holds():
    r = residency(10)
    r.reserve("a", 3 * GIB)
    r.reserve("b", 3 * GIB)
    assert r.measured("a", 2 * GIB) == 3 * GIB  # under its estimate: still counted at the estimate
    assert r.measured("b", 5 * GIB) == 3 * GIB  # over it: counted at what it holds from now on
    assert [(m.model_id, m.footprint_bytes, m.measured_bytes) for m in r.models()] == [
        ("a", 3 * GIB, 2 * GIB), ("b", 5 * GIB, 5 * GIB)]
    assert r.counted_bytes() == 8 * GIB
    assert r.reserve("c", 3 * GIB).evict == ["a"]  # 2 GiB free: the least recently used makes room
    assert r.measured("gone", GIB) is None

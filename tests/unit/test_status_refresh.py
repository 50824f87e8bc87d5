"""StatusRefresher (deployments/ingress/status_refresh.py): a caller cancelled just as the fetch it waits on ends is
cancelled, not answered. Python 3.11's wait_for returned normally there, and the registry's poll task outlived its
cancel: the registry's close waited on it for ever (the CI runs that hung in a test stack's teardown)."""

from __future__ import annotations

import asyncio

from deployments.ingress.status_refresh import StatusRefresher


async def cancelled_as_the_fetch_ends(iterations: int) -> str:
    release = asyncio.Event()

    async def fetch() -> None:
        await release.wait()

    refresher = StatusRefresher(fetch, wait_s=5.0)
    caller = asyncio.create_task(refresher.refresh(force=True))
    for _ in range(2):  # the caller now waits on the fetch
        await asyncio.sleep(0)
    release.set()
    for _ in range(iterations):  # the fetch ends, and its end reaches the caller, over a few loop iterations
        await asyncio.sleep(0)
    if caller.done():
        return "answered first"
    caller.cancel()
    try:
        await caller
    except asyncio.CancelledError:
        return "cancelled"
    return "answered"


def test_a_caller_cancelled_as_the_fetch_ends_is_cancelled():
    outcomes = [asyncio.run(cancelled_as_the_fetch_ends(n)) for n in range(8)]
    assert "answered" not in outcomes, outcomes
    assert outcomes.count("cancelled") >= 2 and "answered first" in outcomes  # both sides of the window ran

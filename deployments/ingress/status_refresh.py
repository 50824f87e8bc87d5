"""Serve's view of the models, fetched by one task at a time, and waited for at most a bound.

Every status route (/health, /ready, /metrics, /v1/queue/stats, loaded-models) and a request for a model the ingress
does not know first refresh that view, and `serve.status` waits on Serve's controller: busy with a failing
deployment it took minutes (issue 48: an unknown model's request and /metrics did not answer). Past the bound, a
caller answers from the view it has, and the fetch goes on and updates it when it lands.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

logger = logging.getLogger("ray.serve.orchard")
# A fresh view is reused for this long; a caller waits this long for one.
MIN_REFRESH_INTERVAL_S = 0.25
REFRESH_WAIT_S = 2.0


class StatusRefresher:
    def __init__(self, refresh_now: Callable[[], Awaitable[None]], wait_s: float = REFRESH_WAIT_S) -> None:
        self._refresh_now = refresh_now  # fetches the backend's view and applies it
        self.wait_s = wait_s
        self._task: asyncio.Future | None = None
        self._started_at = 0.0
        self._done_at = 0.0

    async def refresh(self, force: bool = False) -> None:
        """A view no older than MIN_REFRESH_INTERVAL_S (force: one fetched after this call), waited for at most
        wait_s; the fetch's error, if it failed in time."""
        called_at = time.monotonic()
        task = self._task
        if task is None or task.done():
            if not force and called_at - self._done_at < MIN_REFRESH_INTERVAL_S:
                return
            task = self._start(None)
        elif force and self._started_at < called_at:
            task = self._start(task)  # after the one in flight, so views land in order
        # asyncio.wait, not wait_for(shield(task)): Python 3.11's wait_for returns normally when the caller is
        # cancelled just as the fetch ends, and the registry's poll task then outlived its cancel (a close hung).
        done, _ = await asyncio.wait({task}, timeout=self.wait_s)
        if not done:
            logger.warning("Serve's status took over %.1f s: answering from the last view while it comes", self.wait_s)
            return
        task.result()

    def _start(self, after: asyncio.Future | None) -> asyncio.Future:
        self._started_at = time.monotonic()
        self._task = asyncio.ensure_future(self._run(after))
        return self._task

    async def _run(self, after: asyncio.Future | None) -> None:
        if after is not None:
            await asyncio.wait([after])
        try:
            await self._refresh_now()
        finally:
            self._done_at = time.monotonic()

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.wait([self._task])

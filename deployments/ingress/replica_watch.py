"""A model's sole replica whose process died, seen from the ingress at once.

Serve notices a dead replica at its next health check (every 10 s) and meanwhile holds calls for it: a chat
waited 12.7 s, and /health said "ok" for 5 s (its info call timed out) after a kill -9. The ingress on the replica's
node can tell at once: the replica's pid (its info says which, and where) no longer runs. The model then shows as
unhealthy and is refused with 503 + Retry-After until info comes from the replica Serve starts in its place.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Awaitable, Callable, TypeVar

from deployments.ingress.model_entries import ModelBackend, ModelEntry, ModelStatus
from deployments.model_calls import ModelInfo

logger = logging.getLogger("ray.serve.orchard")
T = TypeVar("T")
PROBE_S = 0.1  # while a call to a replica waits, how often its process is looked at


class ReplicaWatch:
    def __init__(self, backend: ModelBackend, fetch_info: Callable[[str], Awaitable[ModelInfo | None]],
                 spawn: Callable[..., asyncio.Task]) -> None:
        self._backend = backend
        self._fetch_info = fetch_info
        self._spawn = spawn
        self._rechecks: dict[str, asyncio.Task] = {}  # model id -> its info fetch from the next replica

    def lost(self, entry: ModelEntry) -> bool:
        """Whether the entry's sole replica is known dead (probed now: a signal 0, no call to the replica); while
        it is, one info fetch at a time waits for the replica that replaces it."""
        if entry.lost_replica_pid is None:
            info = entry.info
            if entry.status != ModelStatus.RUNNING or info is None or not self._backend.replica_died(info):
                return False
            entry.lost_replica_pid = info.pid
            logger.warning("model %s: its replica's process (pid %d) died", entry.model_id, info.pid)
        recheck = self._rechecks.get(entry.model_id)
        if recheck is None or recheck.done():
            self._rechecks[entry.model_id] = self._spawn(self._recheck(entry))
        return True

    async def unless_lost(self, entry: ModelEntry, call: Awaitable[T]) -> T | None:
        """`call`'s result, or None once the replica is seen dead while it waits (a kill lands a few ms after the
        signal: a call sent just then would be held by Serve until the new replica serves)."""
        pending = asyncio.ensure_future(call)
        while True:
            done, _ = await asyncio.wait([pending], timeout=PROBE_S)
            if done:
                return pending.result()
            if self.lost(entry):
                pending.cancel()
                return None

    async def _recheck(self, entry: ModelEntry) -> None:
        info = await self._fetch_info(entry.model_id)
        if info is not None and info.pid != entry.lost_replica_pid:
            entry.info, entry.lost_replica_pid = info, None
            logger.info("model %s: a new replica (pid %d) serves", entry.model_id, info.pid)


def process_gone(pid: int) -> bool:
    """Whether no process of that pid runs (a zombie, killed and not yet reaped by its parent, is gone too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # someone else's: it exists
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):  # no /proc (macOS): the signal said it exists
        return False
    return state in ("Z", "X")

"""SupervisedEngine: keeps one model's engine serving through engine deaths.

An engine client reports its engine's death at once (the process client's socket closes; the thread client's
loop raises). The supervisor then starts a new engine in its place from the same factory, within a restart
budget, and re-submits the requests that had produced nothing yet: their clients only see a later first token.
Requests that had streamed some output end with the engine's error (their text cannot be resumed exactly).
While the new engine loads, new requests are refused with EngineRestartingError (503 + Retry-After). The
per-request adapters the dead engine held are loaded into the new one before it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.adapters.registry import LoadedAdapter
from engine.client.interface import EngineClient, RequestStream, RetriedStream, ServedModel
from engine.health import EngineHealth, EngineStatus
from engine.core import EngineStats
from engine.errors import EngineDeadError, EngineRestartingError, OrchardError
from engine.request import Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartBudget:
    """At most max_restarts engine restarts within window_s; one more death marks the model failed."""

    max_restarts: int = 3
    window_s: float = 600.0


class SupervisedEngine:
    def __init__(self, new_client: Callable[[], EngineClient], budget: RestartBudget = RestartBudget()) -> None:
        self._new_client = new_client
        self._budget = budget
        self._client: EngineClient | None = None
        self._status = EngineStatus.FAILED
        self._failure = "The engine has not started"
        self._restarts: deque[float] = deque()
        self._load_s = 0.0
        self._restart_began = 0.0
        self._death = ""  # why the engine being replaced died
        self._changed = asyncio.Event()  # replaced at every status change; waiters re-check
        self._watch: asyncio.Task | None = None
        self._stats: EngineStats | None = None  # the dead engine's last, while a new one loads
        self.restarts_total = 0

    # ---- lifecycle -------------------------------------------------------
    async def start(self) -> None:
        """Start the first engine; raises what its start raised (a load failure is not restarted)."""
        started = time.monotonic()
        client = self._new_client()
        await client.start()
        self._load_s = time.monotonic() - started
        self._client = client
        self._set_status(EngineStatus.RUNNING)
        self._watch = asyncio.create_task(self._supervise())

    async def close(self, error: OrchardError | None = None) -> None:
        """Stop for good; open streams end with `error` (EngineDeadError by default)."""
        self._failure = error.message if error is not None else "The engine was closed"
        self._set_status(EngineStatus.FAILED)
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self._client is not None:
            await self._client.close(error)

    async def _supervise(self) -> None:
        while True:
            client = self._client
            reason = (await client.wait_dead()).message
            if self._status is EngineStatus.FAILED:  # closed by us
                return
            self._stats, self._death = client.stats(), reason
            logger.error("the engine died (%s); restarting it", reason)
            self._restart_began = time.monotonic()
            self._set_status(EngineStatus.RESTARTING)
            await client.close()  # reaps the dead process; its streams have already ended
            if not await self._restart(reason, client.adapters):
                return

    async def _restart(self, reason: str, adapters: list[LoadedAdapter]) -> bool:
        """Start engines until one runs or the budget is spent (then FAILED); whether one runs."""
        while self._within_budget():
            self._restarts.append(time.monotonic())
            self.restarts_total += 1
            client = self._new_client()
            try:
                await client.start()
            except asyncio.CancelledError:  # closed while the new engine loads: it must not outlive us
                await client.close()
                raise
            except Exception as exc:
                reason = exc.message if isinstance(exc, OrchardError) else repr(exc)
                logger.error("the engine did not restart: %s", reason)
                continue
            await self._reload_adapters(client, adapters)
            self._client = client
            logger.info("engine restarted in %.1f s", time.monotonic() - self._restart_began)
            self._set_status(EngineStatus.RUNNING)
            return True
        count, window = len(self._restarts) + 1, self._budget.window_s
        self._failure = f"The engine died {count} times within {window:.0f} s; last: {reason}"
        logger.error("%s; giving up (unload and load the model to try again)", self._failure)
        self._set_status(EngineStatus.FAILED)
        return False

    @staticmethod
    async def _reload_adapters(client: EngineClient, adapters: list[LoadedAdapter]) -> None:
        """The dead engine's per-request adapters (its client's last listing), into the engine replacing it."""
        for adapter in adapters:
            try:
                await client.load_adapter(adapter.name, Path(adapter.path))
            except OrchardError as exc:
                logger.error("adapter %s was not loaded into the new engine: %s", adapter.name, exc.message)

    # ---- per-request adapters --------------------------------------------
    async def load_adapter(self, name: str, path: Path) -> list[LoadedAdapter]:
        return await self._running_client().load_adapter(name, path)

    async def unload_adapter(self, name: str) -> list[LoadedAdapter]:
        return await self._running_client().unload_adapter(name)

    @property
    def adapters(self) -> list[LoadedAdapter]:
        return self._client.adapters if self._client is not None else []

    def _within_budget(self) -> bool:
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > self._budget.window_s:
            self._restarts.popleft()
        return len(self._restarts) < self._budget.max_restarts

    def _set_status(self, status: EngineStatus) -> None:
        self._status = status
        self._changed.set()
        self._changed = asyncio.Event()

    # ---- requests --------------------------------------------------------
    def submit(self, request: Request) -> "ResubmittingStream":
        """Check and queue a request (typed errors at once, EngineRestartingError while an engine loads)."""
        client = self._running_client()
        stream = client.submit(request)
        # What a new engine needs to run it again (the old engine may have changed the request object).
        return ResubmittingStream(self, request.as_submitted(), client, stream)

    def abort(self, request_id: str) -> None:
        if self._client is not None:
            self._client.abort(request_id)

    def _running_client(self) -> EngineClient:
        if self.health().status is EngineStatus.RESTARTING:
            raise EngineRestartingError(self._expected_restart_message(), retry_after_s=self.retry_after_s)
        if self._status is EngineStatus.FAILED or self._client is None:
            raise EngineDeadError(self._failure)
        return self._client

    async def resubmit(self, request: Request, dead: EngineClient) -> tuple[EngineClient, RequestStream]:
        """Queue a request (a fresh copy, submitted once) again on the engine that replaced `dead`, once it runs;
        raises if none will."""
        while self._status is not EngineStatus.FAILED:
            client = self._client
            if self._status is EngineStatus.RUNNING and client is not dead and client.health().alive:
                logger.info("request %s re-queued on the restarted engine", request.request_id)
                return client, client.submit(request)
            await self._changed.wait()
        raise EngineDeadError(self._failure)

    # ---- state -----------------------------------------------------------
    @property
    def served(self) -> ServedModel:
        if self._client is None:
            raise EngineDeadError(self._failure)
        return self._client.served

    def stats(self) -> EngineStats:
        if self._status is EngineStatus.RESTARTING and self._stats is not None:
            return self._stats
        if self._client is None:
            raise EngineDeadError(self._failure)
        return self._client.stats()

    def health(self) -> EngineHealth:
        if self._status is EngineStatus.RESTARTING:
            return EngineHealth(EngineStatus.RESTARTING, self._expected_restart_message())
        if self._status is EngineStatus.FAILED or self._client is None:
            return EngineHealth(EngineStatus.FAILED, self._failure)
        health = self._client.health()
        if health.status is EngineStatus.FAILED:  # dead, and the supervisor has not run yet
            return EngineHealth(EngineStatus.RESTARTING, f"The model's engine died ({health.message}); restarting it")
        return health

    @property
    def retry_after_s(self) -> int:
        """Seconds until the restarting engine should serve: the first load's time, less what has passed."""
        left = self._load_s - (time.monotonic() - self._restart_began)
        return max(1, math.ceil(left))

    def _expected_restart_message(self) -> str:
        return (
            f"The model's engine died ({self._death}) and is restarting (restart {self.restarts_total}); "
            f"expected to serve again in ~{self.retry_after_s} s"
        )

    @property
    def pid(self) -> int | None:
        return getattr(self._client, "pid", None)


class ResubmittingStream(RetriedStream):
    """A request's stream that survives an engine death as long as the request has produced nothing (its
    queueing and admission are no output: the new engine's are not passed on when the caller was already told);
    once only: a request that kills every engine is not re-queued forever."""

    retried_on = EngineDeadError

    def __init__(self, engine: SupervisedEngine, request: Request, client: EngineClient, stream: RequestStream) -> None:
        super().__init__(request.request_id, stream)
        self._engine = engine
        self._request = request
        self._client = client

    async def again(self, error: OrchardError) -> RequestStream:
        self._client, stream = await self._engine.resubmit(self._request, self._client)
        return stream

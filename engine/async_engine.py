"""AsyncEngine: one thread owns MLX and loops EngineCore.step(); asyncio callers submit and stream.

No MLX call happens on the event loop: it only queues commands to the engine
thread and receives outputs back via `loop.call_soon_threadsafe`, once per step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Callable

from engine.core import EngineCore, EngineStats
from engine.engine_loop import AbortCommand, AddCommand, EngineLoop, ShutdownCommand
from engine.errors import EngineDeadError, OrchardError
from engine.guided_intake import GuidedIntake
from engine.output.events import RequestOutput
from engine.output.router import RequestStream, StreamRouter
from engine.request import Request
from engine.served_model import ServedModel

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, build_core: Callable[[], EngineCore]) -> None:
        self._build_core = build_core
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams = StreamRouter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._core: EngineCore | None = None
        self._stats: EngineStats | None = None
        self._dead: OrchardError | None = None
        self._intake: GuidedIntake | None = None  # built with the core

    # ---- lifecycle -------------------------------------------------------
    async def start(self) -> None:
        """Build the core on the engine thread (model load, warm-up); raises what the build raised."""
        self._loop = asyncio.get_running_loop()
        ready: asyncio.Future = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="orchard-engine", daemon=True)
        self._thread.start()
        await ready

    async def shutdown(self) -> None:
        if self._thread is None:
            return
        self._commands.put(ShutdownCommand())
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        if self._intake is not None:
            self._intake.shutdown()

    @property
    def core(self) -> EngineCore:
        if self._core is None:
            raise EngineDeadError("The engine has not started")
        return self._core

    @property
    def served(self) -> ServedModel:
        core = self.core
        return ServedModel(core.loaded.tokenizer, core.context_length, core.loaded.path, in_own_process=False)

    # ---- requests --------------------------------------------------------
    def submit(self, request: Request) -> RequestStream:
        """Validate now (raises typed errors at once) and queue the request."""
        if self._dead is not None:
            raise EngineDeadError(f"The engine stopped: {self._dead.message}")
        self.core.validate(request)
        mailbox = self._streams.open(request.request_id)
        self._intake.admit(request)
        return RequestStream(request.request_id, mailbox, self.abort)

    def abort(self, request_id: str) -> None:
        if not self._intake.cancel(request_id):  # in the engine (or done): the engine thread aborts it
            self._commands.put(AbortCommand(request_id))

    def stats(self) -> EngineStats:
        if self._stats is None:
            raise EngineDeadError("The engine has not started")
        return self._stats

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._thread is not None

    # ---- engine thread ---------------------------------------------------
    def _run(self, ready: asyncio.Future) -> None:
        try:
            self._core = self._build_core()
            self._core.runner.warmup()
            self._stats = self._core.stats()
            self._intake = GuidedIntake(self._core.guides, self._enqueue, self._post_outputs)
            self._intake.warm()
        except BaseException as exc:  # report any build failure to start()'s caller
            self._loop.call_soon_threadsafe(_resolve, ready, exc)
            return
        self._loop.call_soon_threadsafe(_resolve, ready, None)
        try:
            EngineLoop(self._core, self._commands, self._post_outputs, self._set_stats).run()
        except BaseException as exc:  # what was already decided has reached its streams, before the error
            logger.exception("engine thread died")
            self._dead = EngineDeadError(f"The engine thread died: {exc!r}")
            self._loop.call_soon_threadsafe(self._streams.fail_all, self._dead)
        finally:
            self._core.close()

    def _enqueue(self, request: Request) -> None:
        self._commands.put(AddCommand(request))

    def _post_outputs(self, outputs: list[RequestOutput]) -> None:
        self._loop.call_soon_threadsafe(self._streams.deliver, outputs)

    def _set_stats(self, stats: EngineStats) -> None:
        self._stats = stats


def _resolve(future: asyncio.Future, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)

"""ThreadEngineClient: the engine steps on a thread of this process (the CLI, in-process tests and benchmarks).

One thread owns MLX and loops EngineCore.step(); the event loop only queues commands to it and receives each
step's outputs back via `loop.call_soon_threadsafe`. No MLX call happens on the event loop.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import threading
import weakref
from pathlib import Path
from typing import Any, Callable

from engine.client.interface import EngineClientBase, ServedModel
from engine.client.loop import EngineLoop, GuidedIntake
from engine.client.messages import AbortRequest, AddRequest, AdapterCommand, Shutdown
from engine.client.spec import EngineSpec, build_engine_core, load_serving_processor
from engine.core import EngineCore
from engine.decode_warmup import warm_up_at_load
from engine.device_memory import release_thread_streams
from engine.errors import EngineDeadError
from engine.request import Request

logger = logging.getLogger(__name__)
EXIT_JOIN_S = 10.0  # at exit, how long an engine still running gets to stop


class ThreadEngineClient(EngineClientBase):
    def __init__(self, build_core: Callable[[], EngineCore], load_processor: Callable[[Path], Any] | None = None) -> None:
        super().__init__()
        self._build_core = build_core
        self._load_processor = load_processor  # a multimodal model's processor, for the serving side
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._core: EngineCore | None = None
        self._intake: GuidedIntake | None = None  # built with the core

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> "ThreadEngineClient":
        return cls(lambda: build_engine_core(spec), lambda path: load_serving_processor(spec, path))

    # ---- lifecycle -------------------------------------------------------
    async def start(self) -> None:
        """Build the core on the engine thread (model load, warm-up); raises what the build raised."""
        self._loop = asyncio.get_running_loop()
        ready: asyncio.Future = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="orchard-engine", daemon=True)
        self._thread.start()
        _running.add(self)
        await ready
        core = self._core
        processor = await asyncio.to_thread(self._load_processor, core.loaded.path) if self._load_processor else None
        served = ServedModel(
            core.loaded.tokenizer, core.context_length, core.loaded.path, in_own_process=False, processor=processor,
            max_request_tokens=core.kv_budget.max_request_tokens,
        )
        self._started(served, core.limits, self._stats)  # the stats read on the engine thread

    async def _stop(self) -> None:
        if self._thread is None:
            return
        self._commands.put(Shutdown())
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        _running.discard(self)
        if self._intake is not None:
            self._intake.shutdown()

    @property
    def core(self) -> EngineCore:
        """The engine itself (tests and in-process benchmarks read its state; only the engine thread steps it)."""
        if self._core is None:
            raise EngineDeadError("The engine has not started")
        return self._core

    # ---- requests --------------------------------------------------------
    def _send_request(self, request: Request) -> None:
        self._intake.admit(request)

    def abort(self, request_id: str) -> None:
        if not self._intake.cancel(request_id):  # in the engine (or done): the engine thread aborts it
            self._commands.put(AbortRequest(request_id))

    def _send_command(self, command: AdapterCommand) -> None:
        self._commands.put(command)

    # ---- engine thread ---------------------------------------------------
    def _run(self, ready: asyncio.Future) -> None:
        try:
            self._core = self._build_core()
            warm_up_at_load(self._core)
            self._stats = self._core.stats()
            self._intake = GuidedIntake(self._core.guides, self._enqueue, self._post_outputs)
            self._intake.warm()
        except BaseException as exc:  # report any build failure to start()'s caller
            release_thread_streams()
            self._loop.call_soon_threadsafe(_resolve, ready, exc)
            return
        self._loop.call_soon_threadsafe(_resolve, ready, None)
        try:
            EngineLoop(self._core, self._commands, self._post_outputs, self._set_stats, self._post_reply).run()
        except BaseException as exc:  # what was already decided has reached its streams, before the error
            logger.exception("engine thread died")
            self._die(EngineDeadError(f"The engine thread died: {exc!r}"))
        finally:
            self._core.close()
            release_thread_streams()  # the runner's stream was made on this thread, which ends here

    def _enqueue(self, request: Request) -> None:
        self._commands.put(AddRequest(request))


# Engines started and not closed. One still running when the interpreter exits would take its MLX streams into
# the C++ teardown, which aborts the process ("terminate called without an active exception"): stopped first.
_running: "weakref.WeakSet[ThreadEngineClient]" = weakref.WeakSet()


@atexit.register
def _stop_running_engines() -> None:
    threads = [(client, client._thread) for client in list(_running) if client._thread is not None]
    for client, _ in threads:
        client._commands.put(Shutdown())
    for client, thread in threads:
        thread.join(EXIT_JOIN_S)
        if thread.is_alive():
            logger.error("an engine thread did not stop within %.0f s of the exit", EXIT_JOIN_S)


def _resolve(future: asyncio.Future, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)

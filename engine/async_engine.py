"""AsyncEngine: one thread owns MLX and loops EngineCore.step(); asyncio callers submit and stream.

No MLX call happens on the event loop: it only queues commands to the engine
thread and receives outputs back via `loop.call_soon_threadsafe`, once per step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from engine.core import EngineCore, EngineStats
from engine.engine_loop import AbortCommand, AddCommand, EngineLoop, ShutdownCommand
from engine.errors import EngineDeadError, InvalidRequestError, OrchardError
from engine.output.events import Finish, RequestOutput, Usage
from engine.output.router import RequestStream, StreamRouter
from engine.request import FinishReason, Request
from engine.served_model import ServedModel

logger = logging.getLogger(__name__)
# Structured-output compiles run here: outlines-core releases the GIL while it builds an index.
COMPILE_THREADS = 2


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
        self._compiler = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="orchard-guides")
        self._compiling: dict[str, Request] = {}

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
        self._compiler.shutdown(wait=False, cancel_futures=True)

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
        guided = request.sampling.guided
        if guided is not None and request.guide is None:
            request.guide = self.core.guides.cached(guided)
        if guided is not None and request.guide is None:
            self._compile_then_add(request)
        else:
            self._commands.put(AddCommand(request))
        return RequestStream(request.request_id, mailbox, self.abort)

    def _compile_then_add(self, request: Request) -> None:
        """A new structured-output spec compiles in a worker; the engine thread keeps decoding."""
        self._compiling[request.request_id] = request
        future = self._compiler.submit(self.core.guides.compile, request.sampling.guided)
        loop = self._loop
        future.add_done_callback(lambda done: loop.call_soon_threadsafe(self._compiled, request, done))

    def _compiled(self, request: Request, future: Future) -> None:
        self._compiling.pop(request.request_id, None)
        if self._streams.get(request.request_id) is None:  # aborted (or the engine died) while compiling
            return
        error = future.exception()
        if error is not None:
            self._streams.pop(request.request_id).put_error(compile_error(error))
            return
        request.guide = future.result()
        self._commands.put(AddCommand(request))

    def abort(self, request_id: str) -> None:
        request = self._compiling.pop(request_id, None)
        if request is not None:  # not in the engine yet: finish it here, drop it when its compile ends
            mailbox = self._streams.pop(request_id)
            if mailbox is not None:
                mailbox.put(aborted_before_start(request))
            return
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
            self._compiler.submit(self._core.guides.warm)  # the vocabulary, so a first schema waits less
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

    def _post_outputs(self, outputs: list[RequestOutput]) -> None:
        self._loop.call_soon_threadsafe(self._streams.deliver, outputs)

    def _set_stats(self, stats: EngineStats) -> None:
        self._stats = stats


def compile_error(error: BaseException) -> OrchardError:
    """A structured-output compile failure as the request's typed error."""
    if isinstance(error, OrchardError):
        return error
    logger.error("structured output compile failed", exc_info=error)
    return InvalidRequestError(f"Could not compile the output constraint: {error!r}", param="response_format")


def aborted_before_start(request: Request) -> RequestOutput:
    return RequestOutput(request.request_id, finish=Finish(FinishReason.ABORT, Usage(request.num_prompt_tokens, 0)))


def _resolve(future: asyncio.Future, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)

"""AsyncEngine: one thread owns MLX and loops EngineCore.step(); asyncio callers submit and stream.

No MLX call happens on the event loop: it only queues commands to the engine
thread and receives outputs back via `loop.call_soon_threadsafe`, once per step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from engine.core import EngineCore, EngineStats
from engine.errors import EngineDeadError, InvalidRequestError, OrchardError
from engine.output.events import Finish, RequestOutput, TextDelta, Usage
from engine.output.mailbox import Mailbox
from engine.request import FinishReason, Request

logger = logging.getLogger(__name__)
STATS_INTERVAL_S = 0.2
IDLE_POLL_S = 0.5
# MLX's buffer cache goes back to the device after this long without work (not between back-to-back requests,
# which would then allocate their buffers afresh).
RELEASE_BUFFERS_AFTER_IDLE_S = 0.5
# Structured-output compiles run here: outlines-core releases the GIL while it builds an index.
COMPILE_THREADS = 2


@dataclass
class _Add:
    request: Request


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Shutdown:
    pass


class RequestStream:
    """Async iterator of TextDelta items then one Finish; raises the request's OrchardError.

    Closing it early (client gone) aborts the request in the engine.
    """

    def __init__(self, engine: "AsyncEngine", request_id: str, mailbox: Mailbox) -> None:
        self.request_id = request_id
        self._engine = engine
        self._mailbox = mailbox

    def __aiter__(self) -> AsyncIterator[TextDelta | Finish]:
        return self._iterate()

    async def hold(self, timeout_s: float | None) -> None:
        """Wait until the request ends or timeout_s passes, taking nothing: meanwhile the engine's
        deltas merge in the mailbox, so a consumer that holds between reads wakes once, not per token."""
        await self._mailbox.wait_end(timeout_s)

    async def _iterate(self) -> AsyncIterator[TextDelta | Finish]:
        try:
            while not self._mailbox.closed:
                yield await self._mailbox.take()
        finally:
            if not self._mailbox.closed:
                self._engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, build_core: Callable[[], EngineCore]) -> None:
        self._build_core = build_core
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._mailboxes: dict[str, Mailbox] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._core: EngineCore | None = None
        self._stats: EngineStats | None = None
        self._dead: OrchardError | None = None
        self._compiler = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="orchard-guides")
        self._compiling: dict[str, Request] = {}
        self._held_outputs: list[RequestOutput] = []  # the last step's, until the next one keeps the device busy
        self._idle_since: float | None = None  # engine thread: when the work ran out (None: busy or released)

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
        self._commands.put(_Shutdown())
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        self._compiler.shutdown(wait=False, cancel_futures=True)

    @property
    def core(self) -> EngineCore:
        if self._core is None:
            raise EngineDeadError("The engine has not started")
        return self._core

    # ---- requests --------------------------------------------------------
    def submit(self, request: Request) -> RequestStream:
        """Validate now (raises typed errors at once) and queue the request."""
        if self._dead is not None:
            raise EngineDeadError(f"The engine stopped: {self._dead.message}")
        self.core.validate(request)
        if request.request_id in self._mailboxes:
            raise InvalidRequestError(f"Duplicate request id '{request.request_id}'", param="request_id")
        mailbox = Mailbox()
        self._mailboxes[request.request_id] = mailbox
        guided = request.sampling.guided
        if guided is not None and request.guide is None:
            request.guide = self.core.guides.cached(guided)
        if guided is not None and request.guide is None:
            self._compile_then_add(request)
        else:
            self._commands.put(_Add(request))
        return RequestStream(self, request.request_id, mailbox)

    def _compile_then_add(self, request: Request) -> None:
        """A new structured-output spec compiles in a worker; the engine thread keeps decoding."""
        self._compiling[request.request_id] = request
        future = self._compiler.submit(self.core.guides.compile, request.sampling.guided)
        loop = self._loop
        future.add_done_callback(lambda done: loop.call_soon_threadsafe(self._compiled, request, done))

    def _compiled(self, request: Request, future: Future) -> None:
        self._compiling.pop(request.request_id, None)
        mailbox = self._mailboxes.get(request.request_id)
        if mailbox is None:  # aborted (or the engine died) while compiling
            return
        error = future.exception()
        if error is not None:
            if not isinstance(error, OrchardError):
                logger.error("structured output compile failed", exc_info=error)
                error = InvalidRequestError(f"Could not compile the output constraint: {error!r}", param="response_format")
            del self._mailboxes[request.request_id]
            mailbox.put_error(error)
            return
        request.guide = future.result()
        self._commands.put(_Add(request))

    def abort(self, request_id: str) -> None:
        request = self._compiling.pop(request_id, None)
        if request is not None:  # not in the engine yet: finish it here, drop it when its compile ends
            mailbox = self._mailboxes.pop(request_id, None)
            if mailbox is not None:
                usage = Usage(request.num_prompt_tokens, 0)
                mailbox.put(RequestOutput(request_id, finish=Finish(FinishReason.ABORT, usage)))
            return
        self._commands.put(_Abort(request_id))

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
            self._loop_steps()
            self._post_held_outputs()
        except BaseException as exc:
            logger.exception("engine thread died")
            self._post_held_outputs()  # what was already decided still reaches its streams, before the error
            self._dead = EngineDeadError(f"The engine thread died: {exc!r}")
            self._loop.call_soon_threadsafe(self._fail_all, self._dead)
        finally:
            self._core.close()

    def _loop_steps(self) -> None:
        """Step while there is work. A step's outputs are posted to the event loop when the next step's
        forward is built and its device work comes next: the loop's reaction (streams, Ray) then takes
        the GIL while this thread waits on the device, not while it builds the next graph."""
        core = self._core
        last_stats = 0.0
        while True:
            outputs: list[RequestOutput] = []
            busy = core.has_unfinished_requests()
            if not busy:
                self._post_held_outputs()
            if self._apply_commands(block=not busy, outputs=outputs):
                return
            if core.has_unfinished_requests():
                self._idle_since = None
                outputs += core.step(before_device_work=self._post_held_outputs)
            else:
                self._release_buffers_when_idle()
            self._post_held_outputs()  # when no step ran (commands ended the work); else already posted
            self._held_outputs = outputs
            now = time.monotonic()
            if now - last_stats > STATS_INTERVAL_S or not core.has_unfinished_requests():
                self._stats, last_stats = core.stats(), now

    def _release_buffers_when_idle(self) -> None:
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        elif now - self._idle_since >= RELEASE_BUFFERS_AFTER_IDLE_S:
            self._core.release_idle_buffers()
            self._idle_since = float("inf")  # released: not again until the next work has come and gone

    def _post_held_outputs(self) -> None:
        if self._held_outputs:
            self._loop.call_soon_threadsafe(self._deliver, self._held_outputs)
            self._held_outputs = []

    def _apply_commands(self, block: bool, outputs: list[RequestOutput]) -> bool:
        """Apply queued commands; True when asked to shut down."""
        while True:
            try:
                command = self._commands.get(timeout=IDLE_POLL_S) if block else self._commands.get_nowait()
            except queue.Empty:
                return False
            block = False
            if isinstance(command, _Shutdown):
                return True
            if isinstance(command, _Add):
                try:
                    self._core.add_request(command.request)
                except OrchardError as exc:
                    outputs.append(RequestOutput(command.request.request_id, error=exc))
            elif isinstance(command, _Abort):
                aborted = self._core.abort_request(command.request_id)
                if aborted is not None:
                    outputs.append(aborted)

    # ---- event-loop side -------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            mailbox = self._mailboxes.get(output.request_id)
            if mailbox is None:
                continue
            mailbox.put(output)
            if output.finished:
                del self._mailboxes[output.request_id]

    def _fail_all(self, error: OrchardError) -> None:
        for mailbox in self._mailboxes.values():
            mailbox.put_error(error)
        self._mailboxes.clear()


def _resolve(future: asyncio.Future, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)

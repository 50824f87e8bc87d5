"""EngineLoop: the thread that owns MLX and steps EngineCore, fed by a command queue; and GuidedIntake, where
a request whose structured-output guide is not compiled yet waits, so that the engine thread never compiles.

ThreadEngineClient runs it on a thread of the caller's process; engine_process.py in a process of its own.
Both hand it a way to post a step's outputs and the latest stats; it never touches asyncio or sockets itself.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from engine.client.messages import AbortRequest, AddRequest, AdapterCommand, AdapterReply, Shutdown
from engine.core import EngineCore, EngineStats
from engine.errors import EngineDeadError, InvalidRequestError, OrchardError
from engine.output.request_output import Finish, Queued, RequestOutput, Usage
from engine.request import FinishReason, Request
from engine.sampling.structured import GuideCompiler

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.2
IDLE_POLL_S = 0.5
# MLX's buffer cache goes back to the device after this long without work (not between back-to-back requests,
# which would then allocate their buffers afresh).
RELEASE_BUFFERS_AFTER_IDLE_S = 0.5
# Structured-output compiles are waited on here (each builds in a child process: guide_builder.py).
COMPILE_THREADS = 2


class EngineLoop:
    def __init__(
        self,
        core: EngineCore,
        commands: queue.SimpleQueue,
        post_outputs: Callable[[list[RequestOutput]], None],
        post_stats: Callable[[EngineStats], None],
        post_reply: Callable[[AdapterReply], None] = lambda reply: None,
    ) -> None:
        self._core = core
        self._commands = commands
        self._post_outputs = post_outputs
        self._post_stats = post_stats
        self._post_reply = post_reply
        self._held_outputs: list[RequestOutput] = []  # the last step's, until the next one keeps the device busy
        self._idle_since: float | None = None  # when the work ran out (None: busy; inf: buffers released)

    def run(self) -> None:
        """Step until a Shutdown command; raises what the core raised, after posting what was decided."""
        try:
            self._loop_steps()
        finally:
            self.post_held_outputs()

    def _loop_steps(self) -> None:
        """Step while there is work. A step's outputs are posted when the next step's forward is built and
        its device work comes next: their consumer (streams, Ray) then takes the GIL or a core while this
        thread waits on the device, not while it builds the next graph. A step that completed prompts posts
        at once: their first tokens would otherwise also wait for the next step's prefix-cache copies (~14 ms
        for 32 prompts of 512 tokens on an H100), and time to first token is what a new request waits on.
        Admissions go out with them, in the same message: before the step's prefill runs, so a long prompt's
        stream opens at once instead of after its prefill (one post per step: each costs the engine thread CPU)."""
        core = self._core
        last_stats = 0.0
        while True:
            outputs: list[RequestOutput] = []
            busy = core.has_unfinished_requests()
            if not busy:
                self.post_held_outputs()
            if self._apply_commands(block=not busy, outputs=outputs):
                return
            first_tokens = 0
            if core.has_unfinished_requests():
                self._idle_since = None
                outputs += core.step(before_device_work=self.post_held_outputs, on_admitted=self._hold)
                first_tokens = core.last_step_first_tokens
            else:
                self._release_buffers_when_idle()
            self.post_held_outputs()  # when no step ran (commands ended the work); else already posted
            self._held_outputs = outputs
            if first_tokens:
                self.post_held_outputs()
            now = time.monotonic()
            if now - last_stats > STATS_INTERVAL_S or not core.has_unfinished_requests():
                self._post_stats(core.stats())
                last_stats = now

    def _release_buffers_when_idle(self) -> None:
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        elif now - self._idle_since >= RELEASE_BUFFERS_AFTER_IDLE_S:
            self._core.release_idle_buffers()
            self._idle_since = float("inf")  # released: not again until the next work has come and gone

    def _hold(self, outputs: list[RequestOutput]) -> None:
        self._held_outputs.extend(outputs)

    def post_held_outputs(self) -> None:
        if self._held_outputs:
            self._post_outputs(self._held_outputs)
            self._held_outputs = []

    def _apply_commands(self, block: bool, outputs: list[RequestOutput]) -> bool:
        """Apply queued commands; True when asked to shut down. An accepted request is told so (Queued) with the
        outputs posted next, within a step: its stream opens then, even if it waits behind a long prefill."""
        while True:
            try:
                command = self._commands.get(timeout=IDLE_POLL_S) if block else self._commands.get_nowait()
            except queue.Empty:
                return False
            block = False
            if isinstance(command, Shutdown):
                return True
            if isinstance(command, AddRequest):
                try:
                    self._core.add_request(command.request)
                    self._held_outputs.append(RequestOutput(command.request.request_id, queued=Queued()))
                except OrchardError as exc:
                    outputs.append(RequestOutput(command.request.request_id, error=exc))
            elif isinstance(command, AbortRequest):
                aborted = self._core.abort_request(command.request_id)
                if aborted is not None:
                    outputs.append(aborted)
            elif isinstance(command, AdapterCommand):  # between steps: a slot's weights never change under a forward
                self._post_reply(apply_adapter_command(self._core, command))


class GuidedIntake:
    """A request whose structured-output guide is not built yet waits here while the guide compiles in a worker
    (0.01-5 s), so the engine thread keeps decoding; then it is queued. Both engine clients' engines (the thread
    client's, the engine process's) admit every request through one."""

    def __init__(
        self,
        guides: GuideCompiler,
        enqueue: Callable[[Request], None],
        post_outputs: Callable[[list[RequestOutput]], None],
    ) -> None:
        self._guides = guides
        self._enqueue = enqueue  # the request is ready for the engine (any thread)
        self._post_outputs = post_outputs  # outputs of requests that end here (any thread)
        self._compiler = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="orchard-guides")
        self._compiling: dict[str, Request] = {}
        self._lock = threading.Lock()  # _compiling: admitting thread and compile callbacks

    def warm(self) -> None:
        """Build the vocabulary now, so that a first schema waits less."""
        self._compiler.submit(self._guides.warm)

    def admit(self, request: Request) -> None:
        guided = request.sampling.guided
        if guided is not None and request.guide is None:
            request.guide = self._guides.cached(guided)
        if guided is None or request.guide is not None:
            self._enqueue(request)
            return
        with self._lock:
            self._compiling[request.request_id] = request
        try:
            future = self._compiler.submit(self._guides.compile, guided)
        except RuntimeError:  # the pool is shut down, or the interpreter is exiting: it takes no new work
            with self._lock:
                self._compiling.pop(request.request_id, None)
            self._post_outputs([RequestOutput(request.request_id, error=EngineDeadError("The engine is shutting down"))])
            return
        future.add_done_callback(lambda done: self._compiled(request, done))

    def cancel(self, request_id: str) -> bool:
        """Finish a request that is still compiling (its guide is dropped when done); False if none is."""
        with self._lock:
            request = self._compiling.pop(request_id, None)
        if request is None:
            return False
        self._post_outputs([aborted_before_start(request)])
        return True

    def shutdown(self) -> None:
        self._compiler.shutdown(wait=False, cancel_futures=True)
        self._guides.close()  # its build processes (a build under way ends with an error its request never sees)

    def _compiled(self, request: Request, future: Future) -> None:
        with self._lock:
            if self._compiling.pop(request.request_id, None) is None:
                return  # cancelled while compiling: already finished for its stream
        if future.cancelled() or future.exception() is not None:
            error = EngineDeadError("The engine is shutting down") if future.cancelled() else compile_error(future.exception())
            self._post_outputs([RequestOutput(request.request_id, error=error)])
            return
        request.guide = future.result()
        self._enqueue(request)


def apply_adapter_command(core: EngineCore, command: AdapterCommand) -> AdapterReply:
    """Load or unload the adapter; the reply lists the adapters after it, or says why nothing changed."""
    try:
        if command.path is not None:
            core.load_adapter(command.name, command.path)
        else:
            core.unload_adapter(command.name)
    except OrchardError as exc:
        return AdapterReply(command.call_id, core.adapters.slots.listing(), exc)
    except Exception as exc:  # e.g. MLX refusing a file: the request's failure, not the engine's
        logger.exception("adapter %s: %s failed", command.name, "load" if command.path else "unload")
        error = InvalidRequestError(f"Could not load the adapter '{command.name}': {exc!r}", param="adapter_path")
        return AdapterReply(command.call_id, core.adapters.slots.listing(), error)
    return AdapterReply(command.call_id, core.adapters.slots.listing())


def compile_error(error: BaseException) -> OrchardError:
    """A structured-output compile failure as the request's typed error."""
    if isinstance(error, OrchardError):
        return error
    logger.error("structured output compile failed", exc_info=error)
    return InvalidRequestError(f"Could not compile the output constraint: {error!r}", param="response_format")


def aborted_before_start(request: Request) -> RequestOutput:
    return RequestOutput(request.request_id, finish=Finish(FinishReason.ABORT, Usage(request.num_prompt_tokens, 0)))

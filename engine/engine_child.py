"""The engine's own process: `python -m engine.engine_child FD`, started by ProcessEngine.

Its main thread runs EngineLoop; one thread reads commands from the socket FD, and structured-output guides
compile in a small pool. The serving process's threads (Ray, HTTP, tokenizing) then never hold this process's
GIL while the engine builds a step. The child ends when told to or when the serving process goes away (EOF).
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection

from engine.async_engine import COMPILE_THREADS, aborted_before_start, compile_error
from engine.core import EngineCore
from engine.core_builder import build_engine_core
from engine.engine_loop import AbortCommand, AddCommand, EngineLoop, ShutdownCommand
from engine.errors import EngineDeadError, ModelLoadError, OrchardError
from engine.output.events import RequestOutput
from engine.process_protocol import ChildDied, ChildFailed, ChildReady, CoreSpec, StatsUpdate, StepOutputs
from engine.request import Request

logger = logging.getLogger("orchard.engine_child")


class Outbox:
    """Sends to the serving process from any thread (engine loop, command reader, guide compiles)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, message: object) -> None:
        with self._lock:
            try:
                self._conn.send(message)
            except (BrokenPipeError, ConnectionResetError, EOFError):
                pass  # the serving process is gone; the reader sees EOF and shuts the loop down

    def post_outputs(self, outputs: list[RequestOutput]) -> None:
        self.send(StepOutputs(outputs))


class CommandReader:
    """Reads commands into the engine loop's queue; compiles a new guide before its request is queued."""

    def __init__(self, core: EngineCore, commands: queue.SimpleQueue, outbox: Outbox) -> None:
        self._core = core
        self._commands = commands
        self._outbox = outbox
        self._compiler = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="orchard-guides")
        self._compiling: dict[str, Request] = {}
        self._lock = threading.Lock()  # _compiling: reader thread and compile callbacks

    def run(self, conn: Connection) -> None:
        self._compiler.submit(self._core.guides.warm)  # the vocabulary, so a first schema waits less
        while True:
            try:
                command = conn.recv()
            except (EOFError, OSError):  # the serving process went away
                command = ShutdownCommand()
            if isinstance(command, AddCommand):
                self._admit(command.request)
            elif isinstance(command, AbortCommand) and self._cancel_compile(command.request_id):
                continue
            else:
                self._commands.put(command)
            if isinstance(command, ShutdownCommand):
                self._compiler.shutdown(wait=False, cancel_futures=True)
                return

    def _admit(self, request: Request) -> None:
        guided = request.sampling.guided
        if guided is not None and request.guide is None:
            request.guide = self._core.guides.cached(guided)
        if guided is None or request.guide is not None:
            self._commands.put(AddCommand(request))
            return
        with self._lock:
            self._compiling[request.request_id] = request
        future = self._compiler.submit(self._core.guides.compile, guided)
        future.add_done_callback(lambda done: self._compiled(request, done))

    def _compiled(self, request: Request, future: Future) -> None:
        with self._lock:
            if self._compiling.pop(request.request_id, None) is None:
                return  # aborted while compiling: already finished for its stream
        if future.cancelled() or future.exception() is not None:
            error = EngineDeadError("The engine is shutting down") if future.cancelled() else compile_error(future.exception())
            self._outbox.post_outputs([RequestOutput(request.request_id, error=error)])
            return
        request.guide = future.result()
        self._commands.put(AddCommand(request))

    def _cancel_compile(self, request_id: str) -> bool:
        with self._lock:
            request = self._compiling.pop(request_id, None)
        if request is None:
            return False
        self._outbox.post_outputs([aborted_before_start(request)])
        return True


def serve(conn: Connection) -> int:
    spec: CoreSpec = conn.recv()
    if spec.gil_switch_interval_s is not None:
        sys.setswitchinterval(spec.gil_switch_interval_s)
    outbox = Outbox(conn)
    try:
        core = build_engine_core(spec)
        core.runner.warmup()
    except BaseException as exc:  # the serving process reports it as the model's load failure
        error = exc if isinstance(exc, OrchardError) else ModelLoadError(f"Could not start the engine: {exc!r}")
        outbox.send(ChildFailed(error))
        return 1
    commands: queue.SimpleQueue = queue.SimpleQueue()
    reader = CommandReader(core, commands, outbox)
    threading.Thread(target=reader.run, args=(conn,), name="orchard-commands", daemon=True).start()
    outbox.send(ChildReady(str(core.loaded.path), core.context_length, core.loaded.vocab_size, core.stats()))
    try:
        EngineLoop(core, commands, outbox.post_outputs, lambda stats: outbox.send(StatsUpdate(stats))).run()
    except BaseException as exc:
        logger.exception("engine loop died")
        outbox.send(ChildDied(repr(exc)))
        return 1
    finally:
        core.close()
    return 0


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-child %(levelname)s %(message)s")
    return serve(Connection(int(argv[1])))


if __name__ == "__main__":
    sys.exit(main(sys.argv))

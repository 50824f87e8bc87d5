"""The engine's own process: `python -m engine.client.engine_process FD`, started by ProcessEngineClient.

Its main thread runs EngineLoop; one thread reads commands from the socket FD, and structured-output guides
compile in a small pool. The serving process's threads (Ray, HTTP, tokenizing) then never hold this process's
GIL while the engine builds a step. It ends when told to or when the serving process goes away (EOF).
"""

from __future__ import annotations

import gc
import logging
import queue
import sys
import threading
from multiprocessing.connection import Connection

from engine.client.loop import EngineLoop, GuidedIntake
from engine.client.messages import (
    AbortRequest,
    AddRequest,
    EngineDied,
    EngineFailed,
    EngineReady,
    Shutdown,
    StatsUpdate,
    StepOutputs,
)
from engine.client.process_settings import priority_message, raise_engine_priority
from engine.client.spec import EngineSpec, build_engine_core
from engine.core import EngineCore
from engine.decode_warmup import warm_up_at_load
from engine.errors import ModelLoadError, OrchardError
from engine.output.request_output import RequestOutput

logger = logging.getLogger("orchard.engine_process")


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
    """Reads commands into the engine loop's queue; a request with a new guide waits in GuidedIntake first."""

    def __init__(self, core: EngineCore, commands: queue.SimpleQueue, outbox: Outbox) -> None:
        self._commands = commands
        self._intake = GuidedIntake(core.guides, lambda request: commands.put(AddRequest(request)), outbox.post_outputs)

    def run(self, conn: Connection) -> None:
        self._intake.warm()
        while True:
            try:
                command = conn.recv()
            except (EOFError, OSError):  # the serving process went away
                command = Shutdown()
            if isinstance(command, AddRequest):
                self._intake.admit(command.request)
            elif isinstance(command, AbortRequest) and self._intake.cancel(command.request_id):
                continue
            else:
                self._commands.put(command)
            if isinstance(command, Shutdown):
                self._intake.shutdown()
                return


def serve(conn: Connection) -> int:
    spec: EngineSpec = conn.recv()
    priority = raise_engine_priority()
    if (message := priority_message(priority)) is not None:
        logger.log(logging.WARNING if priority.refused else logging.INFO, message)
    if spec.gil_switch_interval_s is not None:
        sys.setswitchinterval(spec.gil_switch_interval_s)
    outbox = Outbox(conn)
    try:
        core = build_engine_core(spec)
        warm_up_at_load(core)
        # What the load made lives as long as this process (one model's): out of the cyclic collector's passes, whose
        # full scans of it stalled steps (165 ms once in a 128-row run of a tiny model on a 2-core CPU).
        gc.collect()
        gc.freeze()
    except BaseException as exc:  # the serving process reports it as the model's load failure
        error = exc if isinstance(exc, OrchardError) else ModelLoadError(f"Could not start the engine: {exc!r}")
        outbox.send(EngineFailed(error))
        return 1
    commands: queue.SimpleQueue = queue.SimpleQueue()
    reader = CommandReader(core, commands, outbox)
    threading.Thread(target=reader.run, args=(conn,), name="orchard-commands", daemon=True).start()
    outbox.send(EngineReady(str(core.loaded.path), core.context_length, core.loaded.vocab_size, core.stats(), core.kv_budget,
                            core.limits.token_chars))
    try:
        EngineLoop(core, commands, outbox.post_outputs, lambda stats: outbox.send(StatsUpdate(stats)), outbox.send).run()
    except BaseException as exc:
        logger.exception("engine loop died")
        outbox.send(EngineDied(repr(exc)))
        return 1
    finally:
        core.close()
    return 0


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-process %(levelname)s %(message)s")
    return serve(Connection(int(argv[1])))


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""ProcessEngineClient: the engine steps in a child process (engine_process.py); the serving path's client.

This process keeps the tokenizer, request checks and the per-request streams; the child owns MLX. A step's
outputs cross one socket as one pickled message, read by a thread here and routed on the event loop.
Why: in one process the engine thread shares the GIL with Ray's and the HTTP layer's threads, and each of them
delays the other (docs/decisions.md, "The engine in its own process"); across processes they only share cores.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path

from engine.client.interface import EngineClientBase, ServedModel
from engine.client.messages import (
    AbortRequest,
    AddRequest,
    AdapterCommand,
    AdapterReply,
    EngineDied,
    EngineFailed,
    EngineReady,
    Shutdown,
    StatsUpdate,
    StepOutputs,
)
from engine.client.process_settings import engine_thread_env
from engine.client.spec import EngineSpec, load_serving_processor
from engine.device_memory import on_gpu
from engine.errors import EngineDeadError
from engine.mlx_settings import MLX_SETTINGS
from engine.models.loader import load_tokenizer_only
from engine.request import Request
from engine.request_limits import RequestLimits

logger = logging.getLogger(__name__)
STOP_TIMEOUT_S = 30.0


class ProcessEngineClient(EngineClientBase):
    def __init__(self, spec: EngineSpec) -> None:
        super().__init__()
        self._spec = spec
        self._child: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()

    # ---- lifecycle -------------------------------------------------------
    async def start(self) -> None:
        """Start the child and wait until its model is loaded and warm; raises what its build raised."""
        self._loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        self._child = subprocess.Popen(
            [sys.executable, "-m", "engine.client.engine_process", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), env=_child_env(),
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        self._send(self._spec)
        try:
            ready = await asyncio.to_thread(self._conn.recv)
        except (EOFError, OSError):
            ready = None
        if not isinstance(ready, EngineReady):
            code = await self._abandon_start()
            if isinstance(ready, EngineFailed):
                raise ready.error
            raise EngineDeadError(f"The engine process exited while starting (exit code {code})")
        try:
            await self._adopt(ready)
        except BaseException:  # the tokenizer did not load here: the child must not outlive the failed start
            await self._abandon_start()
            raise
        threading.Thread(target=self._read_messages, name="orchard-engine-reader", daemon=True).start()

    async def _adopt(self, ready: EngineReady) -> None:
        spec = self._spec
        tokenizer = await asyncio.to_thread(
            load_tokenizer_only, ready.model_path,
            chat_template_file=spec.chat_template_file, trust_remote_code=spec.trust_remote_code,
        )
        processor = await asyncio.to_thread(load_serving_processor, spec, ready.model_path)
        served = ServedModel(
            tokenizer, ready.context_length, Path(ready.model_path), in_own_process=True, processor=processor,
            max_request_tokens=ready.kv_budget.max_request_tokens if ready.kv_budget is not None else None,
        )
        self._started(served, RequestLimits(ready.vocab_size, ready.context_length, ready.kv_budget, ready.token_chars), ready.stats)

    async def _abandon_start(self) -> int | None:
        """Stop the child of a failed start; its exit code."""
        child = self._child
        self._send(Shutdown())
        await self._reap()
        self._conn.close()
        return child.returncode

    async def _stop(self) -> None:
        if self._child is None:
            return
        self._send(Shutdown())
        await self._reap()

    async def _reap(self) -> None:
        child, self._child = self._child, None
        try:
            await asyncio.to_thread(child.wait, STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("engine process %d did not stop in %.0f s; killing it", child.pid, STOP_TIMEOUT_S)
            child.kill()
            await asyncio.to_thread(child.wait)

    @property
    def pid(self) -> int | None:
        return self._child.pid if self._child is not None else None

    # ---- requests --------------------------------------------------------
    def _send_request(self, request: Request) -> None:
        self._send(AddRequest(request))

    def abort(self, request_id: str) -> None:
        self._send(AbortRequest(request_id))

    def _send_command(self, command: AdapterCommand) -> None:
        self._send(command)

    def _send(self, message: object) -> None:
        with self._send_lock:  # the loop and to_thread helpers may both send
            try:
                self._conn.send(message)
            except OSError:  # the child is gone: the reader thread reports it to every stream
                pass

    # ---- reader thread -----------------------------------------------------
    def _read_messages(self) -> None:
        """Route the child's messages to the loop until it exits; then fail whatever is still streaming."""
        message: object = None
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, StepOutputs):
                self._post_outputs(message.outputs)
            elif isinstance(message, StatsUpdate):
                self._set_stats(message.stats)
            elif isinstance(message, AdapterReply):
                self._post_reply(message)
            elif isinstance(message, EngineDied):
                break
        with self._send_lock:  # later sends (aborts of failed streams) then fail fast, and the socket is freed
            self._conn.close()
        reason = message.message if isinstance(message, EngineDied) else "the engine process exited"
        if not self._closed:  # an exit we asked for is no failure
            logger.error("engine process failed: %s", reason)
        self._die(EngineDeadError(f"The engine process stopped: {reason}"))


def _child_env() -> dict[str, str]:
    """The child imports the same modules: this process's import path first (Ray's workers extend it). It starts
    with the engine's MLX settings in its environment (MLX reads them once, whenever its backend first needs them)
    and thread counts chosen for its device, not Ray's OMP_NUM_THREADS=1 (BLAS runtimes read them at load)."""
    env = {**MLX_SETTINGS, **os.environ}
    env.update(engine_thread_env(runs_on_cpu=not on_gpu(), environ=os.environ))
    paths = [p for p in sys.path if p]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env

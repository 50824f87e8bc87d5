"""EngineClient: how an asyncio caller (a model replica, the CLI, a benchmark) drives one engine.

Two implementations share EngineClientBase: ThreadEngineClient steps the engine on a thread of this process,
ProcessEngineClient in a child process. `submit` checks a request against the model's limits (the one place a
request is validated), opens its stream and hands it to the engine; `abort`, `stats`, `health`, `close`.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.core import EngineStats
from engine.errors import EngineDeadError, OrchardError
from engine.output.request_output import RequestOutput
from engine.request import Request
from engine.client.streams import RequestStream, StreamRouter
from engine.validation import RequestLimits


@dataclass(frozen=True)
class ServedModel:
    """What the serving side needs from a started engine, wherever the engine runs."""

    tokenizer: Any  # mlx_lm TokenizerWrapper, loaded in the caller's process
    context_length: int
    path: Path
    # True when the engine steps in a child process: its CPU and memory are not this process's.
    in_own_process: bool


@dataclass(frozen=True)
class EngineHealth:
    alive: bool
    message: str | None = None  # why not, when not alive


class EngineClientBase(ABC):
    def __init__(self) -> None:
        self._streams = StreamRouter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._served: ServedModel | None = None
        self._limits: RequestLimits | None = None
        self._stats: EngineStats | None = None
        self._dead: OrchardError | None = None
        self._closed = False

    # ---- lifecycle -------------------------------------------------------
    @abstractmethod
    async def start(self) -> None:
        """Load the model and warm the engine; raises what the build raised."""

    async def close(self) -> None:
        """Stop the engine and free its memory (streams still open end with EngineDeadError)."""
        self._closed = True
        await self._stop()

    @abstractmethod
    async def _stop(self) -> None: ...

    def _started(self, served: ServedModel, limits: RequestLimits, stats: EngineStats) -> None:
        self._served, self._limits, self._stats = served, limits, stats

    @property
    def served(self) -> ServedModel:
        if self._served is None:
            raise EngineDeadError("The engine has not started")
        return self._served

    # ---- requests --------------------------------------------------------
    def submit(self, request: Request) -> RequestStream:
        """Check the request (raises typed errors at once), open its stream and send it to the engine."""
        if self._dead is not None:
            raise EngineDeadError(f"The engine stopped: {self._dead.message}")
        if self._closed:
            raise EngineDeadError("The engine was closed")
        if self._limits is None:
            raise EngineDeadError("The engine has not started")
        self._limits.validate(request)
        stream = self._streams.open(request.request_id, self.abort)
        self._send_request(request)
        return stream

    @abstractmethod
    def _send_request(self, request: Request) -> None: ...

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Stop a request (its stream ends with an abort finish); unknown or finished ids are ignored."""

    # ---- state -----------------------------------------------------------
    def stats(self) -> EngineStats:
        """The engine's latest stats (posted by the engine every 0.2 s while it works)."""
        if self._stats is None:
            raise EngineDeadError("The engine has not started")
        return self._stats

    def health(self) -> EngineHealth:
        if self._dead is not None:
            return EngineHealth(False, self._dead.message)
        if self._closed:
            return EngineHealth(False, "The engine was closed")
        if self._served is None:
            return EngineHealth(False, "The engine has not started")
        return EngineHealth(True)

    # ---- from the engine (any thread) -----------------------------------------
    def _post_outputs(self, outputs: list[RequestOutput]) -> None:
        self._loop.call_soon_threadsafe(self._streams.deliver, outputs)

    def _set_stats(self, stats: EngineStats) -> None:
        self._stats = stats

    def _die(self, error: EngineDeadError) -> None:
        """The engine stopped: every open stream ends with `error` (what was already decided came first)."""
        self._dead = error
        self._loop.call_soon_threadsafe(self._streams.fail_all, error)


# The interface callers program against (thread_client.ThreadEngineClient, process_client.ProcessEngineClient).
EngineClient = EngineClientBase

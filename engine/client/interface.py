"""EngineClient: how an asyncio caller (a model replica, the CLI, a benchmark) drives one engine.

Two implementations share EngineClientBase: ThreadEngineClient steps the engine on a thread of this process,
ProcessEngineClient in a child process. `submit` checks a request against the model's limits (the one place a
request is validated), opens its stream and hands it to the engine; `abort`, `stats`, `health`, `close`.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from engine.adapters.registry import LoadedAdapter
from engine.client.messages import AdapterCommand, AdapterReply
from engine.core import EngineStats
from engine.errors import EngineDeadError, InvalidRequestError, OrchardError
from engine.health import EngineHealth, EngineStatus
from engine.mailbox import Pending
from engine.output.request_output import Admitted, Finish, Queued, RequestOutput, TextDelta
from engine.request import Request
from engine.request_limits import RequestLimits


@dataclass(frozen=True)
class ServedModel:
    """What the serving side needs from a started engine, wherever the engine runs."""

    tokenizer: Any  # mlx_lm TokenizerWrapper, loaded in the caller's process
    context_length: int
    path: Path
    # True when the engine steps in a child process: its CPU and memory are not this process's.
    in_own_process: bool
    # A multimodal model's processor (mlx-vlm), loaded in the caller's process: images to model inputs.
    processor: Any = None
    # The most tokens (prompt + generated) one request's KV may hold under the model's KV budget (None: no budget).
    max_request_tokens: int | None = None


# An engine busy in one step this long without a word is degraded: at least MIN_STALL_S, or STALL_FACTOR
# times the step time its measured prefill budget aims at.
MIN_STALL_S = 10.0
STALL_FACTOR = 10.0


class EngineClientBase(ABC):
    def __init__(self) -> None:
        self._streams = StreamRouter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._served: ServedModel | None = None
        self._limits: RequestLimits | None = None
        self._stats: EngineStats | None = None
        self._dead: OrchardError | None = None
        self._closed = False
        self._heard_at = time.monotonic()  # the engine's heartbeat: its last outputs or stats
        self._died: asyncio.Event | None = None  # set on the loop once the engine has stopped
        self.stall_after_s: float | None = None  # silence that makes the engine degraded (None: derived)
        self.adapters: list[LoadedAdapter] = []  # the per-request adapters loaded, as of the last adapter call
        self._adapter_calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)

    async def wait_dead(self) -> OrchardError:
        """Return (with the reason) once the engine has stopped: died, or closed."""
        if self._died is None:
            self._died = asyncio.Event()
        if self._dead is None:
            await self._died.wait()
        assert self._dead is not None
        return self._dead

    # ---- lifecycle -------------------------------------------------------
    @abstractmethod
    async def start(self) -> None:
        """Load the model and warm the engine; raises what the build raised."""

    async def close(self, error: OrchardError | None = None) -> None:
        """Stop the engine and free its memory; streams still open end with `error` (EngineDeadError)."""
        self._closed = True
        error = error or EngineDeadError("The engine was closed")
        # First: the engine's own end (the process's socket closing) must not be what the streams are told.
        self._streams.fail_all(error)
        self._fail_calls(error)
        if self._dead is None:
            self._dead = error
        await self._stop()
        self._signal_dead()

    @abstractmethod
    async def _stop(self) -> None: ...

    def _started(self, served: ServedModel, limits: RequestLimits, stats: EngineStats) -> None:
        self._served, self._limits, self._stats = served, limits, stats
        self._heard_at = time.monotonic()  # a long load is no stalled step

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

    # ---- per-request adapters ----------------------------------------------
    async def load_adapter(self, name: str, path: Path) -> list[LoadedAdapter]:
        """Load a LoRA adapter that requests then name; the adapters loaded after it (raises why it failed)."""
        return await self._adapter_call(name, path)

    async def unload_adapter(self, name: str) -> list[LoadedAdapter]:
        return await self._adapter_call(name, None)

    async def _adapter_call(self, name: str, path: Path | None) -> list[LoadedAdapter]:
        if self._dead is not None or self._closed:
            raise EngineDeadError("The engine stopped")
        command = AdapterCommand(next(self._call_ids), name, path)
        reply = self._adapter_calls[command.call_id] = asyncio.get_running_loop().create_future()
        self._send_command(command)
        answer: AdapterReply = await reply
        self.adapters = answer.adapters
        if answer.error is not None:
            raise answer.error
        return answer.adapters

    @abstractmethod
    def _send_command(self, command: AdapterCommand) -> None: ...

    def _post_reply(self, reply: AdapterReply) -> None:  # any thread
        self._loop.call_soon_threadsafe(self._settle_call, reply)

    def _settle_call(self, reply: AdapterReply) -> None:
        future = self._adapter_calls.pop(reply.call_id, None)
        if future is not None and not future.done():
            future.set_result(reply)

    def _fail_calls(self, error: OrchardError) -> None:
        calls, self._adapter_calls = self._adapter_calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(error)

    # ---- state -----------------------------------------------------------
    def stats(self) -> EngineStats:
        """The engine's latest stats (posted by the engine every 0.2 s while it works)."""
        if self._stats is None:
            raise EngineDeadError("The engine has not started")
        return self._stats

    def health(self) -> EngineHealth:
        if self._dead is not None:
            return EngineHealth(EngineStatus.FAILED, self._dead.message)
        if self._closed:
            return EngineHealth(EngineStatus.FAILED, "The engine was closed")
        if self._served is None:
            return EngineHealth(EngineStatus.FAILED, "The engine has not started")
        silent_s, stall_s = time.monotonic() - self._heard_at, self._stall_after_s()
        if silent_s > stall_s:
            return EngineHealth(
                EngineStatus.DEGRADED, f"No engine step has ended for {silent_s:.0f} s (a step should take < {stall_s:.0f} s)"
            )
        return EngineHealth(EngineStatus.RUNNING)

    def _stall_after_s(self) -> float:
        if self.stall_after_s is not None:
            return self.stall_after_s
        expected = self._stats.expected_step_s if self._stats is not None else None
        return max(MIN_STALL_S, STALL_FACTOR * expected) if expected else MIN_STALL_S

    # ---- from the engine (any thread) -----------------------------------------
    def _post_outputs(self, outputs: list[RequestOutput]) -> None:
        self._heard_at = time.monotonic()
        try:
            self._loop.call_soon_threadsafe(self._streams.deliver, outputs)
        except RuntimeError:  # the loop has closed (an engine never closed, at exit): nobody is left to tell
            pass

    def _set_stats(self, stats: EngineStats) -> None:
        self._heard_at = time.monotonic()  # the engine loop posts stats between steps, and every 0.5 s idle
        self._stats = stats

    def _die(self, error: EngineDeadError) -> None:
        """The engine stopped: every open stream ends with `error` (what was already decided came first)."""
        if self._dead is None:
            self._dead = error
        try:
            self._loop.call_soon_threadsafe(self._on_death, error)
        except RuntimeError:  # the loop itself has closed: nobody is left to tell
            pass

    def _on_death(self, error: EngineDeadError) -> None:
        self._streams.fail_all(error)
        self._fail_calls(error)
        self._signal_dead()

    def _signal_dead(self) -> None:
        if self._died is not None:
            self._died.set()


# The interface callers program against (thread_client.ThreadEngineClient, process_client.ProcessEngineClient).
EngineClient = EngineClientBase


# ---- the caller's side of the streams: one Pending slot (engine/mailbox.py) per request ---------------------
StreamEvent = Queued | Admitted | TextDelta | Finish


class RequestStream:
    """Async iterator of one Queued (the engine accepted the request), one Admitted (the scheduler took it in),
    TextDelta items, then one Finish; raises the request's OrchardError. A request refused before it was queued has
    neither, one that ends while waiting (aborted, queue timeout) no Admitted.

    Closing it early (client gone) aborts the request through `abort`.
    """

    def __init__(self, request_id: str, pending: Pending[RequestOutput], abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._pending = pending
        self._abort = abort

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self._iterate()

    async def hold(self, timeout_s: float | None) -> None:
        """Wait until the request ends or timeout_s passes, taking nothing: meanwhile the engine's
        outputs merge, so a consumer that holds between reads wakes once, not per token."""
        await self._pending.wait_end(timeout_s)

    async def _iterate(self) -> AsyncIterator[StreamEvent]:
        ended = False
        try:
            while not ended:
                await self._pending.ready.wait()
                output = self._pending.take()
                ended = output.is_last
                if output.queued is not None:
                    yield output.queued
                if output.admitted is not None:
                    yield output.admitted
                if output.delta is not None:
                    yield output.delta
                if output.error is not None:
                    raise output.error
                if output.finish is not None:
                    yield output.finish
        finally:
            if not ended:
                self._abort(self.request_id)


class RetriedStream(ABC):
    """A request's stream (RequestStream's interface) that, ended by a `retried_on` error before any output, is
    submitted once more (`again`); its queueing and admission are passed on once (the new submission's are not)."""

    retried_on: type[OrchardError] = OrchardError

    def __init__(self, request_id: str, stream: Any) -> None:
        self.request_id = request_id
        self._stream = stream

    async def hold(self, timeout_s: float | None) -> None:
        await self._stream.hold(timeout_s)

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[StreamEvent]:
        told: set[type] = set()
        produced = retried = False
        while True:
            try:
                async for item in self._stream:
                    if isinstance(item, (Queued, Admitted)):
                        if type(item) in told:
                            continue
                        told.add(type(item))
                    else:
                        produced = True
                    yield item
                return
            except OrchardError as exc:
                if not isinstance(exc, self.retried_on) or produced or retried:  # once only
                    raise
                retried = True
                self._stream = await self.again(exc)

    @abstractmethod
    async def again(self, error: OrchardError) -> Any:
        """The request's new stream."""


class StreamRouter:
    """Request id -> its Pending slot; a step's outputs are routed in one call."""

    def __init__(self) -> None:
        self._pending: dict[str, Pending[RequestOutput]] = {}

    def open(self, request_id: str, abort: Callable[[str], None]) -> RequestStream:
        if request_id in self._pending:
            raise InvalidRequestError(f"Duplicate request id '{request_id}'", param="request_id")
        pending = self._pending[request_id] = Pending()
        return RequestStream(request_id, pending, abort)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            pending = self._pending.get(output.request_id)
            if pending is None:
                continue
            pending.add(output)
            if output.is_last:
                del self._pending[output.request_id]

    def fail_all(self, error: OrchardError) -> None:
        for request_id, pending in self._pending.items():
            pending.add(RequestOutput(request_id, error=error))
        self._pending.clear()

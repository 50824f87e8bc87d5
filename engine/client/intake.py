"""GuidedIntake: a request whose structured-output guide is not built yet waits here while the guide compiles
in a worker (0.01-1 s), so the engine thread keeps decoding; then it is queued. Both engine clients' engines
(the thread client's, the engine process's) admit every request through one."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from engine.errors import EngineDeadError, InvalidRequestError, OrchardError
from engine.output.request_output import Finish, RequestOutput, Usage
from engine.request import FinishReason, Request
from engine.sampling.structured import GuideCompiler

logger = logging.getLogger(__name__)
# Structured-output compiles run here: outlines-core releases the GIL while it builds an index.
COMPILE_THREADS = 2


class GuidedIntake:
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
        future = self._compiler.submit(self._guides.compile, guided)
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


def compile_error(error: BaseException) -> OrchardError:
    """A structured-output compile failure as the request's typed error."""
    if isinstance(error, OrchardError):
        return error
    logger.error("structured output compile failed", exc_info=error)
    return InvalidRequestError(f"Could not compile the output constraint: {error!r}", param="response_format")


def aborted_before_start(request: Request) -> RequestOutput:
    return RequestOutput(request.request_id, finish=Finish(FinishReason.ABORT, Usage(request.num_prompt_tokens, 0)))

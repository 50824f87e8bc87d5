"""Launch a step's device work while one worker thread does Python work beside it.

On a GPU a decode step is bound by the host: mx.async_eval spends milliseconds launching the step's kernels
with the GIL released, and the engine thread does nothing else meanwhile. Work handed in beside a launch (the
previous step's outputs: detokenizing, stop checks, engine/core.py) runs on the worker in that window instead
of after it. It must not touch MLX: the engine thread owns MLX, and is inside async_eval meanwhile.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import mlx.core as mx


class OverlappedLaunch:
    def __init__(self) -> None:
        # The thread starts at the first launch with work beside it.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orchard-outputs")

    def launch(self, arrays: list[mx.array], beside: Callable[[], None] | None = None) -> None:
        """Queue `arrays` on the device (mx.async_eval) while `beside` runs on the worker; return once both are done.

        A launch's error is raised (after the worker finished, with its error as a note), else the worker's."""
        if beside is None:
            if arrays:
                mx.async_eval(arrays)
            return
        try:
            done = self._worker.submit(beside)
        except RuntimeError:  # the interpreter is exiting: concurrent.futures refuses new work before atexit stops
            self.launch(arrays)  # an engine left running (client/thread_client.py), so its steps go on without a worker
            beside()
            return
        try:
            if arrays:
                mx.async_eval(arrays)
        except BaseException as launch_error:
            if (error := done.exception()) is not None:
                launch_error.add_note(f"the work beside the launch also failed: {error!r}")
            raise
        if (error := done.exception()) is not None:
            raise error

    def close(self) -> None:
        self._worker.shutdown(wait=True)

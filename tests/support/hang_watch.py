"""A pytest plugin that turns a hung in-process test into one failure with its evidence, instead of a CI time-out.

Most serving tests drive an event loop with asyncio.run. When one waits forever, the thread stacks that
faulthandler writes show only an idle `select`; what waits on what lives in the loop's tasks. After HANG_S in one
test this writes every task of every open event loop (its coroutine stack) to the log, then cancels them: the
test fails with CancelledError and the suite goes on. Only loops running on the main thread (the tests' own) are
touched.
"""

from __future__ import annotations

import asyncio
import gc
import io
import os
import sys
import threading

import pytest

# The slowest test takes ~150 s alone on the 2-core machine; pyproject's faulthandler dump comes at 300 s.
# ORCHARD_TEST_HANG_S sets it (this plugin's own check uses 2 s).
HANG_S = float(os.environ.get("ORCHARD_TEST_HANG_S", "420"))


def _main_thread_loops() -> list[asyncio.AbstractEventLoop]:
    """The event loops running on the main thread (the tests' own; servers' loops run on threads of their own).
    Looked up only when a test hangs: a global event loop policy that recorded them made a real-time test slower."""
    main = threading.main_thread().ident
    return [obj for obj in gc.get_objects()
            if isinstance(obj, asyncio.AbstractEventLoop) and getattr(obj, "_thread_id", None) == main
            and obj.is_running() and not obj.is_closed()]


def _dump_and_cancel(loop: asyncio.AbstractEventLoop, test: str) -> None:
    """Runs on `loop`: write its tasks' stacks, then cancel them."""
    out = io.StringIO()
    tasks = asyncio.all_tasks(loop)
    out.write(f"\n=== hang_watch: {test} still running after {HANG_S:.0f} s; {len(tasks)} tasks on its loop ===\n")
    for task in tasks:
        out.write(f"--- {task.get_name()}\n")
        _write_await_chain(task.get_coro(), out)
    sys.__stderr__.write(out.getvalue())
    sys.__stderr__.flush()
    for task in tasks:
        task.cancel(f"hang_watch: {test} ran past {HANG_S:.0f} s")


def _write_await_chain(coro, out: io.StringIO) -> None:
    """The coroutine's frames down to what it waits on (Task.print_stack shows the outermost frame only)."""
    for _ in range(60):
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
        if frame is None:
            out.write(f"    waits on {coro!r}\n")
            return
        out.write(f"    {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}\n")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) or getattr(coro, "ag_await", None)


def _on_hang(test: str) -> None:
    for loop in _main_thread_loops():
        loop.call_soon_threadsafe(_dump_and_cancel, loop, test)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    timer = threading.Timer(HANG_S, _on_hang, args=(item.nodeid,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()

"""A pytest plugin that turns a hung in-process test into one failure with its evidence, instead of a CI time-out.

Most serving tests drive an event loop with asyncio.run. When one waits forever, the thread stacks that
faulthandler writes show only an idle `select`; what waits on what lives in the loop's tasks. After HANG_S in one
test this writes every task of every open event loop (its coroutine stack) to the log, then cancels them: the
test fails with CancelledError and the suite goes on. Only loops running on the main thread (the tests' own) are
touched. Every thread's innermost frames go with it, and the whole report also to the file ORCHARD_HANG_REPORT
names (scripts/test.sh prints it last, where a CI log's tail shows it).
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import io
import os
import sys
import threading
import traceback

import pytest

# The slowest test takes ~150 s alone on the 2-core machine; pyproject's faulthandler dump comes at 300 s.
# ORCHARD_TEST_HANG_S sets it (this plugin's own check uses 2 s).
HANG_S = float(os.environ.get("ORCHARD_TEST_HANG_S", "420"))
TEARDOWN_HANG_S = HANG_S / 10  # teardowns take seconds; a server stop gives up after 60 s
THREAD_FRAMES = 8
LASTING_THREADS = ("orchard-engine", "orchard-local")  # an engine's thread, an in-process server's  # each thread's innermost frames in the report: where it waits, not pytest's own frames


def write_report(text: str) -> None:
    """To the log, and appended to ORCHARD_HANG_REPORT's file when the run names one."""
    sys.__stderr__.write(text)
    sys.__stderr__.flush()
    path = os.environ.get("ORCHARD_HANG_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as report:
            report.write(text)


def thread_stacks() -> str:
    """Every thread of this process: its name and innermost frames."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    out = io.StringIO()
    for ident, frame in sys._current_frames().items():
        out.write(f"--- thread {names.get(ident, ident)}\n")
        for entry in traceback.extract_stack(frame)[-THREAD_FRAMES:]:
            out.write(f"    {entry.filename}:{entry.lineno} in {entry.name}\n")
    return out.getvalue()


def _running_loops() -> list[asyncio.AbstractEventLoop]:
    """The event loops running now, on any thread (the tests' own on the main thread; in-process servers' on theirs).
    Looked up only when a test hangs: a global event loop policy that recorded them made a real-time test slower."""
    return [obj for obj in gc.get_objects()
            if isinstance(obj, asyncio.AbstractEventLoop) and obj.is_running() and not obj.is_closed()]


def _dump_tasks(loop: asyncio.AbstractEventLoop, test: str, after_s: float, cancel: bool) -> None:
    """Runs on `loop`: write its tasks' stacks, then cancel them when `cancel`."""
    out = io.StringIO()
    tasks = asyncio.all_tasks(loop)
    out.write(f"\n=== hang_watch: {test} still running after {after_s:.0f} s; {len(tasks)} tasks on a loop "
              f"of thread {threading.current_thread().name} ===\n")
    for task in tasks:
        out.write(f"--- {task.get_name()}\n")
        _write_await_chain(task.get_coro(), out)
    write_report(out.getvalue())
    if cancel:
        for task in tasks:
            task.cancel(f"hang_watch: {test} ran past {after_s:.0f} s")


def _write_await_chain(coro, out: io.StringIO) -> None:
    """The coroutine's frames down to what it waits on (Task.print_stack shows the outermost frame only)."""
    for _ in range(60):
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
        if frame is None:
            inner = _awaited_generator(coro)
            if inner is None:
                out.write(f"    waits on {coro!r}\n")
                return
            coro = inner  # an async generator's asend/athrow (an `async with` exit, `anext`): into the generator
            continue
        out.write(f"    {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}\n")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) or getattr(coro, "ag_await", None)


def _awaited_generator(awaitable):
    """The async generator an `async_generator_asend`/`athrow` runs (they expose no frame of their own)."""
    if type(awaitable).__name__ not in ("async_generator_asend", "async_generator_athrow"):
        return None
    return next((ref for ref in gc.get_referents(awaitable) if inspect.isasyncgen(ref)), None)


def _on_hang(test: str, after_s: float, cancel: bool, fired: threading.Event) -> None:
    """Runs on the timer's thread: the threads now, then each loop's tasks (once that loop runs again); the main
    thread's (the test's own) are cancelled when `cancel`."""
    fired.set()
    write_report(f"\n=== hang_watch: {test} still running after {after_s:.0f} s; its process's threads ===\n"
                 + thread_stacks())
    main = threading.main_thread().ident
    for loop in _running_loops():
        own = getattr(loop, "_thread_id", None) == main
        loop.call_soon_threadsafe(_dump_tasks, loop, test, after_s, cancel and own)


class Watch:
    """A timer over one test phase; `fired` once it reported (and cancelled)."""

    def __init__(self, test: str, after_s: float, cancel: bool) -> None:
        self.fired = threading.Event()
        self._timer = threading.Timer(after_s, _on_hang, args=(test, after_s, cancel, self.fired))
        self._timer.daemon = True
        self._timer.start()

    def stop(self) -> None:
        self._timer.cancel()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """A test still running after HANG_S fails, even where cancelling its tasks let it end otherwise (a close that
    swallows the cancellation)."""
    watch = Watch(item.nodeid, HANG_S, cancel=True)
    try:
        result = yield
    finally:
        watch.stop()
    if watch.fired.is_set():
        pytest.fail(f"hung: still running after {HANG_S:.0f} s, its tasks cancelled (hang_watch's report above)",
                    pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item):
    """A fixture's teardown that waits long (a server that does not stop) is reported, not cancelled."""
    watch = Watch(f"{item.nodeid} (teardown)", TEARDOWN_HANG_S, cancel=False)
    try:
        return (yield)
    finally:
        watch.stop()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """An engine or server thread still alive once every test is done is a teardown that gave up (and MLX aborts
    the process at exit when a thread that made MLX streams outlives them): reported with where it is."""
    left = [thread for thread in threading.enumerate() if thread.name in LASTING_THREADS and thread.is_alive()]
    if left:
        write_report(f"\n=== hang_watch: {len(left)} engine or server threads still alive after the last test: "
                     f"{', '.join(sorted(thread.name for thread in left))} ===\n" + thread_stacks())

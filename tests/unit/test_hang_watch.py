"""The suite's hang watch (tests/support/hang_watch.py): a test that waits forever fails with its tasks' stacks."""

import os
import subprocess
import sys
from pathlib import Path

HUNG = '''
import asyncio
import contextlib
import time

import pytest

@contextlib.asynccontextmanager
async def held():
    try:
        yield
    finally:
        await asyncio.Event().wait()

def test_waits_forever():
    async def wait_for_nothing():
        async with held():
            pass
    asyncio.run(wait_for_nothing())

@pytest.fixture
def slow_to_stop():
    yield
    time.sleep(1.0)

def test_stops_slowly(slow_to_stop):
    pass

def test_ends_once_cancelled():
    async def close_swallowing_cancellation():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()
    asyncio.run(close_swallowing_cancellation())
'''


def test_a_hung_test_fails_with_its_await_chain_and_a_slow_teardown_is_reported(tmp_path: Path):
    (tmp_path / "test_hung.py").write_text(HUNG)
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.support.hang_watch"]\n')
    repo = Path(__file__).resolve().parents[2]
    report = tmp_path / "hangs.txt"
    env = {**os.environ, "ORCHARD_TEST_HANG_S": "2", "PYTHONPATH": str(repo), "ORCHARD_HANG_REPORT": str(report)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "faulthandler_timeout=0",
                           str(tmp_path)], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert done.returncode == 1, done.stdout
    assert "2 failed, 1 passed" in done.stdout and "CancelledError" in done.stdout
    assert "FAILED test_hung.py::test_ends_once_cancelled - Failed: hung: still running a" in done.stdout
    written = report.read_text()
    assert "test_hung.py::test_waits_forever still running after 2 s; its process's threads" in written
    assert "--- thread MainThread" in written and "in select" in written  # the loop's thread waits in select
    # Through the `async with` exit into the context manager's generator, down to what it waits on.
    assert "test_hung.py:17 in wait_for_nothing" in written and "test_hung.py:13 in held" in written
    assert "locks.py" in written
    assert "test_stops_slowly (teardown) still running after 0 s" in written and "in slow_to_stop" in written
    threads = written[:written.index("tasks on a loop")]
    assert threads[:threads.rindex("\n===")] in done.stdout  # the failed test's captured log has it too

"""The suite's hang watch (tests/support/hang_watch.py): a test that waits forever fails with its tasks' stacks."""

import os
import subprocess
import sys
from pathlib import Path

HUNG = '''
import asyncio

def test_waits_forever():
    async def wait_for_nothing():
        await asyncio.Event().wait()
    asyncio.run(wait_for_nothing())
'''


def test_a_hung_test_fails_with_its_await_chain(tmp_path: Path):
    (tmp_path / "test_hung.py").write_text(HUNG)
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.support.hang_watch"]\n')
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "ORCHARD_TEST_HANG_S": "2", "PYTHONPATH": str(repo)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "faulthandler_timeout=0",
                           str(tmp_path)], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert done.returncode == 1, done.stdout
    assert "1 failed" in done.stdout and "CancelledError" in done.stdout
    assert "still running after 2 s" in done.stdout
    assert "test_hung.py:6 in wait_for_nothing" in done.stdout and "locks.py" in done.stdout

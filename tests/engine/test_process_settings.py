"""The engine process does not keep what Ray hands its workers (nice 15, OMP_NUM_THREADS=1): it runs at nice 0 with
its device's thread counts, and says so in its log where the OS refuses to raise its priority."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.client.process_settings import THREAD_VARIABLES, engine_thread_env, usable_cores

ROOT = Path(__file__).parents[2]

# Run in a child Python, as a Ray worker would be: niced and with OMP_NUM_THREADS=1. It starts the engine process
# on the model folder, reads the engine process's niceness and environment from /proc, and prints them.
STARTS_AN_ENGINE_LIKE_A_RAY_WORKER = """
import asyncio, json, os, sys
os.nice(15)
from engine.client.process_client import ProcessEngineClient
from engine.client.spec import EngineSpec

async def main():
    client = ProcessEngineClient(EngineSpec(model_path=sys.argv[1]))
    await client.start()
    try:
        stat = open(f"/proc/{client.pid}/stat").read().rsplit(")", 1)[1].split()
        environ = dict(item.split("=", 1) for item in open(f"/proc/{client.pid}/environ").read().split("\\0") if "=" in item)
        print(json.dumps({"worker_nice": os.getpriority(os.PRIO_PROCESS, 0), "engine_nice": int(stat[16]),
                          "engine_threads": {name: environ.get(name) for name in sys.argv[2:]}}))
    finally:
        await client.close()

asyncio.run(main())
"""

# As an unprivileged user (uid 65534, nobody): lowering one's own niceness is refused, and the message says what to do.
UNPRIVILEGED_RAISE = """
import json, os
from engine.client.process_settings import priority_message, raise_engine_priority
os.nice(10)
os.setgid(65534)
os.setuid(65534)
change = raise_engine_priority()
print(json.dumps({"before": change.before, "after": change.after, "refused": change.refused,
                  "message": priority_message(change)}))
"""


def _python(code: str, *args: str, **env: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env}, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads the engine process through /proc")
def test_an_engine_started_by_a_niced_single_thread_worker_runs_at_nice_0_with_every_core(tiny_llama):
    seen = _python(STARTS_AN_ENGINE_LIKE_A_RAY_WORKER, str(tiny_llama.path), *THREAD_VARIABLES, OMP_NUM_THREADS="1")
    assert seen["worker_nice"] == 15
    if os.geteuid() == 0:  # an unprivileged test run may not lower it (the next test covers that case)
        assert seen["engine_nice"] == 0
    # On the CPU backend every usable core; these tests run MLX on the CPU.
    assert seen["engine_threads"] == {name: str(usable_cores()) for name in THREAD_VARIABLES}


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become an unprivileged user")
def test_an_unprivileged_engine_keeps_its_niceness_and_says_how_to_fix_it():
    seen = _python(UNPRIVILEGED_RAISE)
    assert (seen["before"], seen["after"]) == (10, 10)
    assert seen["refused"] == "Permission denied"
    assert "RAY_worker_niceness=0" in seen["message"] and "nice 10" in seen["message"]


def test_thread_counts_follow_the_device_and_the_operator():
    assert engine_thread_env(runs_on_cpu=False, environ={"OMP_NUM_THREADS": "1"}) == {}
    assert engine_thread_env(runs_on_cpu=True, environ={})["OMP_NUM_THREADS"] == str(usable_cores())
    assert engine_thread_env(runs_on_cpu=False, environ={"ORCHARD_ENGINE_THREADS": "3"}) == {
        name: "3" for name in THREAD_VARIABLES}
    with pytest.raises(Exception, match="ORCHARD_ENGINE_THREADS must be a whole number >= 1, got '0'"):
        engine_thread_env(runs_on_cpu=True, environ={"ORCHARD_ENGINE_THREADS": "0"})

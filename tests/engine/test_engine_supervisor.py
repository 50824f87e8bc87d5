"""SupervisedEngine: an engine process killed with -9 is noticed at once and restarted in place; requests that
had produced nothing are re-queued on the new engine; new requests meanwhile get EngineRestartingError; past the
restart budget the engine is failed and says why. And a stalled engine reports itself degraded."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from engine import EngineConfig, Request, SamplingParams
from engine.client.interface import EngineStatus
from engine.client.process_client import ProcessEngineClient
from engine.client.spec import EngineSpec
from engine.client.supervisor import RestartBudget, SupervisedEngine
from engine.errors import EngineDeadError, EngineRestartingError
from engine.output.request_output import Admitted, Finish, Queued, TextDelta
from tests.engine.test_engine_clients import GREEDY, collect, run

# One decode row: a second request waits in the engine's queue while the first streams.
ONE_ROW = EngineConfig(max_decode_seqs=1, max_prefill_seqs=1)
# Slack over the first load for a restart (the bound: the model's load time + 5 s).
RESTART_SLACK_S = 5.0


def _supervised(loaded, budget: RestartBudget = RestartBudget(), config: EngineConfig = ONE_ROW) -> SupervisedEngine:
    spec = EngineSpec(model_path=str(loaded.path), engine_config=config)
    return SupervisedEngine(lambda: ProcessEngineClient(spec), budget)


def _long(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=2000, **GREEDY))


async def _wait_status(engine: SupervisedEngine, status: EngineStatus, timeout_s: float) -> float:
    """Seconds until the engine reports `status` (fails the test past timeout_s)."""
    started = time.monotonic()
    while engine.health().status is not status:
        assert time.monotonic() - started < timeout_s, f"still {engine.health()} after {timeout_s} s"
        await asyncio.sleep(0.01)
    return time.monotonic() - started


def test_a_killed_engine_restarts_in_place_and_requeues_what_had_not_started(tiny_llama):
    async def scenario():
        engine = _supervised(tiny_llama)
        load_started = time.monotonic()
        await engine.start()
        load_s = time.monotonic() - load_started
        try:
            streaming = aiter(engine.submit(_long("streaming", [1, 2, 3])))
            assert [type(await anext(streaming)), type(await anext(streaming))] == [Queued, Admitted]
            assert isinstance(await anext(streaming), TextDelta)  # it has streamed output
            queued = asyncio.create_task(collect(engine.submit(
                Request("queued", [4, 5, 6], SamplingParams(max_tokens=7, **GREEDY))
            )))
            for _ in range(250):  # until the engine's stats show the queued request waiting
                if engine.stats().num_waiting == 1:
                    break
                await asyncio.sleep(0.02)
            assert engine.stats().num_waiting == 1
            first_pid = engine.pid
            os.kill(first_pid, signal.SIGKILL)
            noticed_s = await _wait_status(engine, EngineStatus.RESTARTING, timeout_s=1.0)
            with pytest.raises(EngineRestartingError) as refused:
                engine.submit(Request("new", [1], SamplingParams(max_tokens=2)))
            with pytest.raises(EngineDeadError):  # it had streamed: its text cannot be resumed exactly
                async for _ in streaming:
                    pass
            back_s = await _wait_status(engine, EngineStatus.RUNNING, timeout_s=load_s + RESTART_SLACK_S)
            token_ids, _, finish = await asyncio.wait_for(queued, 30)
            after = await collect(engine.submit(Request("after", [4, 5, 6], SamplingParams(max_tokens=7, **GREEDY))))
            return noticed_s, refused.value, back_s, token_ids, finish, after, first_pid, engine.pid, engine.restarts_total
        finally:
            await engine.close()

    noticed_s, refused, back_s, token_ids, finish, after, first_pid, second_pid, restarts = run(scenario, timeout_s=120)
    assert noticed_s < 1.0
    assert refused.code == "engine_restarting" and refused.retry_after_s >= 1
    assert finish.reason.value == "length" and len(token_ids) == 7
    assert token_ids == after[0]  # the re-queued request ran as a fresh one would, on the new engine
    assert second_pid not in (None, first_pid) and restarts == 1


def test_a_request_admitted_without_output_yet_is_requeued_and_told_of_its_admission_once(tiny_llama):
    """Killed during a long prefill (after the request's admission, before its first token), the request runs again
    on the new engine; its stream tells one queueing and one admission, then a whole run's tokens."""
    prompt = [(7 * i) % 250 + 1 for i in range(1600)]
    slow_prefill = EngineConfig(prefill_chunk_tokens=2, prefill_step_tokens=2)  # 800 steps

    async def scenario():
        engine = _supervised(tiny_llama, config=slow_prefill)
        await engine.start()
        try:
            stream = aiter(engine.submit(Request("long", prompt, SamplingParams(max_tokens=3, **GREEDY))))
            queued, admitted = await anext(stream), await anext(stream)
            assert queued == Queued()
            os.kill(engine.pid, signal.SIGKILL)
            return admitted, [event async for event in stream], engine.restarts_total
        finally:
            await engine.close()

    admitted, rest, restarts = run(scenario, timeout_s=120)
    assert admitted == Admitted(prompt_tokens=1600, cached_tokens=0) and restarts == 1
    assert [type(e) for e in rest] == [TextDelta] * (len(rest) - 1) + [Finish]
    assert sum(len(e.token_ids) for e in rest[:-1]) == 3 and rest[-1].reason.value == "length"


def test_past_the_restart_budget_the_engine_is_failed_and_says_why(tiny_llama):
    async def scenario():
        engine = _supervised(tiny_llama, RestartBudget(max_restarts=1, window_s=600))
        await engine.start()
        try:
            os.kill(engine.pid, signal.SIGKILL)
            await _wait_status(engine, EngineStatus.RESTARTING, timeout_s=1.0)
            await _wait_status(engine, EngineStatus.RUNNING, timeout_s=60)
            os.kill(engine.pid, signal.SIGKILL)
            await _wait_status(engine, EngineStatus.FAILED, timeout_s=5)
            with pytest.raises(EngineDeadError) as refused:
                engine.submit(Request("late", [1], SamplingParams(max_tokens=2)))
            return engine.health(), refused.value
        finally:
            await engine.close()

    health, refused = run(scenario, timeout_s=120)
    assert health.status is EngineStatus.FAILED and not health.alive
    assert "died 2 times within 600 s" in health.message and "engine process" in health.message
    assert refused.message == health.message


def test_a_stalled_engine_is_degraded_until_its_steps_end_again(tiny_llama):
    async def scenario():
        client = ProcessEngineClient(EngineSpec(model_path=str(tiny_llama.path)))
        client.stall_after_s = 1.0  # the engine posts its stats every 0.5 s when idle, between steps when busy
        await client.start()
        try:
            await asyncio.sleep(1.0)
            before = client.health()
            os.kill(client.pid, signal.SIGSTOP)  # a step that does not end
            await asyncio.sleep(2.0)
            stalled = client.health()
            os.kill(client.pid, signal.SIGCONT)
            await asyncio.sleep(1.0)
            return before, stalled, client.health()
        finally:
            await client.close()

    before, stalled, after = run(scenario, timeout_s=60)
    assert before.status is EngineStatus.RUNNING and after.status is EngineStatus.RUNNING
    assert stalled.status is EngineStatus.DEGRADED and stalled.alive
    assert "No engine step has ended for" in stalled.message

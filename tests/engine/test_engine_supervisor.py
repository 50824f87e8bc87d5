"""SupervisedEngine: an engine process killed with -9 is noticed at once and restarted in place; requests that
had produced nothing are re-queued on the new engine; new requests meanwhile get EngineRestartingError; past the
restart budget the engine is failed and says why. And a stalled engine reports itself degraded.

"At once" is an event here, not a time: the killed engine's client reports its death as its socket closes, and
the supervisor's health tells it at the very next call. Other waits are for events, bounded only against a hang."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from engine import EngineConfig, Request, SamplingParams
from engine.health import EngineStatus
from engine.client.process_client import ProcessEngineClient
from engine.client.spec import EngineSpec
from engine.client.supervisor import RestartBudget, SupervisedEngine
from engine.errors import EngineDeadError, EngineRestartingError
from engine.output.request_output import Admitted, Finish, Queued, TextDelta
from tests.engine.test_engine_clients import GREEDY, HANG_S, collect, next_stats, run, until

# One decode row: a second request waits in the engine's queue while the first streams.
ONE_ROW = EngineConfig(max_decode_seqs=1, max_prefill_seqs=1)


def _supervised(loaded, budget: RestartBudget = RestartBudget(), config: EngineConfig = ONE_ROW) -> SupervisedEngine:
    spec = EngineSpec(model_path=str(loaded.path), engine_config=config)
    return SupervisedEngine(lambda: ProcessEngineClient(spec), budget)


def _long(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=2000, **GREEDY))


async def _kill_and_see_it_noticed(engine: SupervisedEngine) -> int:
    """kill -9 the engine process; once its client has seen the socket close, the health says so with no wait.
    The killed pid."""
    killed_pid, killed_client = engine.pid, engine._client
    os.kill(killed_pid, signal.SIGKILL)
    await asyncio.wait_for(killed_client.wait_dead(), HANG_S)
    health = engine.health()
    assert health.status is EngineStatus.RESTARTING and "engine process" in health.message, health
    return killed_pid


async def _wait_status(engine: SupervisedEngine, status: EngineStatus) -> None:
    await until(lambda: engine.health().status is status, what=f"the engine {status.value}")


def test_a_killed_engine_restarts_in_place_and_requeues_what_had_not_started(tiny_llama):
    async def scenario():
        engine = _supervised(tiny_llama)
        await engine.start()
        try:
            streaming = aiter(engine.submit(_long("streaming", [1, 2, 3])))
            assert [type(await anext(streaming)), type(await anext(streaming))] == [Queued, Admitted]
            assert isinstance(await anext(streaming), TextDelta)  # it has streamed output
            queued = asyncio.create_task(collect(engine.submit(
                Request("queued", [4, 5, 6], SamplingParams(max_tokens=7, **GREEDY))
            )))
            await until(lambda: engine.stats().num_waiting == 1, what="the queued request waiting in the engine")
            first_pid = await _kill_and_see_it_noticed(engine)
            with pytest.raises(EngineRestartingError) as refused:
                engine.submit(Request("new", [1], SamplingParams(max_tokens=2)))
            with pytest.raises(EngineDeadError):  # it had streamed: its text cannot be resumed exactly
                async for _ in streaming:
                    pass
            await _wait_status(engine, EngineStatus.RUNNING)
            token_ids, _, finish = await asyncio.wait_for(queued, HANG_S)
            after = await collect(engine.submit(Request("after", [4, 5, 6], SamplingParams(max_tokens=7, **GREEDY))))
            return refused.value, token_ids, finish, after, first_pid, engine.pid, engine.restarts_total
        finally:
            await engine.close()

    refused, token_ids, finish, after, first_pid, second_pid, restarts = run(scenario, timeout_s=2 * HANG_S)
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

    admitted, rest, restarts = run(scenario, timeout_s=2 * HANG_S)
    assert admitted == Admitted(prompt_tokens=1600, cached_tokens=0) and restarts == 1
    assert [type(e) for e in rest] == [TextDelta] * (len(rest) - 1) + [Finish]
    assert sum(len(e.token_ids) for e in rest[:-1]) == 3 and rest[-1].reason.value == "length"


def test_past_the_restart_budget_the_engine_is_failed_and_says_why(tiny_llama):
    async def scenario():
        engine = _supervised(tiny_llama, RestartBudget(max_restarts=1, window_s=600))
        await engine.start()
        try:
            await _kill_and_see_it_noticed(engine)
            await _wait_status(engine, EngineStatus.RUNNING)
            os.kill(engine.pid, signal.SIGKILL)
            await _wait_status(engine, EngineStatus.FAILED)
            with pytest.raises(EngineDeadError) as refused:
                engine.submit(Request("late", [1], SamplingParams(max_tokens=2)))
            return engine.health(), refused.value
        finally:
            await engine.close()

    health, refused = run(scenario, timeout_s=2 * HANG_S)
    assert health.status is EngineStatus.FAILED and not health.alive
    assert "died 2 times within 600 s" in health.message and "engine process" in health.message
    assert refused.message == health.message


def test_a_stalled_engine_is_degraded_until_its_steps_end_again(tiny_llama):
    stall_after_s = 1.0

    async def scenario():
        client = ProcessEngineClient(EngineSpec(model_path=str(tiny_llama.path)))
        client.stall_after_s = stall_after_s  # the engine posts its stats every 0.5 s when idle, between steps when busy
        await client.start()
        try:
            # Idle for longer than the stall bound, yet running: its idle stats are its heartbeat.
            started = asyncio.get_running_loop().time()
            while asyncio.get_running_loop().time() - started <= stall_after_s:
                await next_stats(client)
            before = client.health()
            os.kill(client.pid, signal.SIGSTOP)  # a step that does not end
            try:
                await until(lambda: client.health().status is EngineStatus.DEGRADED, what="the engine degraded")
                stalled = client.health()
            finally:
                os.kill(client.pid, signal.SIGCONT)
            await next_stats(client)
            return before, stalled, client.health()
        finally:
            await client.close()

    before, stalled, after = run(scenario, timeout_s=2 * HANG_S)
    assert before.status is EngineStatus.RUNNING and after.status is EngineStatus.RUNNING
    assert stalled.status is EngineStatus.DEGRADED and stalled.alive
    assert "No engine step has ended for" in stalled.message


def test_a_restarted_engine_gets_the_dead_ones_adapters_back(tiny_llama, tmp_path):
    """Per-request LoRA adapters loaded over the process client live in the engine process: a replacement engine
    loads them again before it serves, so a request naming one answers as before the kill."""
    from tests.support.tiny_adapters import random_lora, write_mlx_lm_adapter

    folder = write_mlx_lm_adapter(tmp_path / "style", random_lora(tiny_llama.model, 4, 7), scale=2.0)

    async def scenario():
        engine = _supervised(tiny_llama)
        await engine.start()
        try:
            loaded = await engine.load_adapter("style", folder)
            before = await collect(engine.submit(Request("a", [4, 5, 6], SamplingParams(max_tokens=6, **GREEDY),
                                                         adapter="style")))
            base = await collect(engine.submit(Request("b", [4, 5, 6], SamplingParams(max_tokens=6, **GREEDY))))
            await _kill_and_see_it_noticed(engine)
            await _wait_status(engine, EngineStatus.RUNNING)
            after = await collect(engine.submit(Request("c", [4, 5, 6], SamplingParams(max_tokens=6, **GREEDY),
                                                        adapter="style")))
            return loaded, before, base, after, [a.name for a in engine.adapters]
        finally:
            await engine.close()

    loaded, before, base, after, names = run(scenario, timeout_s=2 * HANG_S)
    assert [a.name for a in loaded] == ["style"] and names == ["style"]
    assert after[0] == before[0] != base[0]

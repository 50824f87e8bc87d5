"""The previous step's outputs are made on a worker thread while this step's work launches
(runner/overlapped_launch.py), and that changes nothing a request sees."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import replace

import mlx.core as mx
import pytest

from engine import EngineConfig, EngineCore, Request
from engine.request import FinishReason
from engine.runner.overlapped_launch import OverlappedLaunch
from tests.engine.test_batching import assert_each_as_alone, params, random_prompts, run_alone, run_observing

WORKER = "orchard-outputs"


class UnwalkableList(list):
    """A list mx.async_eval fails to walk: a launch that raises, without faking MLX."""

    def __iter__(self):
        raise RuntimeError("the launch failed")


def test_work_beside_a_launch_runs_on_the_worker_and_is_done_when_the_launch_returns():
    launch, ran_on = OverlappedLaunch(), []
    x = mx.arange(4) * 2
    launch.launch([x], beside=lambda: ran_on.append(threading.current_thread().name))
    assert len(ran_on) == 1 and ran_on[0].startswith(WORKER) and ran_on[0] != threading.current_thread().name
    assert x.tolist() == [0, 2, 4, 6]
    launch.close()


def test_at_interpreter_exit_the_work_beside_runs_after_the_launch_on_its_thread(monkeypatch):
    """concurrent.futures refuses new work once the interpreter exits, before atexit stops an engine left running
    (client/thread_client.py): its steps go on, the work done on the launching thread."""
    import concurrent.futures.thread

    launch, ran_on = OverlappedLaunch(), []
    monkeypatch.setattr(concurrent.futures.thread, "_shutdown", True)
    x = mx.arange(4) * 3
    launch.launch([x], beside=lambda: ran_on.append(threading.current_thread().name))
    assert ran_on == [threading.current_thread().name] and x.tolist() == [0, 3, 6, 9]
    monkeypatch.undo()
    launch.close()


def test_the_workers_error_is_raised_by_the_launch():
    launch = OverlappedLaunch()

    def failing() -> None:
        raise ValueError("stop check failed")

    with pytest.raises(ValueError, match="stop check failed"):
        launch.launch([mx.ones(3)], beside=failing)
    launch.launch([mx.ones(3)], beside=lambda: None)  # the worker lives on
    launch.close()


def test_a_launch_error_wins_over_the_workers_and_notes_it():
    launch, finished = OverlappedLaunch(), threading.Event()

    def failing() -> None:
        time.sleep(0.05)  # still running when the launch fails: the launch waits for it
        finished.set()
        raise ValueError("worker failed")

    with pytest.raises(RuntimeError, match="the launch failed") as raised:
        launch.launch(UnwalkableList([mx.ones(3)]), beside=failing)
    assert finished.is_set()
    assert any("worker failed" in note for note in raised.value.__notes__)
    with pytest.raises(RuntimeError, match="the launch failed"):  # and with nothing beside it
        launch.launch(UnwalkableList([mx.ones(3)]))
    launch.close()


def mixed_batch(loaded) -> tuple[list[list[int]], list]:
    """Six requests of assorted sampling and lengths: greedy and seeded, one with a penalty (its previous tokens are
    read before sampling), one stopping early on a token it generates (finished on the worker)."""
    prompts = random_prompts(6, seed=11)
    sampling = [params(i, max_tokens=8 + i) for i in range(6)]
    sampling[1] = replace(sampling[1], frequency_penalty=0.7)
    stop = run_alone(loaded, "r4", prompts[4], sampling[4]).token_ids[3]
    sampling[4] = replace(sampling[4], stop_token_ids=(stop,))
    return prompts, sampling


def noting_hand_overs(core: EngineCore, monkeypatch) -> list[tuple[str, list[str]]]:
    """Each hand-over of tokens the core's runner makes: the thread it ran on and the tokens' requests."""
    handed, execute = [], core.runner.execute

    def execute_noting(scheduled, before_device_work=None, on_tokens=None):
        def note(tokens):
            handed.append((threading.current_thread().name, [token.request_id for token in tokens]))
            on_tokens(tokens)

        return execute(scheduled, before_device_work, note)

    monkeypatch.setattr(core.runner, "execute", execute_noting)
    return handed


def test_a_batch_takes_its_previous_tokens_in_on_the_worker_and_each_stream_is_as_alone(tiny_llama, monkeypatch):
    prompts, sampling = mixed_batch(tiny_llama)
    core = EngineCore(tiny_llama, EngineConfig(max_prefill_seqs=2, prefill_chunk_tokens=16, max_decode_seqs=6))
    core.runner.overlap_max_read_wait_s = math.inf  # the CPU computes while reads wait: overlap every step anyway
    handed = noting_hand_overs(core, monkeypatch)
    results, _ = run_observing(core, prompts, sampling, lambda batch: None)
    assert handed and all(name.startswith(WORKER) for name, _ in handed)
    # Every generated token but each request's first (returned with its prefill) was handed over.
    generated = sum(len(result.token_ids) for result in results.values())
    assert sum(len(ids) for _, ids in handed) >= generated - len(prompts)
    assert max(len(ids) for _, ids in handed) >= 4  # steps of a shared batch
    assert results["r4"].finish.reason == FinishReason.STOP and len(results["r4"].token_ids) <= 4
    assert_each_as_alone(tiny_llama, prompts, sampling, results)


def test_each_steps_outputs_are_those_of_the_synchronous_path(tiny_llama, monkeypatch):
    # The runner without on_tokens returns every token (as before the overlap): the same outputs, step by step.
    prompts, sampling = mixed_batch(tiny_llama)

    def run(synchronous: bool) -> list[list[tuple]]:
        core = EngineCore(tiny_llama, EngineConfig(max_prefill_seqs=2, prefill_chunk_tokens=16, max_decode_seqs=6))
        if synchronous:
            execute = core.runner.execute
            monkeypatch.setattr(core.runner, "execute", lambda scheduled, before, on_tokens=None: execute(
                scheduled, before))
        for i, (prompt, params_i) in enumerate(zip(prompts, sampling)):
            core.add_request(Request(f"r{i}", prompt, params_i))
        steps = []
        while core.has_unfinished_requests():
            steps.append([(o.request_id, o.delta, o.finish and o.finish.reason) for o in core.step()])
        core.close()
        return steps

    overlapped, synchronous = run(False), run(True)
    assert overlapped == synchronous
    assert sum(len(step) for step in overlapped) > 40


def test_where_reads_wait_for_the_device_a_step_launches_first_and_returns_the_tokens(tiny_llama, monkeypatch):
    """A read that waited (the device bounds the step) turns the overlap off: the next plain steps launch, then read,
    and return their tokens (no hand-over); every stream is still as alone. (Rows with penalties read before their
    sampling whatever the device does, and hand over what they read: none here.)"""
    prompts, sampling = mixed_batch(tiny_llama)
    sampling = [replace(params_i, frequency_penalty=0.0) for params_i in sampling]
    core = EngineCore(tiny_llama, EngineConfig(max_prefill_seqs=2, prefill_chunk_tokens=16, max_decode_seqs=6))
    core.runner.overlap_max_read_wait_s = 0.0  # any wait at all
    handed = noting_hand_overs(core, monkeypatch)
    results, _ = run_observing(core, prompts, sampling, lambda batch: None)
    generated = sum(len(result.token_ids) for result in results.values())
    assert sum(len(ids) for _, ids in handed) <= 6 < generated  # the first read's tokens at most
    assert_each_as_alone(tiny_llama, prompts, sampling, results)

"""The engine client contract, run against both clients: the thread client (engine on a thread of this process)
and the process client (engine in a child process). Same streams, same errors, same lifecycle."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Callable

import pytest

from engine import EngineConfig, EngineCore, Request, SamplingParams
from engine.client.process_client import ProcessEngineClient
from engine.client.spec import EngineSpec
from engine.client.thread_client import ThreadEngineClient
from engine.errors import (
    ContextLengthExceededError,
    EngineDeadError,
    InvalidRequestError,
    ModelLoadError,
    QueueFullError,
    QueueTimeoutError,
)
from engine.output.request_output import Admitted, Finish, Queued, TextDelta
from tests.engine.test_batching import run_alone
from tests.engine.test_structured_output import assert_valid, free_requests, schema_requests
from tests.support.json_schemas import SCHEMAS

GREEDY = dict(temperature=0.0, ignore_eos=True)
CLIENTS = ["thread", "process"]
# Bounds a scenario, or its wait for an event (stats posted, an engine restarted): only a hang reaches it, not a
# machine ten times slower than usual.
HANG_S = 300.0


async def collect(stream) -> tuple[list[int], str, Finish]:
    token_ids, text, finish = [], "", None
    async for event in stream:
        if isinstance(event, TextDelta):
            token_ids += event.token_ids
            text += event.text
        elif isinstance(event, Finish):
            finish = event
    return token_ids, text, finish


def new_client(kind: str, loaded, **config):
    if kind == "thread":
        return ThreadEngineClient(lambda: EngineCore(loaded, EngineConfig(**config)))
    return ProcessEngineClient(EngineSpec(model_path=str(loaded.path), engine_config=EngineConfig(**config)))


async def started(kind: str, loaded, **config):
    client = new_client(kind, loaded, **config)
    await client.start()
    return client


def run(scenario, timeout_s: float = HANG_S):
    return asyncio.run(asyncio.wait_for(scenario(), timeout=timeout_s))


async def until(condition: Callable[[], object], timeout_s: float = HANG_S, what: str = "condition") -> None:
    """Poll condition() (a plain function: engine stats and health are read without waiting) until it holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.01)


async def next_stats(client) -> None:
    """Until the engine posts its stats again (its heartbeat: between steps, and every 0.5 s while idle)."""
    last = client.stats()
    await until(lambda: client.stats() is not last, what="the engine's next stats")


@pytest.mark.parametrize("kind", CLIENTS)
def test_concurrent_streams_match_the_model_run_alone(kind, tiny_llama):
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]

    async def scenario():
        client = await started(kind, tiny_llama)
        try:
            streams = [
                client.submit(Request(f"r{i}", p, SamplingParams(max_tokens=9, **GREEDY))) for i, p in enumerate(prompts)
            ]
            results = await asyncio.gather(*(collect(s) for s in streams))
            # The engine posts its stats after its last step (they may come just after the outputs).
            await until(lambda: client.stats().generation_tokens_total == 4 * 9, what="the stats of the last step")
            return results, client.stats()
        finally:
            await client.close()

    results, stats = run(scenario)
    for i, (token_ids, text, finish) in enumerate(results):
        alone = run_alone(tiny_llama, "x", prompts[i], SamplingParams(max_tokens=9, **GREEDY))
        assert token_ids == alone.token_ids
        assert text == alone.text
        assert finish.reason.value == "length" and finish.usage.completion_tokens == 9
    assert stats.generation_tokens_total == 4 * 9  # the engine's counters reach the caller


@pytest.mark.parametrize("kind", CLIENTS)
def test_invalid_requests_are_refused_at_submit(kind, tiny_llama):
    async def scenario():
        client = await started(kind, tiny_llama, context_length=64)
        try:
            with pytest.raises(InvalidRequestError, match="top_p"):
                client.submit(Request("a", [1, 2], SamplingParams(top_p=0.0)))
            with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
                client.submit(Request("v", [1, 256], SamplingParams(max_tokens=2)))
            with pytest.raises(ContextLengthExceededError, match="maximum context length is 64"):
                client.submit(Request("b", list(range(60)), SamplingParams(max_tokens=10)))
            # Without max_tokens, the request may fill the context.
            token_ids, _, finish = await collect(client.submit(Request("c", list(range(60)), SamplingParams(**GREEDY))))
            assert len(token_ids) == 4 and finish.reason.value == "length"
            with pytest.raises(InvalidRequestError, match="Duplicate"):
                client.submit(Request("d", [1], SamplingParams(max_tokens=50, **GREEDY)))
                client.submit(Request("d", [1], SamplingParams(max_tokens=50, **GREEDY)))
        finally:
            await client.close()

    run(scenario)


@pytest.mark.parametrize("kind", CLIENTS)
def test_queue_full_is_reported_to_the_refused_request_only(kind, tiny_llama):
    async def scenario():
        client = await started(kind, tiny_llama, max_num_seqs=2)
        try:
            streams = [client.submit(Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=20, **GREEDY))) for i in range(3)]
            return await asyncio.gather(*(collect(s) for s in streams), return_exceptions=True)
        finally:
            await client.close()

    results = run(scenario)
    assert isinstance(results[2], QueueFullError)
    assert [len(r[0]) for r in results[:2]] == [20, 20]


@pytest.mark.parametrize("kind", CLIENTS)
def test_a_stream_opens_with_its_admission_which_tells_the_usage_its_finish_tells(kind, tiny_llama):
    """Queued comes first (the engine accepted the request), then Admitted (prompt tokens, prefix-cache hit) once the scheduler has taken the request in; the
    same prompt again hits the cache, and its admission and its finish count the same cached tokens. A request
    the queue refuses gets no admission, only its error."""
    prompt = [(7 * i) % 250 + 1 for i in range(100)]

    async def events_of(stream) -> list:
        return [event async for event in stream]

    async def scenario():
        client = await started(kind, tiny_llama, max_num_seqs=1, prefix_block_size=32)
        try:
            first = await events_of(client.submit(Request("a", prompt, SamplingParams(max_tokens=4, **GREEDY))))
            again = await events_of(client.submit(Request("b", prompt, SamplingParams(max_tokens=4, **GREEDY))))
            held = aiter(client.submit(Request("held", [1, 2], SamplingParams(max_tokens=2000, **GREEDY))))
            assert [type(await anext(held)), type(await anext(held))] == [Queued, Admitted]
            refused: list = []
            with pytest.raises(QueueFullError):
                async for event in client.submit(Request("refused", [3, 4], SamplingParams(max_tokens=2))):
                    refused.append(event)
            await held.aclose()
            return first, again, refused
        finally:
            await client.close()

    first, again, refused = run(scenario)
    for events, cached in ((first, 0), (again, 96)):  # 3 whole blocks: the last prompt token is always computed
        queued, admitted, *deltas, finish = events
        assert queued == Queued() and admitted == Admitted(prompt_tokens=100, cached_tokens=cached)
        assert all(isinstance(d, TextDelta) for d in deltas) and isinstance(finish, Finish)
        assert (finish.usage.prompt_tokens, finish.usage.cached_tokens) == (100, cached)
    assert refused == []


@pytest.mark.parametrize("kind", CLIENTS)
def test_queue_timeout_expires_a_request_that_never_started(kind, tiny_llama):
    async def scenario():
        client = await started(kind, tiny_llama, max_decode_seqs=1, queue_timeout=0.05)
        try:
            first = client.submit(Request("first", [1, 2], SamplingParams(max_tokens=400, **GREEDY)))
            second = client.submit(Request("second", [3, 4], SamplingParams(max_tokens=5, **GREEDY)))
            with pytest.raises(QueueTimeoutError, match="queue_timeout"):
                await collect(second)
            token_ids, _, _ = await collect(first)
            assert len(token_ids) == 400
        finally:
            await client.close()

    run(scenario)


@pytest.mark.parametrize("kind", CLIENTS)
def test_closing_a_stream_aborts_the_request_and_frees_its_kv(kind, tiny_llama):
    async def scenario():
        client = await started(kind, tiny_llama)
        try:
            stream = client.submit(Request("gone", [1, 2, 3], SamplingParams(max_tokens=2000, **GREEDY)))
            iterator = aiter(stream)
            await anext(iterator)
            await iterator.aclose()  # what a disconnected client does
            # Stats from after a step: the start-up ones (no step yet) read idle too.
            await until(lambda: (s := client.stats()).num_steps >= 1 and s.num_running == 0 and s.kv_cache_bytes == 0,
                        what="the aborted request's KV freed")
            stats = client.stats()
            assert stats.generation_tokens_total < 2000
        finally:
            await client.close()

    run(scenario)


@pytest.mark.parametrize("kind", CLIENTS)
def test_a_model_that_fails_to_build_raises_from_start(kind, tmp_path):
    async def scenario():
        spec = EngineSpec(model_path=str(tmp_path / "nothing-here"))
        client = ThreadEngineClient.from_spec(spec) if kind == "thread" else ProcessEngineClient(spec)
        with pytest.raises(ModelLoadError, match="config.json not found"):
            await client.start()
        assert not client.health().alive
        with pytest.raises(EngineDeadError, match="not started"):
            client.submit(Request("a", [1], SamplingParams(max_tokens=1)))

    run(scenario)


@pytest.mark.parametrize("kind", CLIENTS)
def test_buffers_go_back_when_idle_and_close_ends_the_engine(kind, tiny_llama):
    """Freed buffers stay cached under load, go back to the device once the engine idles (not every N steps,
    which would wait for the device holding the GIL); close ends open streams and refuses new requests."""

    async def scenario():
        client = await started(kind, tiny_llama)
        try:
            streams = [client.submit(Request(f"c{i}", [1 + i, 2, 3] * 20, SamplingParams(max_tokens=40, **GREEDY)))
                       for i in range(4)]
            await asyncio.gather(*(collect(s) for s in streams))
            await until(lambda: client.stats().memory.mlx_cache_bytes == 0, what="the buffers given back")
            assert client.health().alive
            open_stream = aiter(client.submit(Request("open", [1, 2], SamplingParams(max_tokens=2000, **GREEDY))))
            await anext(open_stream)
        finally:
            await client.close()
        assert not client.health().alive
        with pytest.raises(EngineDeadError):  # a stream still open when the engine closed ends, never hangs
            async for _ in open_stream:
                pass
        with pytest.raises(EngineDeadError):
            client.submit(Request("late", [1, 2], SamplingParams(max_tokens=5)))

    run(scenario)


def _break_thread_engine(client) -> None:
    def broken_step(before_device_work=None, on_admitted=None):
        raise RuntimeError("device lost")

    client.core.step = broken_step


def _kill_engine_process(client) -> None:
    os.kill(client.pid, signal.SIGKILL)


@pytest.mark.parametrize("kind, kill, message", [
    ("thread", _break_thread_engine, "device lost"), ("process", _kill_engine_process, "engine process"),
])
def test_a_dead_engine_fails_every_stream_instead_of_hanging(kind, kill: Callable, message, tiny_llama):
    async def scenario():
        client = await started(kind, tiny_llama)
        try:
            running = aiter(client.submit(Request("a", [1, 2], SamplingParams(max_tokens=2000, **GREEDY))))
            await anext(running)
            kill(client)
            try:  # refused at once if the death was already noticed, else failed with the others
                later = client.submit(Request("b", [3, 4], SamplingParams(max_tokens=2000, **GREEDY)))
            except EngineDeadError:
                later = None
            with pytest.raises(EngineDeadError, match=message):
                async for _ in running:
                    pass
            if later is not None:
                with pytest.raises(EngineDeadError):
                    await collect(later)
            assert not client.health().alive
            with pytest.raises(EngineDeadError):
                client.submit(Request("c", [1, 2], SamplingParams(max_tokens=5)))
        finally:
            await client.close()

    run(scenario)


@pytest.mark.parametrize("kind", CLIENTS)
def test_structured_output_compiles_off_the_engine_thread_and_streams(kind, tiny_bpe_llama, prompt):
    async def scenario():
        client = await started(kind, tiny_bpe_llama, max_decode_seqs=32)
        try:
            requests = schema_requests(prompt) + free_requests(prompt)
            return await asyncio.gather(*(collect(client.submit(r)) for r in requests))
        finally:
            await client.close()

    results = run(scenario)
    for name, (_, text, finish) in zip(SCHEMAS, results):
        assert_valid(name, text, finish.reason.value)


# ---- the process client only ------------------------------------------------------------------
def test_the_process_client_steps_in_another_process(tiny_llama):
    async def scenario():
        client = await started("process", tiny_llama)
        try:
            assert client.pid is not None and client.pid != os.getpid()
            assert client.served.in_own_process
            return client.pid
        finally:
            await client.close()

    pid = run(scenario)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_an_engine_process_that_dies_while_starting_fails_the_start(tiny_llama):
    async def scenario():
        client = ProcessEngineClient(EngineSpec(model_path=str(tiny_llama.path)))
        starting = asyncio.create_task(client.start())
        await until(lambda: client.pid is not None, what="the engine process")
        os.kill(client.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exited while starting"):
            await starting
        assert not client.health().alive and client.pid is None

    run(scenario)


LEFT_RUNNING = '''
import asyncio, sys
from engine import EngineConfig, EngineCore, Request, SamplingParams
from engine.client.thread_client import ThreadEngineClient
from engine.models.loader import load_model

async def main():
    loaded = load_model(sys.argv[1])
    client = ThreadEngineClient(lambda: EngineCore(loaded, EngineConfig()))
    await client.start()
    async for event in client.submit(Request("r", [1, 2, 3], SamplingParams(max_tokens=1000, ignore_eos=True))):
        break  # mid-generation: the request, and the engine, go on
asyncio.run(main())
print("left", flush=True)
'''


def test_a_thread_engine_left_running_at_exit_is_stopped_before_the_interpreter_ends(tiny_llama, tmp_path):
    """MLX aborts the process at exit when a thread's streams outlive it ("terminate called without an active
    exception"): an engine never closed (a hung teardown, a caller's bug) is stopped by the exit itself."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "left_running.py"
    script.write_text(LEFT_RUNNING)
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(script), str(tiny_llama.path)], capture_output=True, text=True,
                          timeout=120, cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)})
    assert done.returncode == 0 and done.stdout == "left\n", done.stderr[-2000:]
    assert "terminate called" not in done.stderr and "Traceback" not in done.stderr

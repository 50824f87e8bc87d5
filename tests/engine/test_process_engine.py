"""ProcessEngine: the engine in a child process behind AsyncEngine's interface; same streams, same errors."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from engine import EngineConfig, Request, SamplingParams
from engine.errors import ContextLengthExceededError, EngineDeadError, InvalidRequestError, ModelLoadError
from engine.process_engine import ProcessEngine
from engine.process_protocol import CoreSpec
from tests.engine.test_async_engine import GREEDY, collect
from tests.engine.test_batching import run_alone
from tests.engine.test_structured_output import assert_valid, free_requests, prompt, schema_requests  # noqa: F401 (fixture)
from tests.support.json_schemas import SCHEMAS


async def started(loaded, **config) -> ProcessEngine:
    engine = ProcessEngine(CoreSpec(model_path=str(loaded.path), engine_config=EngineConfig(**config)))
    await engine.start()
    return engine


def test_streams_from_the_engine_process_match_the_model_run_alone(tiny_llama):
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]

    async def scenario():
        engine = await started(tiny_llama)
        try:
            assert engine.pid is not None and engine.pid != os.getpid()
            streams = [
                engine.submit(Request(f"r{i}", p, SamplingParams(max_tokens=9, **GREEDY))) for i, p in enumerate(prompts)
            ]
            return await asyncio.gather(*(collect(s) for s in streams)), engine.stats()
        finally:
            await engine.shutdown()

    results, stats = asyncio.run(scenario())
    for i, (token_ids, text, finish) in enumerate(results):
        alone = run_alone(tiny_llama, "x", prompts[i], SamplingParams(max_tokens=9, **GREEDY))
        assert token_ids == alone.token_ids
        assert text == alone.text
        assert finish.reason.value == "length" and finish.usage.completion_tokens == 9
    assert stats.generation_tokens_total == 4 * 9  # the child's counters reach this process


def test_invalid_requests_are_refused_in_the_serving_process(tiny_llama):
    async def scenario():
        engine = await started(tiny_llama, context_length=64)
        try:
            with pytest.raises(InvalidRequestError, match="top_p"):
                engine.submit(Request("a", [1, 2], SamplingParams(top_p=0.0)))
            with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
                engine.submit(Request("v", [1, 256], SamplingParams(max_tokens=2)))
            with pytest.raises(ContextLengthExceededError, match="maximum context length is 64"):
                engine.submit(Request("b", list(range(60)), SamplingParams(max_tokens=10)))
            token_ids, _, finish = await collect(engine.submit(Request("c", list(range(60)), SamplingParams(**GREEDY))))
            assert len(token_ids) == 4 and finish.reason.value == "length"
            with pytest.raises(InvalidRequestError, match="Duplicate"):
                engine.submit(Request("d", [1], SamplingParams(max_tokens=50, **GREEDY)))
                engine.submit(Request("d", [1], SamplingParams(max_tokens=50, **GREEDY)))
        finally:
            await engine.shutdown()

    asyncio.run(scenario())


def test_closing_a_stream_aborts_the_request_in_the_engine_process(tiny_llama):
    async def scenario():
        engine = await started(tiny_llama)
        try:
            stream = engine.submit(Request("gone", [1, 2, 3], SamplingParams(max_tokens=2000, **GREEDY)))
            iterator = aiter(stream)
            await anext(iterator)
            await iterator.aclose()  # what a disconnected client does
            for _ in range(200):
                await asyncio.sleep(0.02)
                stats = engine.stats()
                if stats.num_steps >= 1 and stats.num_running == 0 and stats.kv_cache_bytes == 0:
                    break
            # Stats from after a step: the start-up ones (no step yet) read idle too.
            assert stats.num_steps >= 1 and stats.num_running == 0 and stats.kv_cache_bytes == 0
            assert stats.generation_tokens_total < 2000
        finally:
            await engine.shutdown()

    asyncio.run(scenario())


def test_a_killed_engine_process_fails_every_stream_instead_of_hanging(tiny_llama):
    async def scenario():
        engine = await started(tiny_llama)
        try:
            stream = engine.submit(Request("a", [1, 2], SamplingParams(max_tokens=2000, **GREEDY)))
            iterator = aiter(stream)
            await anext(iterator)
            os.kill(engine.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="engine process"):
                async for _ in iterator:
                    pass
            assert not engine.is_alive
            with pytest.raises(EngineDeadError):
                engine.submit(Request("b", [1, 2], SamplingParams(max_tokens=5)))
        finally:
            await engine.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


def test_a_model_that_fails_to_build_raises_from_start(tmp_path):
    async def scenario():
        engine = ProcessEngine(CoreSpec(model_path=str(tmp_path / "nothing-here")))
        with pytest.raises(ModelLoadError, match="config.json not found"):
            await engine.start()
        assert not engine.is_alive

    asyncio.run(scenario())


def test_shutdown_ends_the_engine_process_and_its_buffers_go_back_when_idle(tiny_llama):
    async def scenario():
        engine = await started(tiny_llama)
        pid = engine.pid
        try:
            streams = [engine.submit(Request(f"c{i}", [1 + i, 2, 3] * 20, SamplingParams(max_tokens=40, **GREEDY)))
                       for i in range(4)]
            await asyncio.gather(*(collect(s) for s in streams))
            deadline = time.monotonic() + 10
            while engine.stats().memory.mlx_cache_bytes and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert engine.stats().memory.mlx_cache_bytes == 0
        finally:
            await engine.shutdown()
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)

    asyncio.run(scenario())


def test_structured_output_compiles_and_streams_in_the_engine_process(tiny_bpe_llama, prompt):
    async def scenario():
        spec = CoreSpec(model_path=str(tiny_bpe_llama.path), engine_config=EngineConfig(max_decode_seqs=32))
        engine = ProcessEngine(spec)
        await engine.start()
        try:
            requests = schema_requests(prompt) + free_requests(prompt)
            return await asyncio.gather(*(collect_text(engine.submit(r)) for r in requests))
        finally:
            await engine.shutdown()

    results = asyncio.run(scenario())
    for name, (text, finish) in zip(SCHEMAS, results):
        assert_valid(name, text, finish.reason.value)


async def collect_text(stream):
    _, text, finish = await collect(stream)
    return text, finish


def test_an_engine_process_that_dies_while_starting_fails_the_start(tiny_llama):
    async def scenario():
        engine = ProcessEngine(CoreSpec(model_path=str(tiny_llama.path)))
        starting = asyncio.create_task(engine.start())
        while engine.pid is None:
            await asyncio.sleep(0.001)
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exited while starting"):
            await starting
        assert not engine.is_alive and engine.pid is None

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))

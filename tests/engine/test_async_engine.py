"""AsyncEngine: one MLX thread behind an asyncio API; typed errors, abort, death never hang a client."""

from __future__ import annotations

import asyncio

import pytest

from engine import AsyncEngine, EngineConfig, EngineCore, Request, SamplingParams
from engine.errors import ContextLengthExceededError, EngineDeadError, InvalidRequestError, QueueFullError
from engine.output.events import Finish, TextDelta
from tests.engine.test_batching import run_alone

GREEDY = dict(temperature=0.0, ignore_eos=True)


async def collect(stream) -> tuple[list[int], str, Finish]:
    token_ids, text, finish = [], "", None
    async for event in stream:
        if isinstance(event, TextDelta):
            token_ids += event.token_ids
            text += event.text
        else:
            finish = event
    return token_ids, text, finish


async def started(loaded, **config) -> AsyncEngine:
    engine = AsyncEngine(lambda: EngineCore(loaded, EngineConfig(**config)))
    await engine.start()
    return engine


def test_concurrent_streams_match_the_synchronous_core(tiny_llama):
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]

    async def scenario():
        engine = await started(tiny_llama)
        try:
            streams = [
                engine.submit(Request(f"r{i}", p, SamplingParams(max_tokens=9, **GREEDY))) for i, p in enumerate(prompts)
            ]
            return await asyncio.gather(*(collect(s) for s in streams))
        finally:
            await engine.shutdown()

    results = asyncio.run(scenario())
    for i, (token_ids, text, finish) in enumerate(results):
        alone = run_alone(tiny_llama, "x", prompts[i], SamplingParams(max_tokens=9, **GREEDY))
        assert token_ids == alone.token_ids
        assert text == alone.text
        assert finish.reason.value == "length" and finish.usage.completion_tokens == 9


def test_invalid_and_oversized_requests_fail_at_submit(tiny_llama):
    async def scenario():
        engine = await started(tiny_llama, context_length=64)
        try:
            with pytest.raises(InvalidRequestError, match="top_p"):
                engine.submit(Request("a", [1, 2], SamplingParams(top_p=0.0)))
            with pytest.raises(ContextLengthExceededError, match="maximum context length is 64"):
                engine.submit(Request("b", list(range(60)), SamplingParams(max_tokens=10)))
            # Without max_tokens, the request may fill the context.
            token_ids, _, finish = await collect(engine.submit(Request("c", list(range(60)), SamplingParams(**GREEDY))))
            assert len(token_ids) == 4 and finish.reason.value == "length"
        finally:
            await engine.shutdown()

    asyncio.run(scenario())


def test_queue_full_is_reported_to_the_refused_request_only(tiny_llama):
    async def scenario():
        engine = await started(tiny_llama, max_num_seqs=2)
        try:
            streams = [engine.submit(Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=20, **GREEDY))) for i in range(3)]
            results = await asyncio.gather(*(collect(s) for s in streams), return_exceptions=True)
        finally:
            await engine.shutdown()
        assert isinstance(results[2], QueueFullError)
        assert [len(r[0]) for r in results[:2]] == [20, 20]

    asyncio.run(scenario())


def test_queue_timeout_expires_a_request_that_never_started(tiny_llama):
    from engine.errors import QueueTimeoutError

    async def scenario():
        engine = await started(tiny_llama, max_decode_seqs=1, queue_timeout=0.05)
        try:
            first = engine.submit(Request("first", [1, 2], SamplingParams(max_tokens=400, **GREEDY)))
            await asyncio.sleep(0.01)
            second = engine.submit(Request("second", [3, 4], SamplingParams(max_tokens=5, **GREEDY)))
            with pytest.raises(QueueTimeoutError, match="queue_timeout"):
                await collect(second)
            token_ids, _, _ = await collect(first)
            assert len(token_ids) == 400
        finally:
            await engine.shutdown()

    asyncio.run(scenario())


def test_closing_a_stream_aborts_the_request_and_frees_its_kv(tiny_llama):
    async def scenario():
        engine = await started(tiny_llama)
        try:
            stream = engine.submit(Request("gone", [1, 2, 3], SamplingParams(max_tokens=1000, **GREEDY)))
            iterator = aiter(stream)
            await anext(iterator)
            assert engine.core.scheduler.num_running == 1
            await iterator.aclose()  # what a disconnected client does
            for _ in range(100):
                await asyncio.sleep(0.02)
                stats = engine.stats()
                if stats.num_steps >= 1 and stats.num_running == 0 and stats.kv_cache_bytes == 0:
                    break
            # Stats from after a step: the start-up ones (no step yet) read idle too.
            assert stats.num_steps >= 1 and stats.num_running == 0 and stats.kv_cache_bytes == 0
        finally:
            await engine.shutdown()

    asyncio.run(scenario())


def test_a_dead_engine_thread_fails_every_stream_instead_of_hanging(tiny_llama):
    async def scenario():
        engine = await started(tiny_llama)
        try:
            def broken_step(before_device_work=None):
                raise RuntimeError("device lost")

            engine.core.step = broken_step
            stream = engine.submit(Request("a", [1, 2], SamplingParams(max_tokens=5, **GREEDY)))
            with pytest.raises(EngineDeadError, match="device lost"):
                await asyncio.wait_for(collect(stream), timeout=10)
            with pytest.raises(EngineDeadError):
                engine.submit(Request("b", [1, 2], SamplingParams(max_tokens=5)))
        finally:
            await engine.shutdown()

    asyncio.run(scenario())


def test_a_model_that_fails_to_build_raises_from_start():
    async def scenario():
        def build():
            raise InvalidRequestError("no such model")

        engine = AsyncEngine(build)
        with pytest.raises(InvalidRequestError, match="no such model"):
            await engine.start()

    asyncio.run(scenario())


def test_every_step_calls_before_device_work_once(tiny_llama):
    # AsyncEngine posts the previous step's outputs from this hook: a step that skipped it would hold
    # them back a step, one that called it twice would post nothing the second time (harmless but wrong).
    core = EngineCore(tiny_llama, EngineConfig(max_prefill_seqs=1, prefill_chunk_tokens=4))
    core.add_request(Request("a", list(range(1, 11)), SamplingParams(max_tokens=3, **GREEDY)))
    core.add_request(Request("b", [1, 2], SamplingParams(max_tokens=3, **GREEDY)))
    calls_per_step, rows_at_call = [], []
    while core.has_unfinished_requests():
        calls = []
        core.step(before_device_work=lambda: (calls.append(1), rows_at_call.append(len(core.runner.batch))))
        calls_per_step.append(len(calls))
    assert len(calls_per_step) >= 5 and calls_per_step == [1] * len(calls_per_step)
    assert max(rows_at_call) == 2  # called once the decode batch for the step is assembled


def test_buffer_cache_goes_back_to_the_device_once_the_engine_idles(tiny_llama):
    """Not every N steps under load (freeing waits for the device holding the GIL): after idling a while."""
    import time

    import mlx.core as mx

    from engine.engine_loop import RELEASE_BUFFERS_AFTER_IDLE_S

    async def scenario() -> tuple[int, int]:
        engine = await started(tiny_llama)
        try:
            streams = [engine.submit(Request(f"c{i}", [1 + i, 2, 3] * 20, SamplingParams(max_tokens=40, **GREEDY)))
                       for i in range(4)]
            await asyncio.gather(*(collect(s) for s in streams))
            cached_after_work = mx.get_cache_memory()
            deadline = time.monotonic() + RELEASE_BUFFERS_AFTER_IDLE_S + 5.0
            while mx.get_cache_memory() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return cached_after_work, mx.get_cache_memory()
        finally:
            await engine.shutdown()

    cached_after_work, cached_after_idle = asyncio.run(scenario())
    assert cached_after_work > 0  # freed buffers are kept for reuse while requests come and go
    assert cached_after_idle == 0


def test_first_tokens_are_posted_before_the_next_step_copies_their_prompts(tiny_llama):
    """EngineLoop holds a step's outputs until the next step's forward is built, except a step's that
    completed prompts: their first tokens must not wait for the next step's prefix-cache copies."""
    import queue
    import threading

    from engine.engine_loop import AddCommand, EngineLoop, ShutdownCommand

    prompt = list(range(1, 41))  # five blocks of 8
    commands: queue.SimpleQueue = queue.SimpleQueue()
    posts: list[tuple[dict[str, list[int]], int]] = []  # (tokens per request, prefix-cache blocks then)
    done = threading.Event()
    built: list[EngineCore] = []

    def post(outputs) -> None:
        posts.append(({o.request_id: o.new_token_ids for o in outputs}, built[0].runner.prefix_cache.stats.num_blocks))
        if any(o.finished for o in outputs):
            done.set()

    def engine_thread() -> None:  # MLX streams belong to the thread that made them
        built.append(EngineCore(tiny_llama, EngineConfig(prefix_block_size=8)))
        EngineLoop(built[0], commands, post, lambda stats: None).run()

    loop = threading.Thread(target=engine_thread, daemon=True)  # a hung loop must not hang pytest's exit
    loop.start()
    commands.put(AddCommand(Request("a", prompt, SamplingParams(max_tokens=4, **GREEDY))))
    assert done.wait(60)
    commands.put(ShutdownCommand())
    loop.join(60)

    first_post_tokens, blocks_when_posted = next(p for p in posts if p[0].get("a"))
    assert len(first_post_tokens["a"]) == 1 and blocks_when_posted == 0
    assert built[0].runner.prefix_cache.stats.num_blocks == 5  # the copies still happen, a step later
    tokens = [t for tokens, _ in posts for t in tokens.get("a", [])]
    assert tokens == run_alone(tiny_llama, "a", prompt, SamplingParams(max_tokens=4, **GREEDY)).token_ids

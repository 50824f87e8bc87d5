"""ModelService's intake: prompts are tokenized in worker threads, side by side, and each stays its own."""

from __future__ import annotations

import asyncio
import threading

import pytest

from deployments.config import ModelConfig
from deployments.model.service import ModelService, process_engine_client, thread_engine_client
from deployments.chat.prompts import PromptEncoder
from deployments.model_calls import ChatPrompt, GenerateJob, TextPrompt
from engine.errors import EngineDeadError
from engine.sampling.params import SamplingParams
from tests.serve.local_stack import wait_for

HANG_S = 300.0  # bounds a wait for an event (stats posted, an engine restarted): only a hang reaches it


def _prompt(index: int) -> ChatPrompt:
    words = " ".join(f"t{(index * 7 + j) % 240}" for j in range(5 + 37 * index))  # 5 .. 856 words
    return ChatPrompt(messages=[{"role": "user", "content": words}])


def _job(index: int) -> GenerateJob:
    sampling = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    return GenerateJob(f"intake-{index}", _prompt(index), sampling, stream=True)


async def _prompt_tokens(service: ModelService, job: GenerateJob) -> int:
    told = None
    async for chunk in service.generate(job):
        assert chunk.error is None, chunk.error
        told = chunk.prompt_tokens if told is None else told
    return told


@pytest.mark.parametrize("new_engine_client", [process_engine_client, thread_engine_client], ids=["process", "thread"])
def test_concurrent_requests_are_tokenized_each_as_alone_and_off_the_event_loop(tiny_models, new_engine_client):
    service = ModelService(ModelConfig(model_path=str(tiny_models.alpha)), new_engine_client)
    count = 24

    async def run() -> None:
        await service.start()
        try:
            tokenizer = service._engine.served.tokenizer
            alone = [len(PromptEncoder(tokenizer).encode(_prompt(i)).token_ids) for i in range(count)]
            assert len(set(alone)) == count  # every prompt has its own length: a mix-up would show
            counted = await asyncio.gather(*(service.count_tokens(_prompt(i)) for i in range(count)))
            assert [c.input_tokens for c in counted] == alone
            told = await asyncio.gather(*(_prompt_tokens(service, _job(i)) for i in range(count)))
            assert told == alone

            loop_thread = threading.get_ident()
            encode = PromptEncoder.encode
            threads: list[int] = []

            def recording_encode(encoder: PromptEncoder, prompt: ChatPrompt | TextPrompt):
                threads.append(threading.get_ident())
                return encode(encoder, prompt)

            service._prompts.encode = recording_encode.__get__(service._prompts)
            await service.count_tokens(_prompt(3))
            assert threads and loop_thread not in threads
        finally:
            await service.shutdown()

    asyncio.run(run())


def test_a_request_after_shutdown_gets_a_typed_error_chunk(tiny_models):
    service = ModelService(ModelConfig(model_path=str(tiny_models.alpha)))

    async def run() -> list:
        await service.start()
        await service.shutdown()
        return [chunk async for chunk in service.generate(_job(1))]

    chunks = asyncio.run(run())
    assert len(chunks) == 1 and chunks[0].error is not None
    assert chunks[0].error.code == EngineDeadError("x").code


def test_stats_and_info_come_from_the_engine_process_and_a_killed_engine_is_restarted(tiny_models):
    import os
    import signal
    import time

    service = ModelService(ModelConfig(model_path=str(tiny_models.alpha)))

    async def run() -> tuple:
        await service.start()
        try:
            told = await _prompt_tokens(service, _job(2))
            # The engine posts its stats after its last step, which may come just after the outputs.
            await wait_for(lambda: _generated(service, 2), HANG_S, 0.01)
            stats, info = service.queue_stats(), service.info()
            serving_cpu = time.process_time()
            engine_pid = service.engine_pid
            killed_engine = service._engine._client
            os.kill(engine_pid, signal.SIGKILL)
            # The event: the engine client's reader sees the socket close; the model's health says so at once.
            await asyncio.wait_for(killed_engine.wait_dead(), HANG_S)
            during = service.info()
            refused = [chunk async for chunk in service.generate(_job(3))]
            await wait_for(lambda: _alive(service), HANG_S)
            told_after = await _prompt_tokens(service, _job(3))
            return told, stats, info, engine_pid, serving_cpu, during, refused, service.info(), told_after
        finally:
            await service.shutdown()

    told, stats, info, engine_pid, serving_cpu, during, refused, after, told_after = asyncio.run(run())
    assert told > 0 and stats.generation_tokens_total == 2  # counted in the engine process
    assert engine_pid != os.getpid() and info.pid == os.getpid()
    assert info.memory.mlx_active_mb > 0  # the model's weights, held by the engine process
    assert stats.process_cpu_seconds_total - serving_cpu > 0.1  # the engine process's load and steps count too
    assert during.health.status.value == "restarting" and "engine process" in during.health.message
    assert len(refused) == 1 and refused[0].error.code == "engine_restarting"
    assert after.health.status.value == "running" and after.engine_restarts == 1 and told_after > 0


async def _generated(service: ModelService, tokens: int) -> bool:
    return service.queue_stats().generation_tokens_total == tokens


async def _alive(service: ModelService) -> bool:
    return service.info().health.alive

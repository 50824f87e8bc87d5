"""EmbedCalls: which jobs ride which handle call. The send here is a plain coroutine that records its calls and
answers when the test lets it (the handle's part is covered through Ray by tests/graph/test_embeddings_graph.py)."""

from __future__ import annotations

import asyncio

import pytest

from deployments.model_calls import EmbedJob, EmbedResult
from deployments.transport.embed_calls import EmbedCalls
from engine.errors import EngineDeadError


class GatedSend:
    """Records each call's inputs; a call returns once released, each job's result naming its first input."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.release = asyncio.Event()
        self.fail_with: BaseException | None = None

    async def __call__(self, jobs: list[EmbedJob]) -> list[EmbedResult]:
        self.calls.append([job.inputs[0] for job in jobs])
        await self.release.wait()
        if self.fail_with is not None:
            raise self.fail_with
        return [EmbedResult(vectors=[job.inputs[0].encode()], dimension=1) for job in jobs]


async def settle() -> None:
    """Let every ready task run to its next wait (a request's task, then its call's)."""
    for _ in range(5):
        await asyncio.sleep(0)


def job(text: str) -> EmbedJob:
    return EmbedJob([text])


def test_a_lone_request_goes_at_once_and_a_burst_rides_few_calls():
    async def scenario():
        send = GatedSend()
        calls = EmbedCalls(send, max_in_flight=2, max_jobs=4)
        lone = asyncio.create_task(calls.embed(job("lone")))
        await settle()
        assert send.calls == [["lone"]]  # no wait for company
        burst = [asyncio.create_task(calls.embed(job(f"r{i}"))) for i in range(9)]
        await settle()
        assert send.calls == [["lone"], ["r0"]]  # two calls out; the rest wait for a free one
        send.release.set()
        results = await asyncio.gather(lone, *burst)
        return send.calls, results

    sent, results = asyncio.run(scenario())
    assert sent == [["lone"], ["r0"], ["r1", "r2", "r3", "r4"], ["r5", "r6", "r7", "r8"]]
    assert len(sent) == 4  # four handle calls for ten requests
    assert [r.vectors[0].decode() for r in results] == ["lone", *(f"r{i}" for i in range(9))]


def test_a_failed_call_fails_only_its_own_requests():
    async def scenario():
        send = GatedSend()
        calls = EmbedCalls(send, max_in_flight=1)
        first = asyncio.create_task(calls.embed(job("a")))
        await settle()
        second = asyncio.create_task(calls.embed(job("b")))
        await settle()
        send.fail_with = EngineDeadError("gone")
        send.release.set()
        with pytest.raises(EngineDeadError):
            await first
        send.fail_with = None
        return await second, send.calls

    second, sent = asyncio.run(scenario())
    assert second.vectors == [b"b"] and sent == [["a"], ["b"]]


def test_a_request_cancelled_while_waiting_is_not_sent():
    async def scenario():
        send = GatedSend()
        calls = EmbedCalls(send, max_in_flight=1)
        first = asyncio.create_task(calls.embed(job("a")))
        await settle()
        gone = asyncio.create_task(calls.embed(job("gone")))
        kept = asyncio.create_task(calls.embed(job("kept")))
        await settle()
        gone.cancel()
        send.release.set()
        await asyncio.gather(first, kept)
        return send.calls

    assert asyncio.run(scenario()) == [["a"], ["kept"]]

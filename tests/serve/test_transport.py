"""The transport between the ingress and a model: which path a stream takes, and how failures are reported.

ServeModelClient runs against a real ChannelServer (a Unix socket in a private directory) and a stand-in for
Ray's DeploymentHandle: the few handle calls it makes, over plain coroutines. The real graph (tests in
test_serve_graph.py) streams one model over the channel and another over Ray's handle.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import pytest
from ray.exceptions import RayActorError, RayError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from deployments.model_calls import ChatPrompt, GenerateJob, StreamChunk
from deployments.transport.channel import ChannelAddress, ChannelServer
from deployments.transport.errors import model_call_failure
from deployments.transport.model_client import CHANNEL_RETRY_S, ServeModelClient
from engine.errors import EngineDeadError, ModelNotFoundError, QueueFullError
from engine.output.request_output import Finish, Usage
from engine.request import FinishReason
from engine.sampling.params import SamplingParams

NODE = "node-here"
FINISH = Finish(FinishReason.STOP, Usage(2, 1))


def _job(request_id: str = "r1") -> GenerateJob:
    return GenerateJob(request_id, ChatPrompt(messages=[{"role": "user", "content": "hi"}]), SamplingParams(), True)


async def _generated_by(source: str, job: GenerateJob) -> AsyncIterator[StreamChunk]:
    yield StreamChunk(text=f"{source}:{job.request_id}", num_tokens=1)
    yield StreamChunk(finish=FINISH)


class _Remote:
    def __init__(self, call) -> None:
        self.remote = call


class _HandleResponse:
    """A handle stream: async iterable of chunks, cancellable."""

    def __init__(self, chunks: AsyncIterator[StreamChunk], error: BaseException | None) -> None:
        self._chunks, self._error, self.cancelled = chunks, error, False

    async def _iterate(self) -> AsyncIterator[StreamChunk]:
        async for chunk in self._chunks:
            yield chunk
            if self._error is not None:
                raise self._error

    def __aiter__(self):
        return self._iterate()

    def cancel(self) -> None:
        self.cancelled = True


class StandInHandle:
    """The calls ServeModelClient makes on a Serve DeploymentHandle: options(stream=True), channel_address,
    generate, count_tokens."""

    def __init__(self, address=None, address_error: BaseException | None = None,
                 stream_error: BaseException | None = None) -> None:
        self.address, self.address_error, self.stream_error = address, address_error, stream_error
        self.address_calls = 0
        self.handle_streams = 0

    def options(self, stream: bool = False) -> "StandInHandle":
        return self

    @property
    def channel_address(self) -> _Remote:
        async def call():
            self.address_calls += 1
            if self.address_error is not None:
                raise self.address_error
            return self.address

        return _Remote(call)

    @property
    def generate(self) -> _Remote:
        def call(job: GenerateJob) -> _HandleResponse:
            self.handle_streams += 1
            return _HandleResponse(_generated_by("handle", job), self.stream_error)

        return _Remote(call)

    @property
    def count_tokens(self) -> _Remote:
        async def call(prompt):
            raise RayActorError()

        return _Remote(call)


async def _texts(client: ServeModelClient, request_id: str) -> str:
    """The stream's text, then '|' and how it ended (a finish reason or the error's message)."""
    total = StreamChunk()
    async for chunk in client.generate(_job(request_id)):
        total.merge(chunk)
    end = total.error.message if total.error is not None else total.finish.reason.value
    return f"{total.text}|{end}"


def _run(scenario):
    return asyncio.run(asyncio.wait_for(scenario(), 30))


# ---- which path -------------------------------------------------------------------------------
def test_a_replica_on_this_node_streams_over_its_channel():
    async def scenario():
        server = ChannelServer(lambda job: _generated_by("channel", job), NODE)
        address = await server.start()
        try:
            handle = StandInHandle(address)
            client = ServeModelClient("m", handle, node_id=lambda: NODE)
            first, second = await _texts(client, "a"), await _texts(client, "b")
            return first, second, handle, server.streams_served
        finally:
            await server.close(drain_s=0.0)

    first, second, handle, served = _run(scenario)
    assert (first, second) == ("channel:a|stop", "channel:b|stop")
    assert handle.handle_streams == 0 and handle.address_calls == 1 and served == 2  # one connection, reused


@pytest.mark.parametrize("why, handle", [
    ("no channel", StandInHandle(None)),
    ("another node", StandInHandle(ChannelAddress("node-elsewhere", "/nonexistent/stream.sock", "t"))),
    ("unreachable socket", StandInHandle(ChannelAddress(NODE, "/nonexistent/stream.sock", "t"))),
    ("address call failed", StandInHandle(address_error=RayError())),
])
def test_streams_fall_back_to_the_handle_and_the_channel_is_asked_again_later(why, handle):
    async def scenario():
        client = ServeModelClient("m", handle, node_id=lambda: NODE)
        texts = [await _texts(client, "a"), await _texts(client, "b")]
        calls_before_retry = handle.address_calls
        client._no_channel_until -= CHANNEL_RETRY_S  # as if the retry interval had passed
        texts.append(await _texts(client, "c"))
        return texts, calls_before_retry

    texts, calls_before_retry = _run(scenario)
    assert texts == ["handle:a|stop", "handle:b|stop", "handle:c|stop"], why
    assert calls_before_retry == 1 and handle.address_calls == 2 and handle.handle_streams == 3


def test_a_channel_that_drops_ends_its_streams_and_the_next_stream_reconnects():
    async def scenario():
        hold = asyncio.Event()

        async def slow(job: GenerateJob) -> AsyncIterator[StreamChunk]:
            yield StreamChunk(text="first", num_tokens=1)
            await hold.wait()
            yield StreamChunk(finish=FINISH)

        server = ChannelServer(slow, NODE)
        address = await server.start()
        handle = StandInHandle(address)
        client = ServeModelClient("m", handle, node_id=lambda: NODE)
        chunks = []
        async for chunk in client.generate(_job("a")):
            chunks.append(chunk)
            if len(chunks) == 1:
                await server.close(drain_s=0.0)  # the replica goes away mid-stream
        handle.address = None  # the replica that comes back has no channel: the handle serves
        after = await _texts(client, "b")
        return chunks, after, handle.address_calls

    chunks, after, address_calls = _run(scenario)
    assert chunks[0].text == "first" and isinstance(chunks[-1].error, EngineDeadError)
    assert "process of model 'm' died" in chunks[-1].error.message
    assert after == "handle:b|stop" and address_calls == 2


# ---- failures as typed errors -------------------------------------------------------------------
@pytest.mark.parametrize("exc, error_type, words", [
    (BackPressureError(num_queued_requests=9, max_queued_requests=8), QueueFullError, "too many queued"),
    (DeploymentUnavailableError(deployment_id=None), ModelNotFoundError, "not available"),
    (RayActorError(), EngineDeadError, "process of model 'm' died"),
    (RayError(), EngineDeadError, "failed: RayError"),
])
def test_ray_failures_map_to_typed_errors(exc, error_type, words):
    error = model_call_failure("m", exc)
    assert type(error) is error_type and words in error.message


def test_a_handle_stream_that_fails_ends_with_a_typed_error_chunk_and_count_tokens_too():
    async def scenario():
        client = ServeModelClient("m", StandInHandle(None, stream_error=RayActorError()), node_id=lambda: NODE)
        chunks = [chunk async for chunk in client.generate(_job("a"))]
        counted = await client.count_tokens(ChatPrompt(messages=[]))
        return chunks, counted

    chunks, counted = _run(scenario)
    assert chunks[0].text == "handle:a" and isinstance(chunks[-1].error, EngineDeadError)
    assert isinstance(counted.error, EngineDeadError) and "died" in counted.error.message

"""The stream channel (ingress <-> model replica over a Unix socket) on a real ModelService with a tiny model:
streams through it equal the service's own, many share one connection, a client that leaves aborts its request,
a dead replica ends the streams in flight, and a connection without the token gets nothing.
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat

import pytest

from deployments.config import ModelConfig
from deployments.model.service import ModelService, thread_engine_client
from deployments.model_calls import ChatPrompt, GenerateJob, StreamChunk
from deployments.transport.channel import (
    ChannelAddress,
    ChannelBatch,
    ChannelClient,
    ChannelConnection,
    ChannelServer,
    read_frame,
)
from engine.errors import EngineDeadError, ModelUnloadedError, OrchardError
from engine.output.request_output import Finish
from engine.sampling.params import SamplingParams
from tests.engine.test_batching import LOGPROB_TOLERANCE

LONG = 60000  # max_tokens of a stream the test holds open (never reached)


def _job(index: int, max_tokens: int = 12) -> GenerateJob:
    words = " ".join(f"t{(index * 11 + j) % 240}" for j in range(3 + 5 * index))
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)
    return GenerateJob(f"channel-{index}-{max_tokens}", ChatPrompt(messages=[{"role": "user", "content": words}]),
                       sampling, stream=True)


def _joined(chunks: list[StreamChunk]) -> StreamChunk:
    total = StreamChunk()
    for chunk in chunks:
        total.merge(chunk)
    return total


async def _collect(stream) -> list[StreamChunk]:
    return [chunk async for chunk in stream]


async def _running(service: ModelService) -> int:
    return service.queue_stats().running


async def _until_running(service: ModelService, count: int) -> int:
    """The engine's running count once it reads `count`, or after 10 s (its stats come every 0.2 s)."""
    for _ in range(200):
        if await _running(service) == count:
            break
        await asyncio.sleep(0.05)
    return await _running(service)


@pytest.fixture
def run_with_channel(tiny_models):
    """Runs `body(service, server, address)` with a started service and its channel; everything closed after."""

    def run(body) -> None:
        async def main() -> None:
            # No prefix cache: the test sends each prompt twice and compares usage, cached tokens included.
            config = ModelConfig(model_path=str(tiny_models.alpha), enable_prefix_cache=False)
            service = ModelService(config, thread_engine_client)
            await service.start()
            server = ChannelServer(service.generate, node_id="node-a")
            address = await server.start()
            try:
                await body(service, server, address)
            finally:
                await server.close(drain_s=0.0)
                await service.shutdown()

        asyncio.run(main())

    return run


def test_streams_over_the_channel_equal_the_service_own(run_with_channel):
    async def body(service, server, address):
        alone = [_joined(await _collect(service.generate(_job(i)))) for i in range(6)]
        client = await ChannelClient.connect("alpha", address)
        over_channel = await asyncio.gather(*(_collect(client.stream(_job(i))) for i in range(6)))
        for direct, chunks in zip(alone, over_channel):
            assert chunks[-1].is_last and sum(c.is_last for c in chunks) == 1
            joined = _joined(chunks)
            assert joined.error is None and isinstance(joined.finish, Finish)
            assert joined.text == direct.text and joined.num_tokens == direct.num_tokens == 12
            # Alone against six at once: the engine's batched == alone contract (tests/engine/test_batching.py), tokens
            # exact and logprobs within its tolerance (a float32 BLAS rounds a 6-row matmul unlike a 1-row one).
            assert [lp.logprob for lp in joined.logprobs] == pytest.approx(
                [lp.logprob for lp in direct.logprobs], abs=LOGPROB_TOLERANCE)
            assert joined.prompt_tokens == direct.prompt_tokens
            assert joined.finish.usage == direct.finish.usage
        assert server.streams_served == 6
        await client.close()

    run_with_channel(body)


def test_socket_is_private_and_a_connection_without_the_token_gets_nothing(run_with_channel):
    async def body(service, server, address):
        assert stat.S_IMODE(os.stat(os.path.dirname(address.path)).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(address.path).st_mode) == 0o600
        forged = ChannelAddress(address.node_id, address.path, "0" * 32)
        client = await ChannelClient.connect("alpha", forged)
        chunks = await asyncio.wait_for(_collect(client.stream(_job(1))), timeout=30)
        assert len(chunks) == 1 and isinstance(chunks[0].error, EngineDeadError)  # the replica hung up
        assert server.streams_served == 0 and await _running(service) == 0

    run_with_channel(body)


def test_a_client_that_leaves_aborts_its_request(run_with_channel):
    async def body(service, server, address):
        client = await ChannelClient.connect("alpha", address)
        stream = client.stream(_job(2, max_tokens=LONG))
        first = await anext(stream)
        assert first.error is None and await _until_running(service, 1) == 1
        await stream.aclose()  # the HTTP client went away
        for _ in range(200):
            if await _running(service) == 0 and server.open_streams == 0:
                break
            await asyncio.sleep(0.05)
        assert await _running(service) == 0 and server.open_streams == 0
        # The connection still serves the next stream.
        chunks = await _collect(client.stream(_job(3)))
        assert _joined(chunks).num_tokens == 12
        await client.close()

    run_with_channel(body)


def test_streams_in_flight_end_with_an_error_when_the_replica_goes(run_with_channel):
    async def body(service, server, address):
        client = await ChannelClient.connect("alpha", address)
        streams = [client.stream(_job(i, max_tokens=LONG)) for i in range(3)]
        for stream in streams:
            assert (await anext(stream)).error is None
        await server.close(drain_s=0.0)  # as an unload past its drain time, or a replica that died
        assert not os.path.exists(os.path.dirname(address.path))  # its socket and private directory are gone
        for stream in streams:
            last = None
            async for last in stream:
                pass
            assert isinstance(last.error, EngineDeadError) and "alpha" in last.error.message
        assert client.closed
        late = await _collect(client.stream(_job(4)))
        assert len(late) == 1 and isinstance(late[0].error, EngineDeadError)
        assert await _until_running(service, 0) == 0  # the replica aborted what it was generating

    run_with_channel(body)


def test_unloading_drains_open_streams_and_refuses_new_ones(run_with_channel):
    async def body(service, server, address):
        client = await ChannelClient.connect("alpha", address)
        running = asyncio.create_task(_collect(client.stream(_job(5, max_tokens=200))))
        while server.open_streams == 0:
            await asyncio.sleep(0.01)
        closing = asyncio.create_task(server.close(drain_s=60.0))
        await asyncio.sleep(0)  # one turn: the close stops accepting before its first await
        refused = await _collect(client.stream(_job(6)))
        assert len(refused) == 1 and isinstance(refused[0].error, ModelUnloadedError)
        chunks = await running  # the open stream finished, not cut
        assert _joined(chunks).num_tokens == 200 and _joined(chunks).error is None
        await asyncio.wait_for(closing, timeout=30)

    run_with_channel(body)


def test_errors_cross_the_channel_as_typed_errors(run_with_channel):
    async def body(service, server, address):
        client = await ChannelClient.connect("alpha", address)
        too_long = GenerateJob("too-long", ChatPrompt(messages=[{"role": "user", "content": "t1"}]),
                               SamplingParams(max_tokens=10**7, temperature=0.0), stream=True)
        chunks = await _collect(client.stream(too_long))
        assert len(chunks) == 1 and isinstance(chunks[0].error, OrchardError)
        direct = await _collect(service.generate(too_long))
        assert type(chunks[0].error) is type(direct[0].error)
        assert chunks[0].error.message == direct[0].error.message and chunks[0].error.param == direct[0].error.param
        await client.close()

    run_with_channel(body)


def test_frames_are_read_whole_or_not_at_all():
    async def main() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data((5).to_bytes(4, "big") + b"\x80\x05")
        reader.feed_eof()
        with pytest.raises(asyncio.IncompleteReadError):
            await read_frame(reader)
        oversized = asyncio.StreamReader()
        oversized.feed_data((2**31).to_bytes(4, "big"))
        with pytest.raises(ConnectionError):
            await read_frame(oversized)

    asyncio.run(main())


def test_chunks_pushed_before_a_hang_up_still_go_out():
    """A stream's last chunk pushed in the same turn as an unload's hang-up is written, not dropped."""

    async def main() -> None:
        ours, theirs = socket.socketpair()
        reader, their_writer = await asyncio.open_connection(sock=theirs)  # kept: a dropped writer closes its socket
        _, writer = await asyncio.open_connection(sock=ours)
        connection = ChannelConnection(writer)
        connection.push(7, StreamChunk(text="t1", num_tokens=1, error=EngineDeadError("gone")))
        connection.hang_up()  # before any writer task ran
        batch = await asyncio.wait_for(read_frame(reader), timeout=5)
        assert isinstance(batch, ChannelBatch) and list(batch.chunks) == [7]
        assert batch.chunks[7].text == "t1" and batch.chunks[7].error.message == "gone"
        their_writer.close()

    asyncio.run(main())

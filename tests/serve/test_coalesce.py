"""Time-coalescing of a request's chunks on the model replica (plain asyncio, no model).

Every assert is on order and counts, not on elapsed time, so a loaded machine cannot fail them: producers
wait for the consumer where an order matters, and windows are long where a merge must happen inside one.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import pytest

from deployments.model_calls import StreamChunk
from deployments.transport import chunks as coalescing
from deployments.transport.chunks import coalesce
from engine.client.interface import StreamRouter
from engine.output.request_output import Admitted, Finish, Queued, RequestOutput, TextDelta, Usage
from engine.request import FinishReason

FINISH = Finish(FinishReason.LENGTH, Usage(3, 40))
LONG_WINDOW_S = 60.0  # a merge is asserted inside one window: far longer than any test takes


@dataclass
class Source:
    """Yields `count` one-token chunks then a finish; records whether it was closed early."""

    count: int
    closed_early: bool = False
    sent: list[str] = field(default_factory=list)
    # Set by the test once it has the first chunk: the source waits for it before the second.
    first_received: asyncio.Event | None = None

    async def chunks(self):
        try:
            for i in range(self.count):
                if i == 1 and self.first_received is not None:
                    await self.first_received.wait()
                self.sent.append(f"w{i} ")
                yield StreamChunk(text=f"w{i} ", num_tokens=1)
            yield StreamChunk(finish=FINISH)
        except (GeneratorExit, asyncio.CancelledError):
            self.closed_early = True
            raise


def test_first_chunk_at_once_then_the_rest_merged_within_a_window():
    async def scenario():
        source = Source(count=40, first_received=asyncio.Event())
        out = []
        async for chunk in coalesce(source.chunks(), lambda: LONG_WINDOW_S):
            out.append(chunk)
            source.first_received.set()
            if chunk.finish is not None:  # the last chunk ends the window early: no wait for it
                break
        return source, out

    source, out = asyncio.run(asyncio.wait_for(scenario(), LONG_WINDOW_S / 2))
    # The first chunk reached the reader while the source still waited: it was not held for a window.
    assert [c.text for c in out] == ["w0 ", "".join(source.sent[1:])]
    assert [c.num_tokens for c in out] == [1, 39]
    assert out[-1].finish is FINISH and out[0].finish is None


def test_no_window_means_one_chunk_at_the_end():
    async def collect():
        return [chunk async for chunk in coalesce(Source(count=10).chunks(), lambda: None)]

    out = asyncio.run(collect())
    assert len(out) == 1 and out[0].num_tokens == 10 and out[0].finish is FINISH


def test_closing_early_closes_the_source():
    async def scenario():
        source = Source(count=1000, first_received=asyncio.Event())  # never set: the source waits after one
        stream = coalesce(source.chunks(), lambda: 0.02)
        await anext(stream)
        await stream.aclose()
        await asyncio.sleep(0)
        return source

    source = asyncio.run(scenario())
    assert source.closed_early and source.sent == ["w0 "]


def test_a_failing_source_raises_to_the_reader():
    async def broken():
        yield StreamChunk(text="a", num_tokens=1)
        raise RuntimeError("engine exploded")

    async def scenario():
        async with contextlib.aclosing(coalesce(broken(), lambda: 0.01)) as stream:
            return [chunk async for chunk in stream]

    with pytest.raises(RuntimeError, match="engine exploded"):
        asyncio.run(scenario())


async def _engine_stream_scenario(window_s: float | None, deltas: int = 60):
    """An engine-like producer delivers one-token outputs a loop turn apart to a request's stream, which the
    source reads as the model service does; returns the chunks and every item the source read."""
    router = StreamRouter()
    stream = router.open("r", abort=lambda request_id: None)
    reads = []
    first_out = asyncio.Event()

    async def source():
        async for item in stream:
            reads.append(item)
            if isinstance(item, TextDelta):
                yield StreamChunk(text=item.text, num_tokens=len(item.token_ids))
            else:
                yield StreamChunk(finish=item)

    async def produce() -> None:
        router.deliver([RequestOutput("r", delta=TextDelta("w0 ", [0]))])
        if window_s is not None:
            await first_out.wait()
        for i in range(1, deltas):
            await asyncio.sleep(0)
            router.deliver([RequestOutput("r", delta=TextDelta(f"w{i} ", [i]))])
        router.deliver([RequestOutput("r", finish=FINISH)])

    producer = asyncio.create_task(produce())
    out = []
    async for chunk in coalesce(source(), lambda: window_s, hold=stream.hold):
        out.append(chunk)
        first_out.set()
    await producer
    return out, reads


def test_with_a_hold_the_source_is_read_once_per_window_and_the_finish_is_not_held_back():
    # Bounded far below the window: a finish held back until the window's end would time out.
    out, reads = asyncio.run(asyncio.wait_for(_engine_stream_scenario(LONG_WINDOW_S), LONG_WINDOW_S / 2))
    assert [c.text for c in out] == ["w0 ", "".join(f"w{i} " for i in range(1, 60))]
    assert out[-1].finish is FINISH and out[0].finish is None
    # The first delta, the other 59 merged while the source was held, the finish: not one read per delta.
    assert [len(r.token_ids) if isinstance(r, TextDelta) else "finish" for r in reads] == [1, 59, "finish"]


def test_with_a_hold_and_no_window_the_source_is_read_at_the_start_and_the_end():
    out, reads = asyncio.run(_engine_stream_scenario(None))
    assert len(out) == 1 and out[0].num_tokens == 60 and out[0].finish is FINISH
    assert len(reads) <= 3  # the first delta(s), the rest merged, the finish


def test_the_admission_and_the_first_output_after_it_both_go_at_once():
    """A stream's admission (no output yet) is sent at once and starts no window: neither the source's hold nor
    the reader's wait runs after it, so the first output still goes at once (time to first token)."""

    async def scenario():
        router = StreamRouter()
        stream = router.open("r", abort=lambda request_id: None)
        out: list[StreamChunk] = []
        received = asyncio.Condition()

        async def source():
            async for item in stream:
                if isinstance(item, Admitted):
                    yield StreamChunk(admitted=True, prompt_tokens=item.prompt_tokens, cached_tokens=item.cached_tokens)
                elif isinstance(item, TextDelta):
                    yield StreamChunk(text=item.text, num_tokens=len(item.token_ids))
                else:
                    yield StreamChunk(finish=item)

        async def until_received(count: int) -> None:
            async with received:
                await received.wait_for(lambda: len(out) >= count)

        async def produce() -> None:
            router.deliver([RequestOutput("r", admitted=Admitted(prompt_tokens=40, cached_tokens=32))])
            await until_received(1)
            router.deliver([RequestOutput("r", delta=TextDelta("w0 ", [0]))])
            await until_received(2)
            for i in range(1, 10):
                router.deliver([RequestOutput("r", delta=TextDelta(f"w{i} ", [i]))])
            router.deliver([RequestOutput("r", finish=FINISH)])

        producer = asyncio.create_task(produce())
        async for chunk in coalesce(source(), lambda: LONG_WINDOW_S, hold=stream.hold):
            async with received:
                out.append(chunk)
                received.notify_all()
        await producer
        return out

    # Bounded far below the window: a first output held back for a window after the admission would time out.
    out = asyncio.run(asyncio.wait_for(scenario(), LONG_WINDOW_S / 2))
    assert [c.text for c in out] == ["", "w0 ", "".join(f"w{i} " for i in range(1, 10))]
    assert out[0].is_admission_only and (out[0].prompt_tokens, out[0].cached_tokens) == (40, 32)
    assert not out[1].admitted and out[1].num_tokens == 1 and out[-1].finish is FINISH


def test_a_queued_admitted_and_first_output_close_together_go_as_one_chunk(monkeypatch):
    """A short prompt is queued, taken in and prefilled within a few ms: its stream opens with one chunk holding all
    three (each chunk costs CPU across replica, ingress and proxy), sent when the first output comes, not later."""
    # "Close together" on any machine: the admission waits up to a long window for what follows.
    monkeypatch.setattr(coalescing, "ADMISSION_GRACE_S", LONG_WINDOW_S)

    async def scenario():
        router = StreamRouter()
        stream = router.open("r", abort=lambda request_id: None)
        sent: list[StreamChunk] = []
        opened = asyncio.Event()

        async def source():
            async for item in stream:
                if isinstance(item, Queued):
                    yield StreamChunk(queued=True, prompt_tokens=40)
                elif isinstance(item, Admitted):
                    yield StreamChunk(queued=True, admitted=True, cached_tokens=item.cached_tokens)
                elif isinstance(item, TextDelta):
                    yield StreamChunk(text=item.text, num_tokens=len(item.token_ids))
                else:
                    yield StreamChunk(finish=item)

        async def produce() -> None:  # an engine posting a few ms apart
            router.deliver([RequestOutput("r", queued=Queued())])
            await asyncio.sleep(0.01)
            router.deliver([RequestOutput("r", admitted=Admitted(prompt_tokens=40, cached_tokens=32))])
            await asyncio.sleep(0.01)
            router.deliver([RequestOutput("r", delta=TextDelta("w0 ", [0]))])
            await opened.wait()  # the finish only once the stream has opened
            router.deliver([RequestOutput("r", finish=FINISH)])

        producer = asyncio.create_task(produce())
        async for chunk in coalesce(source(), lambda: LONG_WINDOW_S, hold=stream.hold):
            sent.append(chunk)
            opened.set()
        await producer
        return sent

    # Bounded far below the grace: an opening held back past the first output, to the grace's end, would time out.
    sent = asyncio.run(asyncio.wait_for(scenario(), LONG_WINDOW_S / 2))
    opening, last = sent
    assert opening.queued and opening.admitted and opening.text == "w0 " and opening.num_tokens == 1
    assert (opening.prompt_tokens, opening.cached_tokens) == (40, 32)
    assert last.finish is FINISH

"""Time-coalescing of a request's chunks (plain asyncio, no model)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import pytest

from deployments.coalesce import coalesce
from deployments.protocol import StreamChunk
from engine.output.request_output import Finish, RequestOutput, TextDelta, Usage
from engine.output.mailbox import Mailbox
from engine.request import FinishReason

FINISH = Finish(FinishReason.LENGTH, Usage(3, 40))


@dataclass
class Source:
    """Yields `count` one-token chunks `gap_s` apart, then a finish; records whether it was closed early."""

    count: int
    gap_s: float = 0.002
    closed_early: bool = False
    sent: list[str] = field(default_factory=list)

    async def chunks(self):
        try:
            for i in range(self.count):
                await asyncio.sleep(self.gap_s)
                self.sent.append(f"w{i} ")
                yield StreamChunk(text=f"w{i} ", num_tokens=1)
            yield StreamChunk(finish=FINISH)
        except (GeneratorExit, asyncio.CancelledError):
            self.closed_early = True
            raise


async def _collect(source: Source, window) -> tuple[list[StreamChunk], list[float]]:
    loop = asyncio.get_running_loop()
    start = loop.time()
    out, times = [], []
    async for chunk in coalesce(source.chunks(), window):
        out.append(chunk)
        times.append(loop.time() - start)
    return out, times


def test_first_chunk_at_once_then_batches_per_window():
    source = Source(count=40)
    out, times = asyncio.run(_collect(source, lambda: 0.03))
    assert out[0].text == "w0 " and times[0] < 0.03  # time to first token is not delayed
    assert 2 < len(out) < 20  # ~40 chunks over ~0.1 s merged into windows
    assert "".join(c.text for c in out) == "".join(source.sent)
    assert sum(c.num_tokens for c in out) == 40
    assert out[-1].finish is FINISH and all(c.finish is None for c in out[:-1])


def test_no_window_means_one_chunk_at_the_end():
    out, _ = asyncio.run(_collect(Source(count=10), lambda: None))
    assert len(out) == 1 and out[0].num_tokens == 10 and out[0].finish is FINISH


def test_closing_early_closes_the_source():
    source = Source(count=1000)

    async def scenario():
        stream = coalesce(source.chunks(), lambda: 0.02)
        await anext(stream)
        await stream.aclose()
        await asyncio.sleep(0)

    asyncio.run(scenario())
    assert source.closed_early and len(source.sent) < 1000


def test_a_failing_source_raises_to_the_reader():
    async def broken():
        yield StreamChunk(text="a", num_tokens=1)
        raise RuntimeError("engine exploded")

    async def scenario():
        async with contextlib.aclosing(coalesce(broken(), lambda: 0.01)) as stream:
            return [chunk async for chunk in stream]

    with pytest.raises(RuntimeError, match="engine exploded"):
        asyncio.run(scenario())


async def _mailbox_scenario(window_s: float | None, deltas: int = 60, gap_s: float = 0.002):
    """An engine-like producer posts one-token deltas to a Mailbox; the source reads it as the model service does."""
    loop = asyncio.get_running_loop()
    mailbox, reads = Mailbox(), []

    async def source():
        while not mailbox.closed:
            item = await mailbox.take()
            reads.append(item)
            if isinstance(item, TextDelta):
                yield StreamChunk(text=item.text, num_tokens=len(item.token_ids))
            else:
                yield StreamChunk(finish=item)

    async def produce() -> float:
        for i in range(deltas):
            await asyncio.sleep(gap_s)
            mailbox.put(RequestOutput("r", delta=TextDelta(f"w{i} ", [i])))
        mailbox.put(RequestOutput("r", finish=FINISH))
        return loop.time()

    producer = asyncio.create_task(produce())
    out, times = [], []
    async for chunk in coalesce(source(), lambda: window_s, hold=mailbox.wait_end):
        out.append(chunk)
        times.append(loop.time())
    return out, times, reads, await producer


def test_with_a_hold_the_source_is_read_once_per_window_and_the_finish_is_not_held_back():
    out, times, reads, finished_at = asyncio.run(_mailbox_scenario(0.03))
    assert out[0].text == "w0 "
    assert 2 < len(out) < 15 and len(reads) <= len(out) + 1  # one read per chunk, not one per delta
    assert "".join(c.text for c in out) == "".join(f"w{i} " for i in range(60))
    assert out[-1].finish is FINISH and all(c.finish is None for c in out[:-1])
    assert times[-1] - finished_at < 0.015  # the request's end wakes the hold at once


def test_with_a_hold_and_no_window_the_source_is_read_at_the_start_and_the_end():
    out, _, reads, _ = asyncio.run(_mailbox_scenario(None))
    assert len(out) == 1 and out[0].num_tokens == 60 and out[0].finish is FINISH
    assert len(reads) == 3  # the first delta, the rest merged, the finish

"""Issue 56: the ingress's own routing of streams over several replicas' stream channels (real ChannelServers on
Unix sockets; each replica's `generate` holds its streams open until released), and a model's view summed from
its replicas' board rows (/v1/queue/stats, /metrics)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

import pytest

from deployments.metrics.exposition import render_metrics
from deployments.model_calls import ChatPrompt, GenerateJob, MetricsSnapshot, QueueStats, Sample, StreamChunk, TextPrompt
from deployments.model_calls import AdapterRef
from deployments.transport.channel import ChannelServer
from deployments.transport.replica_board import ReplicaReport, merged_metrics, merged_queue_stats
from deployments.transport.replica_routing import ReplicaChannels, affinity_slack, prefix_key
from engine.output.request_output import Finish, Usage
from engine.sampling.params import SamplingParams

NODE = "node-a"


def job(user: str, *later: str, system: str | None = None) -> GenerateJob:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    for i, text in enumerate(later):
        messages += [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": text}]
    return GenerateJob(f"r-{user}-{len(later)}", ChatPrompt(messages=messages), SamplingParams(max_tokens=4), stream=True)


def test_a_conversations_later_turns_share_its_first_turns_key():
    first = prefix_key(job("plan a trip", system="be brief"))
    assert first is not None
    assert prefix_key(job("plan a trip", "to Rome", system="be brief")) == first
    assert prefix_key(job("plan a trip", "to Rome", "by train", system="be brief")) == first
    assert prefix_key(job("plan a trip", system="be verbose")) != first
    assert prefix_key(job("plan a dinner", system="be brief")) != first
    with_adapter = replace(job("plan a trip", system="be brief"), adapter=AdapterRef("sql", "/adapters/sql"))
    assert prefix_key(with_adapter) != first
    text = GenerateJob("t", TextPrompt(text="once upon a time"), SamplingParams(max_tokens=4), stream=True)
    assert prefix_key(text) == prefix_key(replace(text, prompt=TextPrompt(text="once upon a time")))
    assert prefix_key(replace(text, prompt=TextPrompt(text=""))) is None


class Replica:
    """A ChannelServer whose streams stay open until `release()`; counts what it served."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.released = asyncio.Event()
        self.jobs: list[GenerateJob] = []
        self.server = ChannelServer(self.generate, node_id=NODE)
        self.row: ReplicaReport | None = None

    async def generate(self, job: GenerateJob):
        self.jobs.append(job)
        await self.released.wait()
        yield StreamChunk(text="done", finish=Finish("stop", Usage(3, 1)))

    async def start(self) -> None:
        address = await self.server.start()
        self.row = ReplicaReport("app", self.replica_id, NODE, 1, address, None, None, None)

    def release(self) -> None:
        self.released.set()


@contextlib.asynccontextmanager
async def replicas(count: int):
    started = [Replica(f"r{i}") for i in range(count)]
    for replica in started:
        await replica.start()
    rows = [r.row for r in started]

    async def read_rows() -> list[ReplicaReport]:
        return list(rows)

    channels = ReplicaChannels("m", read_rows, lambda: NODE)
    try:
        yield started, rows, channels
    finally:
        for replica in started:
            replica.release()
        await channels.close()
        for replica in started:
            await replica.server.close(drain_s=0.0)


async def open_stream(channels: ReplicaChannels, request: GenerateJob) -> asyncio.Task:
    await channels.refresh()
    client = channels.pick(request)
    assert client is not None
    task = asyncio.create_task(anext(client.stream(request)))
    await asyncio.sleep(0.02)  # the replica has it open
    return task


async def settle(replicas_: list[Replica], total: int) -> None:
    for _ in range(100):
        if sum(len(r.jobs) for r in replicas_) == total:
            return
        await asyncio.sleep(0.01)


def test_streams_of_different_conversations_spread_evenly():
    async def main() -> None:
        async with replicas(3) as (started, _, channels):
            tasks = [await open_stream(channels, job(f"question {i}")) for i in range(12)]
            await settle(started, 12)
            assert [len(r.jobs) for r in started] == [4, 4, 4]
            assert channels.usable
            for replica in started:
                replica.release()
            assert [(await t).finish.reason for t in tasks] == ["stop"] * 12

    asyncio.run(main())


def test_a_conversation_stays_on_its_replica_until_that_one_is_much_busier():
    async def main() -> None:
        async with replicas(2) as (started, _, channels):
            await open_stream(channels, job("trip", system="brief"))
            home = next(r for r in started if r.jobs)
            other = next(r for r in started if r is not home)
            # Its later turns follow it while its replica has at most affinity_slack(0) = 4 more open streams.
            for turn in range(affinity_slack(0)):
                await open_stream(channels, job("trip", f"turn {turn}", system="brief"))
            assert (len(home.jobs), len(other.jobs)) == (1 + affinity_slack(0), 0)
            await open_stream(channels, job("trip", "one too many", system="brief"))
            assert len(other.jobs) == 1  # busier by more than the slack: the least busy replica takes it
            # A new conversation goes to the least busy replica.
            await open_stream(channels, job("dinner"))
            assert len(other.jobs) == 2

    asyncio.run(main())


def test_a_replica_gone_is_not_picked_and_a_row_on_another_node_sends_streams_through_ray():
    async def main() -> None:
        async with replicas(2) as (started, rows, channels):
            await channels.refresh()
            await asyncio.sleep(0.05)  # both replicas took the ingress's connection
            dead = started[0]
            await dead.server.close(drain_s=0.0)  # its socket is gone; its row stays on the board a few seconds
            await asyncio.sleep(0.05)
            channels._read_at = float("-inf")  # the next read is due
            for i in range(4):
                await open_stream(channels, job(f"after {i}"))
            assert len(dead.jobs) == 0 and len(started[1].jobs) == 4
            assert channels.usable

            rows.append(replace(rows[1], replica_id="remote", channel=replace(rows[1].channel, node_id="node-b")))
            channels._read_at = float("-inf")
            await channels.refresh()
            assert not channels.usable  # a replica this ingress cannot reach by channel: Serve's router for all

    asyncio.run(main())


def stats(model_id: str, generated: int, running: int, queue: int | None) -> QueueStats:
    return QueueStats(model_id=model_id, waiting=1, running=running, decoding=running, max_num_seqs=64,
                      queue_size=queue, kv_cache_bytes=100, prompt_tokens_total=10, generation_tokens_total=generated,
                      tokens_per_s=5.0, steps_total=3, step_seconds_total=0.5, step_cpu_seconds_total=0.25,
                      process_cpu_seconds_total=1.0, channel_streams_total=2)


def test_a_models_stats_sum_its_replicas_and_list_each():
    rows = [ReplicaReport("app", "r1", NODE, 11, None, stats("m", 40, 2, 8), None, None, 0.5),
            ReplicaReport("app", "r2", NODE, 12, None, stats("m", 60, 3, 8), None, None, 0.2)]
    merged = merged_queue_stats("m", rows)
    assert (merged.generation_tokens_total, merged.running, merged.waiting, merged.max_num_seqs) == (100, 5, 2, 128)
    assert (merged.queue_size, merged.channel_streams_total, merged.steps_total) == (16, 4, 6)
    assert [(r.replica_id, r.pid, r.age_s, r.stats.generation_tokens_total) for r in merged.replicas] == [
        ("r1", 11, 0.5, 40), ("r2", 12, 0.2, 60)]
    rows[1] = replace(rows[1], stats=replace(rows[1].stats, queue_size=None))
    assert merged_queue_stats("m", rows).queue_size is None  # one replica unbounded: the model is
    assert merged_queue_stats("m", [replace(r, stats=None) for r in rows]) is None
    # A vision tower's counts: summed over the replicas that have one; None where none has.
    rows[0] = replace(rows[0], stats=replace(rows[0].stats, vision_tower_images_total=3, vision_tower_seconds_total=0.5))
    merged = merged_queue_stats("m", rows)
    assert (merged.vision_tower_images_total, merged.vision_tower_seconds_total, merged.channel_streams_total) == (3, 0.5, 4)
    assert merged_queue_stats("m", rows[1:]).vision_tower_images_total is None


def test_each_replicas_metrics_carry_its_id_beside_a_single_replica_models():
    def snapshot(model: str, value: float) -> MetricsSnapshot:
        return MetricsSnapshot(samples=[Sample("generation_tokens_total", {"model_name": model}, value)])

    rows = [ReplicaReport("app", rid, NODE, 1, None, None, snapshot("two", v), None) for rid, v in (("r1", 3), ("r2", 4))]
    merged = merged_metrics(rows)
    assert [(s.labels["replica"], s.value) for s in merged.samples] == [("r1", 3), ("r2", 4)]
    text = render_metrics([merged, snapshot("one", 7)]).decode()
    lines = [line for line in text.splitlines() if line.startswith("orchard:generation_tokens_total")]
    assert lines == ['orchard:generation_tokens_total{model_name="two",replica="r1"} 3.0',
                     'orchard:generation_tokens_total{model_name="two",replica="r2"} 4.0',
                     'orchard:generation_tokens_total{model_name="one",replica=""} 7.0']


if __name__ == "__main__":
    pytest.main([__file__, "-q"])

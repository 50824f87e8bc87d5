"""An EngineCore that notes when each request reached the engine thread and when each step ran (a diagnostic).

bench.service_burst --engine-thread serves through it (AsyncEngine, one process), so a burst's time to first
token splits into intake (event loop, tokenizer threads), the wait for the engine thread, the steps, and the
way back to the stream. perf_counter times, comparable with the caller's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from engine.core import EngineCore
from engine.core_builder import build_engine_core
from engine.output.events import RequestOutput
from engine.process_protocol import CoreSpec
from engine.request import Request


@dataclass
class StepRecord:
    started: float
    ended: float
    waiting_before: int
    first_tokens: int


@dataclass
class CoreTimeline:
    added: dict[str, float] = field(default_factory=dict)  # request id -> taken in by the engine thread
    first_token_step: dict[str, float] = field(default_factory=dict)  # request id -> end of its first token's step
    steps: list[StepRecord] = field(default_factory=list)


class TimedCore(EngineCore):
    timeline: CoreTimeline

    def add_request(self, request: Request) -> None:
        self.timeline.added[request.request_id] = time.perf_counter()
        super().add_request(request)

    def step(self, before_device_work: Callable[[], None] | None = None) -> list[RequestOutput]:
        started, waiting = time.perf_counter(), len(self.scheduler.waiting)
        outputs = super().step(before_device_work)
        ended = time.perf_counter()
        firsts = self.timeline.first_token_step
        new = [o.request_id for o in outputs if o.request_id not in firsts and o.delta is not None and o.delta.token_ids]
        for request_id in new:
            firsts[request_id] = ended
        self.timeline.steps.append(StepRecord(started, ended, waiting, len(new)))
        return outputs


def build_timed_core(spec: CoreSpec, timeline: CoreTimeline) -> TimedCore:
    core = build_engine_core(spec, TimedCore)
    assert isinstance(core, TimedCore)
    core.timeline = timeline
    return core

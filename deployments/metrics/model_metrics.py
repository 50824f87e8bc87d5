"""ModelMetrics: a model replica's metrics. Per request, from the engine's events as the model's service reads them
(before any coalescing: every token's arrival is seen); per model, from the engine's stats when read."""

from __future__ import annotations

import time
from dataclasses import dataclass

from deployments.metrics import families
from deployments.metrics.recorder import MetricsRecorder
from deployments.model_calls import MetricsSnapshot
from engine.client.interface import StreamEvent
from engine.core import EngineStats
from engine.output.request_output import Admitted, Finish, Queued, TextDelta
from engine.request import FinishReason


@dataclass
class RequestTiming:
    """One request's moments (time.monotonic()) and tokens, as its events reach the model's service."""

    received_at: float
    queued_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    generated_tokens: int = 0
    ended: bool = False  # a Finish was counted


@dataclass
class ModelMemory:
    """Bytes: MLX's allocator counters of the engine's process, and the resident set of the model's processes."""

    mlx_active: int
    mlx_cache: int
    mlx_peak: int
    rss: int


class ModelMetrics:
    def __init__(self, model_name: str) -> None:
        self.recorder = MetricsRecorder(model_name)

    def received(self) -> RequestTiming:
        return RequestTiming(received_at=time.monotonic())

    def on_event(self, timing: RequestTiming, event: StreamEvent) -> None:
        now = time.monotonic()
        if isinstance(event, Queued):
            timing.queued_at = now
        elif isinstance(event, Admitted):
            if timing.queued_at is not None:
                self.recorder.observe(families.QUEUE_TIME, now - timing.queued_at)
        elif isinstance(event, TextDelta):
            self._on_tokens(timing, len(event.token_ids), now)
        elif isinstance(event, Finish):
            self._on_finish(timing, event, now)

    def closed(self, timing: RequestTiming, num_prompt_tokens: int, failed: bool) -> None:
        """The request's stream is over. Without a Finish or an error, the client went away: an abort, with the
        tokens it had received."""
        if timing.ended or failed:
            return
        timing.ended = True
        self.recorder.inc(families.REQUEST_SUCCESS, finished_reason=FinishReason.ABORT.value)
        self.recorder.inc(families.PROMPT_TOKENS, num_prompt_tokens)
        self.recorder.inc(families.GENERATION_TOKENS, timing.generated_tokens)

    def _on_tokens(self, timing: RequestTiming, count: int, now: float) -> None:
        if count == 0:
            return
        timing.generated_tokens += count
        if timing.first_token_at is None:
            timing.first_token_at = now
            self.recorder.observe(families.TTFT, now - timing.received_at)
        else:
            assert timing.last_token_at is not None
            # Tokens that arrive together (a consumer behind the engine, accepted drafts) share the wait.
            self.recorder.observe(families.ITL, (now - timing.last_token_at) / count, times=count)
        timing.last_token_at = now

    def _on_finish(self, timing: RequestTiming, finish: Finish, now: float) -> None:
        timing.ended = True
        self.recorder.inc(families.REQUEST_SUCCESS, finished_reason=finish.reason.value)
        self.recorder.inc(families.PROMPT_TOKENS, finish.usage.prompt_tokens)
        self.recorder.inc(families.GENERATION_TOKENS, finish.usage.completion_tokens)
        self.recorder.observe(families.E2E, now - timing.received_at)

    def snapshot(self, stats: EngineStats, restarts: int, memory: ModelMemory) -> MetricsSnapshot:
        """Read the engine's levels and counts into the metrics, then all of them (Ray's get them too)."""
        rec = self.recorder
        rec.set(families.RUNNING, stats.num_running)
        rec.set(families.WAITING, stats.num_waiting)
        rec.set(families.KV_CACHE_BYTES, stats.kv_cache_bytes)
        rec.set(families.KV_BUDGET_BYTES, stats.kv_budget_bytes)
        rec.set_total(families.PREEMPTIONS, stats.num_preemptions)
        rec.set(families.PREEMPTED, stats.num_preempted)
        rec.set_total(families.ENGINE_RESTARTS, restarts)
        for kind, value in (("mlx_active", memory.mlx_active), ("mlx_cache", memory.mlx_cache),
                            ("mlx_peak", memory.mlx_peak), ("rss", memory.rss)):
            rec.set(families.MEMORY_BYTES, value, kind=kind)
        prefix = stats.prefix_cache
        if prefix is not None:
            rec.set_total(families.PREFIX_LOOKUPS, prefix.hits, result="hit")
            rec.set_total(families.PREFIX_LOOKUPS, prefix.misses, result="miss")
            rec.set_total(families.PREFIX_HIT_TOKENS, prefix.hit_tokens)
            rec.set(families.PREFIX_CACHE_BYTES, prefix.bytes_used)
        vision = stats.vision_features
        if vision is not None:
            rec.set_total(families.VISION_LOOKUPS, vision.hits, result="hit")
            rec.set_total(families.VISION_LOOKUPS, vision.misses, result="miss")
            rec.set(families.VISION_CACHE_BYTES, vision.bytes)
        tower = stats.vision_tower
        if tower is not None:
            rec.set_total(families.VISION_TOWER_IMAGES, tower.images)
            rec.set_total(families.VISION_TOWER_SECONDS, tower.seconds)
        if stats.guide_compiles is not None:
            rec.set_total(families.GUIDE_COMPILES, stats.guide_compiles.compiles)
            rec.set_total(families.GUIDE_COMPILE_SECONDS, stats.guide_compiles.seconds_total)
        speculation = stats.speculation
        if speculation is not None:
            rec.set_total(families.SPEC_VERIFY_STEPS, speculation.verify_steps)
            rec.set_total(families.SPEC_DRAFT_TOKENS, speculation.drafted_tokens)
            rec.set_total(families.SPEC_ACCEPTED_TOKENS, speculation.accepted_tokens)
        return rec.snapshot()

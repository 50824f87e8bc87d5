"""When a decode step should wait for the step before it, so that its KV is written in place.

mlx-lm's caches write a step's keys and values with a slice update (`keys[..., i:j, :] = new`), which MLX does in
the cache's own buffer only when no other array holds that buffer. On a GPU the step still running holds the
buffers it reads until it ends (MLX's CUDA encoder keeps a kernel's inputs alive to its completion), so a step
queued behind it, as the pipelined decode loop queues them, copies every layer's keys and values whole: a copy
that grows with rows x context (3.8 GB a step for 128 rows of a Qwen3-0.6B shape at 256 tokens of context).
Waiting for the running step before queueing the next one (`mx.synchronize`: its buffers are released by then)
costs the device the launch of the next step's first kernels instead; the Python that builds the step still
runs beside the device. So a batch holding at least `threshold_bytes` of KV waits; a smaller one pipelines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.kv.batch_cache import cache_nbytes


@dataclass
class InPlaceKV:
    threshold_bytes: int | None  # None: never wait
    # Decode steps that waited, for the engine's stats (bench.engine_throughput reports them).
    steps_waited: int = 0

    def should_wait(self, caches: list[Any]) -> bool:
        """Whether this decode step, over the batch's per-layer `caches`, waits for the step before it."""
        if self.threshold_bytes is None or not caches:
            return False
        if cache_nbytes(caches) < self.threshold_bytes:
            return False
        self.steps_waited += 1
        return True


__all__ = ["InPlaceKV"]

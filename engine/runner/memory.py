"""The engine process's memory: MLX's allocator counters and the process's resident set."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engine.process_memory import process_rss_bytes


@dataclass(frozen=True)
class EngineMemory:
    mlx_active_bytes: int
    mlx_cache_bytes: int
    mlx_peak_bytes: int
    rss_bytes: int
    # On the CPU backend MLX buffers live in the RSS already; on Metal/CUDA they come on top of it.
    buffers_in_rss: bool


def read_engine_memory() -> EngineMemory:
    # Reading allocator counters is safe from any thread; nothing is allocated or evaluated.
    return EngineMemory(
        mlx_active_bytes=mx.get_active_memory(),
        mlx_cache_bytes=mx.get_cache_memory(),
        mlx_peak_bytes=mx.get_peak_memory(),
        rss_bytes=process_rss_bytes(),
        buffers_in_rss=mx.default_device().type == mx.DeviceType.cpu,
    )

"""The engine process's memory: MLX's allocator counters and the process's resident set."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engine.config import EngineConfig
from engine.device_memory import device_memory_bytes, on_gpu, peak_memory_bytes
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
        mlx_peak_bytes=peak_memory_bytes(),
        rss_bytes=process_rss_bytes(),
        buffers_in_rss=not on_gpu(),
    )


def vision_features_budget(config: EngineConfig) -> int:
    """The vision-feature cache's byte budget: the config's, else 1% of the device's memory."""
    if config.vision_feature_cache_bytes is not None:
        return config.vision_feature_cache_bytes
    return device_memory_bytes() // 100

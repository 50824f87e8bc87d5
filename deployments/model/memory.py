"""A model's memory as the API reports it: the engine process's MLX counters and RSS (plus, where the engine
steps in a child process, the serving process's RSS)."""

from __future__ import annotations

from engine.runner.memory import EngineMemory, process_rss_bytes

from deployments.model_calls import MemoryUsage

MIB = 1024 * 1024


def memory_usage(engine: EngineMemory, engine_in_own_process: bool) -> MemoryUsage:
    rss = engine.rss_bytes + (process_rss_bytes() if engine_in_own_process else 0)
    total = rss if engine.buffers_in_rss else rss + engine.mlx_active_bytes
    return MemoryUsage(
        mlx_active_mb=round(engine.mlx_active_bytes / MIB, 1),
        mlx_cache_mb=round(engine.mlx_cache_bytes / MIB, 1),
        mlx_peak_mb=round(engine.mlx_peak_bytes / MIB, 1),
        rss_mb=round(rss / MIB, 1),
        total_mb=round(total / MIB, 1),
    )

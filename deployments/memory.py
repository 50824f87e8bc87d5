"""Memory of the current (model replica) process: MLX's allocator counters and RSS."""

from __future__ import annotations

import os
import resource
import sys

import mlx.core as mx

from deployments.protocol import MemoryUsage

MIB = 1024 * 1024


def process_rss_bytes() -> int:
    """Resident set size now (Linux /proc); elsewhere the peak, which is what getrusage offers."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def memory_usage() -> MemoryUsage:
    # Reading allocator counters is safe from any thread; nothing is allocated or evaluated.
    active, cache, peak = mx.get_active_memory(), mx.get_cache_memory(), mx.get_peak_memory()
    rss = process_rss_bytes()
    # On the CPU backend MLX buffers live in RSS already; on Metal/CUDA they are extra.
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    total = rss if on_cpu else rss + active
    return MemoryUsage(
        mlx_active_mb=round(active / MIB, 1),
        mlx_cache_mb=round(cache / MIB, 1),
        mlx_peak_mb=round(peak / MIB, 1),
        rss_mb=round(rss / MIB, 1),
        total_mb=round(total / MIB, 1),
    )

"""This process's resident memory, read from the OS (no MLX): the engine process, a model replica and an embedding
replica report it alike."""

from __future__ import annotations

import os
import resource
import sys


def process_rss_bytes() -> int:
    """Resident set size now (Linux /proc); elsewhere the peak, which is what getrusage offers."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def available_memory_bytes() -> int | None:
    """Memory the OS could give processes now (Linux: /proc/meminfo's MemAvailable, other processes' models
    included); None where the OS does not say (macOS)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None

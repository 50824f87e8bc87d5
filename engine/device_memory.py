"""MLX's device: whether it is a GPU (the one test every device-dependent default uses) and how much memory it has
(the one reading every memory-sized default uses: the KV budget, the prefix cache, the prefill step, quantize auto,
`orchard doctor`)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import mlx.core as mx

# mx.device_info() names it by backend: Metal's recommended working set (a share of unified memory), a CUDA
# card's own memory (there the machine's RAM is not the GPU's), Metal's whole unified memory.
ACCELERATOR_MEMORY_KEYS = ("max_recommended_working_set_size", "total_memory", "memory_size")
# MLX's evaluation waits for work in flight to free its buffers once what it holds passes its memory limit (95% of a
# CUDA card by default). What it does not count (the CUDA context, cuBLAS and cuDNN workspaces, the async pool's
# slack) took more than that 5%: a 32-stream image burst on an H100 failed cudaMallocAsync at 75.4 of 79.1 GiB
# counted. On CUDA an engine leaves this share of the card outside MLX's limit.
CUDA_RUNTIME_SHARE = 0.10
# A refresh that moves MLX's limit by this much is logged: a step stalled by a lowered limit can be told from one
# that built kernels.
LIMIT_CHANGE_LOGGED_BYTES = 1 << 30

log = logging.getLogger(__name__)


def on_gpu() -> bool:
    """Whether MLX computes on a GPU (Metal or CUDA) rather than the CPU."""
    return mx.default_device().type == mx.DeviceType.gpu


def accelerator_memory_bytes() -> int:
    """The GPU's memory as MLX reports it; 0 on the CPU backend (or where MLX reports none)."""
    try:
        info = mx.device_info()
    except (AttributeError, RuntimeError, ValueError):
        return 0
    for key in ACCELERATOR_MEMORY_KEYS:
        if int(info.get(key, 0) or 0) > 0:
            return int(info[key])
    return 0


def device_memory_bytes() -> int:
    """The memory MLX's device may use: the GPU's, else the machine's RAM (the CPU backend's buffers live there)."""
    return accelerator_memory_bytes() or host_memory_bytes()


def engine_memory_limit_bytes(mlx_limit_bytes: int | None = None) -> int:
    """The most an engine lets MLX hold before its evaluation waits for work in flight: on CUDA the card less
    CUDA_RUNTIME_SHARE and less what other processes hold on it, no more than MLX's own limit (`mlx_limit_bytes`,
    else the one set now); elsewhere MLX's limit."""
    limit = mx.get_memory_limit() if mlx_limit_bytes is None else mlx_limit_bytes
    if on_gpu() and mx.cuda.is_available():
        card = card_memory()
        if card is None:
            return min(limit, int(accelerator_memory_bytes() * (1 - CUDA_RUNTIME_SHARE)))
        # Free + held is at most the card: this is also at most the card less CUDA_RUNTIME_SHARE.
        return min(limit, shared_card_limit_bytes(card, mx.get_active_memory() + mx.get_cache_memory()))
    return limit


@dataclass(frozen=True)
class CardMemory:
    """A CUDA card's memory as the driver reports it now: free counts every process's allocations, not only ours."""
    total_bytes: int
    free_bytes: int


def card_memory() -> CardMemory | None:
    """The CUDA card's total and free memory (MLX reads NVML, else cudaMemGetInfo); None elsewhere or where this MLX
    reports no free memory."""
    try:
        info = mx.device_info()
    except (AttributeError, RuntimeError, ValueError):
        return None
    total, free = int(info.get("total_memory", 0) or 0), info.get("free_memory")
    return CardMemory(total, int(free)) if total > 0 and free is not None else None


def shared_card_limit_bytes(card: CardMemory, mlx_held_bytes: int) -> int:
    """What this process's MLX may hold on a card others use too (another server, a training job): what it holds
    now (`mlx_held_bytes`, active and cached) plus the card's free memory, less CUDA_RUNTIME_SHARE of the card for
    the CUDA runtime. Our own runtime's allocations count as others' here: a little under, never over."""
    return max(0, card.free_bytes + mlx_held_bytes - int(card.total_bytes * CUDA_RUNTIME_SHARE))


class EngineMemoryLimit:
    """MLX's memory limit while an engine serves: set at start, on CUDA set again at most every REFRESH_S as other
    processes take or give back the card's memory (a second server loading beside ours), the limit before restored
    at close."""

    REFRESH_S = 1.0

    def __init__(self) -> None:
        self._previous = mx.get_memory_limit()
        self._shared_card = on_gpu() and mx.cuda.is_available() and card_memory() is not None
        self._set_at = 0.0
        self.refresh(force=True)

    def refresh(self, force: bool = False) -> None:
        """Called every step: off a shared CUDA card, nothing after the first."""
        if not (force or self._shared_card):
            return
        now = time.monotonic()
        if force or now - self._set_at >= self.REFRESH_S:
            limit = engine_memory_limit_bytes(self._previous)
            if abs(limit - mx.get_memory_limit()) >= LIMIT_CHANGE_LOGGED_BYTES and not force:
                log.info("MLX's memory limit %.1f -> %.1f GiB (the card's memory taken or given back outside this "
                         "process's MLX; %s)", mx.get_memory_limit() / (1 << 30), limit / (1 << 30),
                         memory_reading().describe())
            mx.set_memory_limit(limit)
            self._set_at = now

    def restore(self) -> None:
        mx.set_memory_limit(self._previous)


@dataclass(frozen=True)
class MemoryReading:
    """What MLX holds now against its limit: a slow step's line carries it, so memory pressure (evaluation waiting
    for work in flight to free buffers, a cache cleared to fit) shows beside the step it stalled."""
    active_bytes: int
    cache_bytes: int
    limit_bytes: int

    def describe(self) -> str:
        gib = 1 << 30
        return (f"MLX holds {self.active_bytes / gib:.1f} GiB active + {self.cache_bytes / gib:.1f} GiB cached of its "
                f"{self.limit_bytes / gib:.1f} GiB limit")


def memory_reading() -> MemoryReading:
    return MemoryReading(mx.get_active_memory(), mx.get_cache_memory(), mx.get_memory_limit())


def headroom_bytes() -> int:
    """What MLX may still take before it reaches its limit (the engine's, while one serves)."""
    return max(0, mx.get_memory_limit() - mx.get_active_memory())


def usable_memory_bytes() -> int:
    """What an engine sizes its weights, budgets and forwards within: the device's memory, up to that limit (on the
    CPU MLX's limit is below the RAM; on Metal above the recommended working set)."""
    return min(device_memory_bytes(), engine_memory_limit_bytes())


# MLX's peak before the engine last reset it (to measure one forward's hold): the process's peak stays readable.
_peak_before_resets = 0


def reset_peak_memory() -> None:
    """Reset MLX's peak to measure what comes next, keeping the lifetime peak for peak_memory_bytes."""
    global _peak_before_resets
    _peak_before_resets = max(_peak_before_resets, mx.get_peak_memory())
    mx.reset_peak_memory()


def peak_memory_bytes() -> int:
    """The most MLX has held in this process, across the engine's resets."""
    return max(_peak_before_resets, mx.get_peak_memory())


def host_memory_bytes() -> int:
    """The machine's RAM."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def release_thread_streams() -> None:
    """Destroy the MLX streams this thread made, each of which holds a worker thread until then (one per engine
    started: 150 left over in one test process). Call it last on a thread whose model is closed (an engine's own
    thread), never on one whose streams still serve."""
    mx.synchronize()
    mx.clear_streams()

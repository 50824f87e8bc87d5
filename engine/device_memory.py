"""MLX's device: whether it is a GPU (the one test every device-dependent default uses) and how much memory it has
(the one reading every memory-sized default uses: the KV budget, the prefix cache, the prefill step, quantize auto,
`orchard doctor`)."""

from __future__ import annotations

import os

import mlx.core as mx

# mx.device_info() names it by backend: Metal's recommended working set (a share of unified memory), a CUDA
# card's own memory (there the machine's RAM is not the GPU's), Metal's whole unified memory.
ACCELERATOR_MEMORY_KEYS = ("max_recommended_working_set_size", "total_memory", "memory_size")
# MLX's evaluation waits for work in flight to free its buffers once what it holds passes its memory limit (95% of a
# CUDA card by default). What it does not count (the CUDA context, cuBLAS and cuDNN workspaces, the async pool's
# slack) took more than that 5%: a 32-stream image burst on an H100 failed cudaMallocAsync at 75.4 of 79.1 GiB
# counted. On CUDA an engine leaves this share of the card outside MLX's limit.
CUDA_RUNTIME_SHARE = 0.10


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


def engine_memory_limit_bytes() -> int:
    """The most an engine lets MLX hold before its evaluation waits for work in flight: on CUDA the card less
    CUDA_RUNTIME_SHARE (and no more than MLX's own limit); elsewhere MLX's limit as it stands."""
    limit = mx.get_memory_limit()
    if on_gpu() and mx.cuda.is_available():
        limit = min(limit, int(accelerator_memory_bytes() * (1 - CUDA_RUNTIME_SHARE)))
    return limit


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

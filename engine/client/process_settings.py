"""The engine process's scheduling priority and thread settings, chosen for its device instead of inherited.

Ray starts its workers at nice 15 with OMP_NUM_THREADS=1, and the engine process inherits both from the model's
replica: on a host busy with other work, one CPU prefill step of three 3,040-token prompts took ~20 minutes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from engine.errors import InvalidRequestError

# The engine decodes for every stream of its model: it runs at the default priority, not below it.
ENGINE_NICENESS = 0
# The variables BLAS and OpenMP runtimes read for their thread counts (OpenBLAS, MKL, Apple's Accelerate).
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")
# An operator's own thread count for the engine process; it wins over the device's choice.
THREADS_OVERRIDE = "ORCHARD_ENGINE_THREADS"


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def engine_thread_env(runs_on_cpu: bool, environ: Mapping[str, str]) -> dict[str, str]:
    """Thread-count variables for the engine process. On the CPU backend the model's matmuls are the work, so its
    BLAS and OpenMP runtimes get every usable core; on a GPU the host only builds graphs and keeps what it has."""
    explicit = environ.get(THREADS_OVERRIDE)
    if explicit:
        if not explicit.isdigit() or int(explicit) < 1:
            raise InvalidRequestError(f"{THREADS_OVERRIDE} must be a whole number >= 1, got {explicit!r}",
                                      param=THREADS_OVERRIDE)
        count = explicit
    elif runs_on_cpu:
        count = str(usable_cores())
    else:
        return {}
    return {name: count for name in THREAD_VARIABLES}


@dataclass(frozen=True)
class PriorityChange:
    before: int
    after: int
    # Why the niceness could not be lowered (an unprivileged process may only raise its own); None when it was.
    refused: str | None = None


def raise_engine_priority(target: int = ENGINE_NICENESS) -> PriorityChange:
    """Bring this process's niceness down to `target` where it is above it (as far as the OS lets it)."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    if before <= target:
        return PriorityChange(before, before)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, target)
    except PermissionError as exc:
        return PriorityChange(before, before, refused=exc.strerror or str(exc))
    return PriorityChange(before, os.getpriority(os.PRIO_PROCESS, 0))


def priority_message(change: PriorityChange) -> str | None:
    """The engine log's line about its priority; None when there was nothing to change."""
    if change.refused is not None:
        return (f"the engine process runs at nice {change.before}, inherited from its parent (Ray starts its workers "
                f"at nice 15), and may not lower it ({change.refused}): on a busy host it gets less CPU than the "
                f"work around it. Start Ray with RAY_worker_niceness=0 (`orchard serve` does), or give the server "
                f"CAP_SYS_NICE.")
    if change.after != change.before:
        return f"the engine process's niceness lowered from {change.before} (inherited) to {change.after}"
    return None

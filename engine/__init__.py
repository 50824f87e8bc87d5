"""Orchard's MLX continuous-batching engine (no Ray, no HTTP).

Names are imported lazily so that plain-Python parts (scheduler, block pool, prefix cache)
can be used and tested without importing MLX.
"""

from importlib import import_module
from typing import Any

from engine.cpu_blas import choose_blas

# Before any engine module imports MLX: its CPU float32 matmuls then run on OpenBLAS where the OS has it.
choose_blas()

_EXPORTS = {
    "EngineConfig": "engine.config",
    "EngineCore": "engine.core",
    "EngineStats": "engine.core",
    "EngineSpec": "engine.client.spec",
    "ThreadEngineClient": "engine.client.thread_client",
    "ProcessEngineClient": "engine.client.process_client",
    "FinishReason": "engine.request",
    "Request": "engine.request",
    "RequestStatus": "engine.request",
    "SamplingParams": "engine.sampling.params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute '{name}'")
    return getattr(import_module(_EXPORTS[name]), name)

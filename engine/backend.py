"""Process-wide MLX backend settings the engine prefers, applied before MLX's first GPU work.

MLX reads these once per process, at first use, so they are set when `engine` is imported;
a value already in the environment always wins. They only concern MLX's CUDA backend
(ignored on Apple silicon and on the CPU).
"""

from __future__ import annotations

import os

# Measured on an H100 (bench/attention_probe.py, bench/results/README.md): with CUDA graphs on, the
# first forward at each new batched-prefill shape (ragged rows, array masks) cost 0.8-8.8 s and a
# one-row decode step at a 2,048-token context 12.9 ms; with them off, 0.07-0.17 s and 6.7 ms, and
# engine decode throughput at 64/128 sequences was no lower (mlx-lm's BatchGenerator likewise).
BACKEND_DEFAULTS = {"MLX_USE_CUDA_GRAPHS": "0"}


def apply_backend_defaults() -> dict[str, str]:
    """Set each default the environment does not already set; returns the settings in effect."""
    for name, value in BACKEND_DEFAULTS.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in BACKEND_DEFAULTS}

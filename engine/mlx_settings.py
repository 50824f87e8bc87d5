"""Process-wide MLX backend settings the engine prefers, applied before MLX's first GPU work.

MLX reads these once per process, at first use: `load_model` applies them before it loads weights (the engine
process, the CLI and in-process benchmarks all load through it); a value already in the environment wins.
They only concern MLX's CUDA backend (ignored on Apple silicon and on the CPU).
"""

from __future__ import annotations

import os

# Measured on an H100 (bench/attention_probe.py, commit 8960592): with CUDA graphs on, the first forward at each
# new batched-prefill shape (ragged rows, array masks) cost 0.8-8.8 s and a one-row decode step at a 2,048-token
# context 12.9 ms; with them off, 0.07-0.17 s and 6.7 ms, and engine decode throughput at 64/128 sequences was no
# lower (mlx-lm's BatchGenerator likewise). With MLX 0.32.4 graphs speed a lone stream (4.97 against 6.27 ms a step)
# but slow 128 streams (19.9 against 14.4 ms): docs/decisions.md, "MLX CUDA graphs off".
MLX_SETTINGS = {"MLX_USE_CUDA_GRAPHS": "0"}


def apply_mlx_settings() -> dict[str, str]:
    """Set each setting the environment does not already set; returns the settings in effect."""
    for name, value in MLX_SETTINGS.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in MLX_SETTINGS}

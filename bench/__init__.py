"""Orchard's lasting benchmarks (bench/README.md), run from the repository root as `python -m bench.NAME`."""

import engine  # noqa: F401 - first: importing the engine picks the BLAS MLX will call, before anything imports MLX

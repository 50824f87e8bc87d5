import os
import platform
from pathlib import Path


def _pin_batch_invariant_blas() -> None:
    """The exactness tests (batched == alone, cached == uncached) compare a row's arithmetic inside batches of
    different sizes. OpenBLAS's FMA kernels, which engine/cpu_blas.py picks on an x86 CPU (HASWELL without AVX-512,
    SKYLAKEX with it), round a row differently as the batch grows (up to 5e-5 on a 64x576 @ 576x1536 matmul on an
    AMD EPYC: enough to move a 4-bit KV value to the next level; on an AVX-512 EPYC from 5 rows on, even at the tiny
    models' 64 wide, under either kernel). Its AVX kernels (SANDYBRIDGE) gave every row the same bits, but on a
    newer CPU they leave the vector registers' upper halves dirty, and MLX's own SSE code then ran ~50x slower after
    any float32 matmul (an exp of 1M floats 750 ms against 14; a tiny FLUX.2 image 20 s against 1.5). Its SSE kernels
    (NEHALEM) give every row the same bits at every batch size too (a forced kernel runs the same instructions on
    every x86 CPU), at ~1/3 of the FMA kernels' speed, which the tiny models barely feel. The suite (and the engine
    processes it starts) runs on those, over an OPENBLAS_CORETYPE the machine sets (one CI machine set Haswell for
    every process); servers keep the fastest.
    ORCHARD_TEST_OPENBLAS_CORETYPE runs the suite on other kernels."""
    if os.environ.get("ORCHARD_TEST_OPENBLAS_CORETYPE"):
        os.environ["OPENBLAS_CORETYPE"] = os.environ["ORCHARD_TEST_OPENBLAS_CORETYPE"]
        return
    if platform.machine() != "x86_64":
        return
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return
    if "sse4_2" in flags.split():
        os.environ["OPENBLAS_CORETYPE"] = "NEHALEM"


_pin_batch_invariant_blas()  # before the engine picks the BLAS (and reads OPENBLAS_CORETYPE)
import engine  # noqa: E402,F401 - first: importing the engine picks the BLAS MLX will call, before anything imports MLX

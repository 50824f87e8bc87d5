import os
import platform
from pathlib import Path


def _pin_batch_invariant_blas() -> None:
    """The exactness tests (batched == alone, cached == uncached) compare a row's arithmetic inside batches of
    different sizes. OpenBLAS's FMA kernels, which engine/cpu_blas.py picks on an x86 CPU (HASWELL without AVX-512,
    SKYLAKEX with it), round a row differently as the batch grows (up to 5e-5 on a 64x576 @ 576x1536 matmul on an
    AMD EPYC: enough to move a 4-bit KV value to the next level; on an AVX-512 EPYC from 5 rows on, even at the tiny
    models' 64 wide, under either kernel). Its AVX kernels (SANDYBRIDGE) gave every row and column the same bits,
    but on a newer CPU they leave the vector registers' upper halves dirty on the thread that called them, and MLX's
    exp, sin and erf ran ~50x slower there after any float32 matmul (an exp of 1M floats 750 ms against 15; a tiny
    FLUX.2 image 20 s against 1.5). Its SSE kernels for VIA's Nano (NANO) give every row and column the same bits
    too, and leave the registers clean, at ~1/2 of SANDYBRIDGE's speed (61 against 108-122 GFLOP/s here; NEHALEM's
    rounded rows and columns differently). A forced kernel runs the same instructions on any x86 CPU. The suite (and
    the engine processes it starts) runs on those, over an OPENBLAS_CORETYPE the machine sets (one CI machine set
    Haswell for every process); servers keep the fastest. ORCHARD_TEST_OPENBLAS_CORETYPE runs the suite on others."""
    if os.environ.get("ORCHARD_TEST_OPENBLAS_CORETYPE"):
        os.environ["OPENBLAS_CORETYPE"] = os.environ["ORCHARD_TEST_OPENBLAS_CORETYPE"]
        return
    if platform.machine() != "x86_64":
        return
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return
    if "sse4_1" in flags.split():
        os.environ["OPENBLAS_CORETYPE"] = "NANO"


_pin_batch_invariant_blas()  # before the engine picks the BLAS (and reads OPENBLAS_CORETYPE)
import engine  # noqa: E402,F401 - first: importing the engine picks the BLAS MLX will call, before anything imports MLX

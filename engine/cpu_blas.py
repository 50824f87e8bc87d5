"""Which BLAS MLX's CPU backend calls, chosen once per process before MLX loads.

MLX's Linux CPU wheel bundles the reference (netlib) BLAS: a 512x576x1536 float32 matmul ran at ~6 GFLOP/s there
against ~155 with the OS's OpenBLAS. Opening OpenBLAS with RTLD_GLOBAL before `mlx.core` is imported puts its
`cblas_sgemm` ahead of the bundled one in every later symbol lookup, so MLX's float32 matmuls run on it. The engine
package does this at import (engine/__init__.py), so every process that runs an engine (the engine process, the CLI,
tests, benchmarks) gets it before any of its modules imports MLX. No MLX import here.

ORCHARD_BLAS picks: unset or "auto" (OpenBLAS where the OS has it), "bundled" (MLX's own), or a library's path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

BLAS_VARIABLE = "ORCHARD_BLAS"
# Debian/Ubuntu's threaded build first (apt: libopenblas0-pthread), then what ldconfig and other layouts hold.
_SEARCH = (
    "/usr/lib/{arch}-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/{arch}-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
    "/usr/local/lib/libopenblas.so.0",
)
# How a user gets the fast path; shown by `orchard doctor`, the engine's log and scripts/install.sh.
INSTALL_HINT = ("install OpenBLAS for a ~25x faster float32 matmul on the CPU: `sudo apt-get install "
                "libopenblas0-pthread` (Debian/Ubuntu), `sudo dnf install openblas` (Fedora)")


@dataclass(frozen=True)
class BlasChoice:
    """The BLAS this process's MLX calls (float32 matmuls on the CPU backend)."""

    name: str  # "OpenBLAS", "MLX's bundled reference BLAS", "Accelerate"
    path: str | None = None  # the library opened, where one was
    detail: str = ""  # its build configuration (OpenBLAS's openblas_get_config) or why it was not used
    optimized: bool = False

    def describe(self) -> str:
        where = f" ({self.path})" if self.path else ""
        return f"{self.name}{where}" + (f": {self.detail}" if self.detail else "")


_chosen: BlasChoice | None = None


def choose_blas() -> BlasChoice:
    """Open the BLAS MLX should call, once per process (later calls return the first answer)."""
    global _chosen
    if _chosen is None:
        _chosen = _choose(os.environ.get(BLAS_VARIABLE, "auto").strip() or "auto")
    return _chosen


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """OpenBLAS on one thread inside (else nothing changes): a measurement that compares it with MLX's own
    one-thread loops then holds on a busy CPU, where a multi-threaded call waits for every thread's time slice."""
    choice = choose_blas()
    library = ctypes.CDLL(choice.path) if choice.name == "OpenBLAS" and choice.path else None
    get = getattr(library, "openblas_get_num_threads", None)
    put = getattr(library, "openblas_set_num_threads", None)
    if get is None or put is None:
        yield
        return
    threads = int(get())
    put(1)
    try:
        yield
    finally:
        put(threads)


def _choose(setting: str) -> BlasChoice:
    if sys.platform == "darwin":
        return BlasChoice("Accelerate", detail="MLX's own on macOS", optimized=True)
    if setting == "bundled":
        return _bundled(f"{BLAS_VARIABLE}=bundled")
    if "mlx.core" in sys.modules:  # MLX may already have bound the bundled library's symbols
        return _bundled("MLX was imported before the engine package chose a BLAS")
    candidates = [setting] if setting != "auto" else _candidates()
    for path in candidates:
        choice = _open(path)
        if choice is not None:
            return choice
    if setting != "auto":
        return _bundled(f"{BLAS_VARIABLE}={setting} is not a BLAS library with cblas_sgemm")
    return _bundled(f"no OpenBLAS found; {INSTALL_HINT}")


def _bundled(why: str) -> BlasChoice:
    return BlasChoice("MLX's bundled reference BLAS", detail=why)


def _candidates() -> list[str]:
    arch = platform.machine()
    found = [p.format(arch=arch) for p in _SEARCH]
    by_name = ctypes.util.find_library("openblas")
    return [p for p in dict.fromkeys(found + ([by_name] if by_name else []))]


def _open(path: str) -> BlasChoice | None:
    if os.sep in path and not Path(path).is_file():
        return None
    _name_core_type()
    try:
        library = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None
    if not hasattr(library, "cblas_sgemm"):
        return None
    return BlasChoice("OpenBLAS", path=path, detail=_openblas_config(library), optimized=True)


def _name_core_type() -> None:
    """Tell OpenBLAS which x86 kernels to use where it would not know: its runtime detection reads the CPU's model
    number, and on a virtual machine reporting a generic "Intel Xeon Processor" it fell back to its oldest kernels
    ("Prescott": 30 GFLOP/s for the float32 matmul above, against ~155 with SkylakeX on the same 2 cores). The CPU's
    own feature flags say which it can run; an OPENBLAS_CORETYPE the user set wins."""
    if "OPENBLAS_CORETYPE" in os.environ or platform.machine() != "x86_64":
        return
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return
    flags = next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        os.environ["OPENBLAS_CORETYPE"] = "SKYLAKEX"
    elif {"avx2", "fma"} <= flags:
        os.environ["OPENBLAS_CORETYPE"] = "HASWELL"


def _openblas_config(library: ctypes.CDLL) -> str:
    get_config = getattr(library, "openblas_get_config", None)
    if get_config is None:
        return ""
    get_config.restype = ctypes.c_char_p
    return (get_config() or b"").decode(errors="replace").strip()

"""On MLX's CPU backend the engine computes in float32 where its matmuls are clearly faster (engine/models/cpu_compute.py),
with OpenBLAS under MLX where the OS has it (engine/cpu_blas.py): the choice, what it does to the weights and KV, and
that the model still predicts what it did."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.cpu_blas import choose_blas
from engine.models.cpu_compute import stored_form
from engine.models.loader import load_model
from tests.support.random_model import make_random_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cpu-compute")
    return {"bfloat16": str(make_random_model(root / "bf16", "small-hd64", "bfloat16")),
            "4-bit": str(make_random_model(root / "q4", "small-hd64", "bfloat16", quantize_bits=4))}


def test_the_engine_picked_openblas_before_mlx_loaded():
    # tests/__init__.py imports the engine first, as deployments/ and bench/ do; install.sh puts OpenBLAS on Linux.
    blas = choose_blas()
    assert blas.optimized, f"MLX's float32 matmuls run on {blas.describe()}"


def test_openblas_runs_kernels_this_cpu_has_even_when_it_cannot_name_the_cpu():
    """On a VM reporting a generic Xeon, OpenBLAS's own detection fell back to Prescott (30 against 160 GFLOP/s). The
    suite pins other kernels (tests/__init__.py), so a fresh engine process without that pin says what a server gets."""
    env = {key: value for key, value in os.environ.items() if key != "OPENBLAS_CORETYPE"}
    probe = "from engine.cpu_blas import choose_blas; b = choose_blas(); print(b.name); print(b.detail)"
    done = subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    name, detail = done.stdout.splitlines()[:2]
    if name != "OpenBLAS" or "DYNAMIC_ARCH" not in detail:
        pytest.skip(f"not a runtime-dispatching OpenBLAS: {name}: {detail}")
    flags = next(line for line in open("/proc/cpuinfo", encoding="utf-8") if line.startswith("flags")).split()
    if "avx2" in flags and "fma" in flags:
        assert any(core in detail for core in ("Haswell", "SkylakeX")), detail


@pytest.mark.parametrize("stored", ["bfloat16", "4-bit"])
def test_a_model_of_unset_dtype_computes_its_stored_weights_in_float32(folders, stored):
    as_stored = load_model(folders[stored], dtype="bfloat16")  # a dtype given: no choice made (a quantized one stays so)
    chosen = load_model(folders[stored])
    assert stored_form(as_stored.model).label == stored
    # With OpenBLAS a float32 matmul runs ~25x a bf16 one here and far more than a quantized one: clearly faster.
    assert stored_form(chosen.model).label == "float32"
    # The stored weights' values exactly (a quantized layer dequantized with float32 scales), computed in float32: as
    # the stored model computed in float32 (dtype float32 keeps the quantization, casting only its scales).
    reference = load_model(folders[stored], dtype="float32")
    prompt = mx.array([[5, 17, 42, 99, 3, 250, 7, 64]])
    assert mx.allclose(chosen.model(prompt), reference.model(prompt), atol=1e-4).item()


def test_the_kv_budget_counts_float32_kv(folders):
    bf16 = EngineCore(load_model(folders["bfloat16"], dtype="bfloat16"), EngineConfig(kv_budget_bytes=1 << 30))
    f32 = EngineCore(load_model(folders["bfloat16"]), EngineConfig(kv_budget_bytes=1 << 30))
    assert f32.stats().kv_bytes_per_token == 2 * bf16.stats().kv_bytes_per_token
    bf16.close()
    f32.close()


def test_the_choice_measures_openblas_on_one_thread_and_gives_its_threads_back():
    """Beside other busy processes a multi-threaded BLAS call waits for every thread's time slice: float32 measured on
    2 threads lost to bf16 in 2 loads of 3 with 3 busy processes on this 2-core box; on one thread it held."""
    import ctypes

    from engine.cpu_blas import one_blas_thread

    blas = choose_blas()
    if blas.name != "OpenBLAS":
        pytest.skip(f"not OpenBLAS: {blas.describe()}")
    library = ctypes.CDLL(blas.path)
    before = library.openblas_get_num_threads()
    with one_blas_thread():
        assert library.openblas_get_num_threads() == 1
    assert library.openblas_get_num_threads() == before

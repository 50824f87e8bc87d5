"""On MLX's CPU backend, run a model in the dtype whose matmuls are fastest here, measured at load.

MLX's CPU backend sends float32 matmuls to BLAS (OpenBLAS where engine/cpu_blas.py found it: ~155 GFLOP/s on a
2-core x86 box) while bfloat16/float16 and quantized matmuls run MLX's own loops (~6 GFLOP/s): there a bf16 model
computes ~25x faster cast to float32, and a quantized one dequantized. The choice is measured on the model's own
largest projection, at a decode row and at a prefill chunk, and kept only when it wins clearly and fits memory.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import dequantize_model

from engine.cpu_blas import choose_blas, one_blas_thread
from engine.device_memory import device_memory_bytes, on_gpu

logger = logging.getLogger(__name__)

# float32 must beat the stored dtype by this much (a margin over timing noise keeps the choice stable between loads).
FLOAT32_MARGIN = 1.3
# float32 weights may take at most this share of the machine's memory (the rest: KV, activations, other models).
FLOAT32_MEMORY_SHARE = 0.5
# The rows of the measured matmuls: one decode row and one prefill chunk.
MEASURED_ROWS = (1, 128)
# Runs of each form, the forms taking turns, OpenBLAS on one thread like MLX's own loops: on a busy CPU a
# multi-threaded BLAS call waits for every thread's time slice (2-core box, 3 busy processes beside: float32's best
# of 3 took 3.8-16 ms against 0.4 alone, and 2 loads of 3 kept bf16), so only a one-thread comparison holds there.
REPEATS = 5


@dataclass(frozen=True)
class CpuCompute:
    """What load_model chose for a model on the CPU backend, with the figures it chose by."""

    stored: str  # "bfloat16", "float32", "4-bit", ...
    chosen: str  # the dtype the model now computes in (or `stored` where nothing changed)
    stored_ms: float  # the measured matmuls in the stored form
    float32_ms: float  # the same in float32
    reason: str

    @property
    def changed(self) -> bool:
        return self.chosen != self.stored


@dataclass(frozen=True)
class StoredForm:
    """How a model's linear layers hold their weights: dtype, or quantization (bits > 0)."""

    label: str  # "bfloat16", "4-bit", ...
    dtype: mx.Dtype  # of activations (a quantized layer's scales)
    bits: int = 0
    group_size: int = 64
    mode: str = "affine"


FLOAT32 = StoredForm("float32", mx.float32)


def choose_cpu_compute(model: nn.Module, config: dict[str, Any]) -> CpuCompute | None:
    """Cast (or dequantize) `model` to float32 where that is clearly faster on this CPU and fits memory; None on a
    GPU backend (nothing to choose there)."""
    if on_gpu():
        return None
    choice = _measure(model, config)
    if choice.changed:
        model.set_dtype(mx.float32)  # a quantized layer's scales and biases first: it then dequantizes exactly
        if _is_quantized(model):
            dequantize_model(model)
        mx.eval(model.parameters())
    logger.info("CPU compute: %s (BLAS: %s)", choice.reason, choose_blas().describe())
    return choice


def matmul_ms(rows: int, inner: int, outer: int, form: StoredForm) -> float:
    """The fastest of REPEATS runs of a [rows, inner] input through an inner -> outer linear layer in `form`, in ms."""
    return fastest_ms([_timed_matmul(rows, inner, outer, form)])[0]


def fastest_ms(runs: list[Callable[[], float]]) -> list[float]:
    """Each run's fastest of REPEATS, the runs taking turns (so that a busy spell slows them all alike), in ms."""
    best = [float("inf")] * len(runs)
    for _ in range(REPEATS):
        for i, run in enumerate(runs):
            best[i] = min(best[i], run())
    return [seconds * 1000 for seconds in best]


def _timed_matmul(rows: int, inner: int, outer: int, form: StoredForm) -> Callable[[], float]:
    """One run's seconds of a [rows, inner] input through an inner -> outer linear layer in `form` (built and run
    once here: the first call builds what later ones reuse)."""
    layer: nn.Module = nn.Linear(inner, outer, bias=False)
    if form.bits:
        layer = nn.QuantizedLinear.from_linear(layer, form.group_size, form.bits, mode=form.mode)
    layer.set_dtype(form.dtype)
    x = mx.random.normal((rows, inner)).astype(form.dtype)
    mx.eval(layer.parameters(), x, layer(x))

    def run() -> float:
        started = time.perf_counter()
        mx.eval(layer(x))
        return time.perf_counter() - started

    return run


def _measure(model: nn.Module, config: dict[str, Any]) -> CpuCompute:
    stored = stored_form(model)
    if stored.label == "float32":
        return CpuCompute(stored.label, stored.label, 0.0, 0.0, "float32 as stored")
    inner, outer = _projection_shape(config)
    runs = [_timed_matmul(rows, inner, outer, form) for form in (stored, FLOAT32) for rows in MEASURED_ROWS]
    with one_blas_thread():
        times = fastest_ms(runs)
    stored_ms, float32_ms = sum(times[:len(MEASURED_ROWS)]), sum(times[len(MEASURED_ROWS):])
    figures = (f"{inner}x{outer} matmuls at {'/'.join(map(str, MEASURED_ROWS))} rows: {stored.label} "
               f"{stored_ms:.1f} ms, float32 {float32_ms:.1f} ms")
    label = stored.label
    if float32_ms * FLOAT32_MARGIN >= stored_ms:
        return CpuCompute(label, label, stored_ms, float32_ms, f"kept {label} ({figures})")
    float32_bytes = _parameter_count(model) * 4
    if float32_bytes > FLOAT32_MEMORY_SHARE * device_memory_bytes():
        return CpuCompute(label, label, stored_ms, float32_ms,
                          f"kept {label}: float32 weights ({float32_bytes / 2**30:.1f} GiB) would not fit ({figures})")
    how = "dequantized to float32" if stored.bits else "cast to float32"
    speedup = stored_ms / float32_ms
    return CpuCompute(label, "float32", stored_ms, float32_ms, f"{how}, {speedup:.1f}x faster ({figures})")


def stored_form(model: nn.Module) -> StoredForm:
    for _, module in model.named_modules():
        if isinstance(module, nn.QuantizedLinear):
            mode = getattr(module, "mode", "affine")
            return StoredForm(f"{module.bits}-bit", module.scales.dtype, module.bits, module.group_size, mode)
        if isinstance(module, nn.Linear):
            return StoredForm(str(module.weight.dtype).rsplit(".", 1)[-1], module.weight.dtype)
    return FLOAT32  # no linear layer: nothing to measure


def _projection_shape(config: dict[str, Any]) -> tuple[int, int]:
    """The model's largest dense projection (hidden -> MLP width), from its config."""
    text = config.get("text_config") or config
    hidden = int(text.get("hidden_size") or text.get("d_model") or 1024)
    return hidden, int(text.get("intermediate_size") or 4 * hidden)


def _is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


def _parameter_count(model: nn.Module) -> int:
    """The model's weights as values (a quantized layer's packed uint32 holds 32 / bits of them)."""
    packed_bits = {f"{name}.weight": module.bits for name, module in model.named_modules()
                   if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    return sum(array.size * 32 // packed_bits[name] if name in packed_bits else array.size
               for name, array in tree_flatten(model.parameters()))

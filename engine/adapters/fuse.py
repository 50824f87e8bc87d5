"""Adapters applied to every request from load on (Bodega's `lora_paths` / `lora_scales`).

Several adapters stack: adapter i counts lora_scales[i] times (mflux's rule, where Bodega's names come from). A
float weight takes the update into itself, W += Σ lora_scale·scale·(A B)ᵀ, so serving costs nothing more. A
quantized weight cannot: re-quantizing W + ΔW loses a ΔW smaller than a quantization step (measured: the fused
4-bit model's error was larger than the adapter's whole effect), so there the base stays as it is and mlx-lm's
LoRALinear adds the update, the adapters' ranks side by side in one A and one B.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.tuner.lora import LoRALinear

from engine.adapters.weights import AdapterWeights, LoraDelta, read_adapter
from engine.errors import InvalidRequestError


@dataclass(frozen=True)
class LoadTimeAdapter:
    path: Path
    scale: float = 1.0  # Bodega's lora_scales entry


def lora_scales_for(paths: list[str], scales: list[float] | None) -> list[float]:
    """Bodega's pairing: no scales -> 1.0 each; otherwise one scale per path."""
    if not scales:
        return [1.0] * len(paths)
    if len(scales) != len(paths):
        raise InvalidRequestError(
            f"'lora_scales' has {len(scales)} entries for {len(paths)} lora_paths: give one scale per adapter",
            param="lora_scales")
    return list(scales)


def apply_load_time_adapters(model: nn.Module, adapters: list[LoadTimeAdapter]) -> list[AdapterWeights]:
    """Read every adapter (all are checked before any changes the model), then apply them; returns what was read."""
    read = [(read_adapter(adapter.path, model, "lora_paths"), adapter.scale) for adapter in adapters]
    by_module: dict[str, list[tuple[LoraDelta, float]]] = {}
    for weights, lora_scale in read:
        for path, delta in weights.deltas.items():
            by_module.setdefault(path, []).append((delta, lora_scale))
    modules = dict(model.named_modules())
    replaced = []
    for path, deltas in by_module.items():
        module = modules[path]
        if isinstance(module, nn.QuantizedLinear):
            replaced.append((path, _unfused(module, deltas)))
        else:
            _fuse_into(module, deltas)
    if replaced:
        model.update_modules(tree_unflatten(replaced))
    mx.eval(model.parameters())
    return [weights for weights, _ in read]


def _fuse_into(linear: nn.Linear, deltas: list[tuple[LoraDelta, float]]) -> None:
    weight = linear.weight
    update = sum((lora_scale * delta.scale) * (delta.b.T @ delta.a.T) for delta, lora_scale in deltas)
    linear.weight = (weight.astype(mx.float32) + update).astype(weight.dtype)


def _unfused(quantized: nn.QuantizedLinear, deltas: list[tuple[LoraDelta, float]]) -> LoRALinear:
    rank = sum(delta.rank for delta, _ in deltas)
    lora = LoRALinear.from_base(quantized, r=rank, dropout=0.0, scale=1.0)
    lora.lora_a = mx.concatenate([delta.a for delta, _ in deltas], axis=1)
    lora.lora_b = mx.concatenate([(lora_scale * delta.scale) * delta.b for delta, lora_scale in deltas], axis=0)
    return lora


__all__ = ["LoadTimeAdapter", "apply_load_time_adapters", "lora_scales_for"]

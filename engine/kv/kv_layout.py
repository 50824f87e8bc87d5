"""How many bytes one token's KV takes in a model's caches, and the KV budget a model gets by default (MLX side)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from engine.device_memory import usable_memory_bytes
from engine.kv.batch_cache import new_request_cache
from engine.kv.quantized_kv import KVQuantization


def kv_bytes_per_token(model: Any, quantization: KVQuantization | None = None) -> int:
    """Bytes one position takes across every layer's cache: layers x KV heads x head dim x dtype size x 2 (keys and
    values), read from the caches the model really makes (its dtype, grouped-query heads, and any other cache type
    with keys growing along the position axis, quantized ones included) after a one-token forward. Sliding-window
    layers count as if they grew (an over-estimate past their window)."""
    caches = new_request_cache(model, quantization)
    mx.eval(model(mx.array([[0]], mx.uint32), cache=caches))
    total = 0.0
    for layer in (c for c in caches if hasattr(c, "keys")):  # recurrent layers (ArraysCache) do not grow
        for array in (a for _, a in tree_flatten(layer.state) if isinstance(a, mx.array) and a.ndim == 4):
            total += array.nbytes / array.shape[2]  # [batch, heads, positions, dim]: every position alike
    return max(1, round(total))


def default_kv_budget_bytes(memory_fraction: float, held_budgets_bytes: int) -> int:
    """`memory_fraction` of the memory an engine may use (device_memory.usable_memory_bytes), less what MLX holds now
    (call after the weights load: they and other models of this process are in it) and the other budgets it holds
    (prefix cache, kept vision features); at least 0."""
    usable = int(usable_memory_bytes() * memory_fraction)
    return max(0, usable - mx.get_active_memory() - held_budgets_bytes)


def prefill_memory_allowance_bytes(kv_budget_bytes: int, held_budgets_bytes: int) -> int:
    """What a forward may hold: the memory an engine may use less what MLX holds now (the weights), the running
    requests' KV budget and the other budgets it holds; at least 0."""
    return max(0, usable_memory_bytes() - mx.get_active_memory() - kv_budget_bytes - held_budgets_bytes)

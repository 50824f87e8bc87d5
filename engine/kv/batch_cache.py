"""Per-request and batched KV caches through mlx-lm's cache protocol.

A model's cache is a list with one object per layer (KVCache, RotatingKVCache,
ArraysCache, ...). Each of those types knows how to `merge` single-request caches
into its batched form, and batched forms know `filter`, `extend`, `extract`,
`prepare` and `finalize`; relying only on that protocol keeps every mlx-lm
architecture working unmodified.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from engine.kv.quantized_kv import KVQuantization, new_quantized_request_cache

LayerCaches = list[Any]


def new_request_cache(model: Any, quantization: KVQuantization | None = None) -> LayerCaches:
    if quantization is not None:
        return new_quantized_request_cache(model, quantization)
    return make_prompt_cache(model)


def merge_request_caches(caches: Sequence[LayerCaches]) -> LayerCaches:
    """Stack single-request caches into one batched cache per layer (left-padded)."""
    merged = []
    for layer, first in enumerate(caches[0]):
        if not hasattr(first, "merge"):
            raise TypeError(f"{type(first).__name__} cannot be batched (no merge in mlx-lm)")
        merged.append(first.merge([c[layer] for c in caches]))
    return merged


def extend_batch_cache(batch: LayerCaches, other: LayerCaches) -> LayerCaches:
    if not batch:
        return other
    for mine, theirs in zip(batch, other):
        mine.extend(theirs)
    return batch


def filter_batch_cache(batch: LayerCaches, keep_rows: list[int]) -> LayerCaches:
    if not keep_rows:
        return []
    for layer in batch:
        layer.filter(keep_rows)
    return batch


def extract_request_cache(batch: LayerCaches, row: int) -> LayerCaches:
    return [layer.extract(row) for layer in batch]


def cache_arrays(caches: LayerCaches) -> list[Any]:
    return [layer.state for layer in caches]


def cache_nbytes(caches: LayerCaches) -> int:
    return sum(layer.nbytes for layer in caches)


def eval_caches(caches: LayerCaches) -> None:
    mx.eval(cache_arrays(caches))

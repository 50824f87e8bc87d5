"""Quantized KV caches (config kv_bits / kv_group_size): per request through mlx-lm's QuantizedKVCache, batched
through our own BatchQuantizedKVCache.

mlx-lm 0.32 has no batched quantized cache. BatchQuantizedKVCache implements the cache protocol its attention
layers use (update_and_fetch returning quantized (packed, scales, biases) tuples, offset, make_mask with left
padding, bits / group_size, which switch mlx-lm's attention to quantized_scaled_dot_product_attention), laid out
like plain_batch.py's batches: rows right-aligned at a shared index, each row's left padding host-side, rows
joining and leaving in one pad / gather per array. Prefill forwards use it too (stacked_rows, row_cut). Quantization groups run along the head dimension, so a token's
quantized KV never depends on the other rows: a batched row holds exactly the bytes it held alone.

Only models whose every layer is a plain KVCache can quantize (Llama, Qwen, SmolLM, ...); sliding-window,
recurrent and vision models are refused at load.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from engine.errors import InvalidRequestError
from engine.kv.plain_batch import concat_rows, placed, row_arrays
from engine.kv.quantization import KV_BITS, KV_GROUP_SIZES, KVQuantization  # noqa: F401  (also this module's API)

LayerCaches = list[Any]
# (packed uint32 values, scales, biases), each [rows, heads, positions, ...]
Quantized = tuple[mx.array, mx.array, mx.array]

def new_quantized_request_cache(model: Any, quantization: KVQuantization) -> LayerCaches:
    """Per-request quantized caches (the model was checked once, at load: check_quantizable)."""
    return [QuantizedKVCache(quantization.group_size, quantization.bits) for _ in make_prompt_cache(model)]


def check_quantizable(model: Any, quantization: KVQuantization, vision: bool = False) -> None:
    """Refuse vision models, models whose caches are not all plain KVCaches, or whose head dimension the groups
    do not divide."""
    if vision:
        raise InvalidRequestError("'kv_bits' is not supported for vision-language models yet", param="kv_bits")
    if mx.cuda.is_available() and mx.default_device().type == mx.DeviceType.gpu:
        # Measured on an H100 (MLX 0.32.4): mlx-lm's quantized attention broadcasts the keys over query heads, and
        # CUDA's quantized_matmul has no kernel for that ("No implementation for problem shape: 16x16x128x16").
        raise InvalidRequestError(
            "'kv_bits' needs quantized attention, which MLX's CUDA backend cannot run yet; it works on Apple "
            "silicon (Metal) and on the CPU", param="kv_bits")
    layers = make_prompt_cache(model)
    kinds = sorted({type(layer).__name__ for layer in layers if type(layer) is not KVCache})
    if not layers or kinds:
        raise InvalidRequestError(
            f"'kv_bits' needs a model whose layers all use plain KV caches; this one uses {', '.join(kinds) or 'none'} "
            "(sliding-window, recurrent and hybrid caches cannot be quantized and batched yet)", param="kv_bits")
    head_dim = getattr(getattr(model, "args", None), "head_dim", None) or _head_dim(model)
    if head_dim is not None and head_dim % quantization.group_size:
        raise InvalidRequestError(
            f"'kv_group_size' {quantization.group_size} does not divide the model's head dimension {head_dim}",
            param="kv_group_size")


def _head_dim(model: Any) -> int | None:
    args = getattr(model, "args", None)
    hidden, heads = getattr(args, "hidden_size", None), getattr(args, "num_attention_heads", None)
    return hidden // heads if hidden and heads else None


def is_quantized_request_cache(cache: LayerCaches) -> bool:
    return bool(cache) and all(type(layer) is QuantizedKVCache for layer in cache)


def positions(x: Quantized, start: int, end: int) -> Quantized:
    """Positions [start, end) of quantized keys or values (lazy slices)."""
    return tuple(a[..., start:end, :] for a in x)


def copied_positions(x: Quantized, start: int, end: int) -> Quantized:
    """A copy of positions [start, end), which frees its source once evaluated."""
    return tuple(mx.array(a[..., start:end, :]) for a in x)


def concat_positions(parts: Sequence[Quantized]) -> Quantized:
    return tuple(mx.concatenate([p[i] for p in parts], axis=2) for i in range(3))


def filled_request_cache(quantization: KVQuantization, keys: Quantized, values: Quantized, length: int) -> QuantizedKVCache:
    cache = QuantizedKVCache(quantization.group_size, quantization.bits)
    cache.state = (keys, values, length, quantization.group_size, quantization.bits)
    return cache


def quantized_nbytes(tree: Any) -> int:
    return sum(a.nbytes for _, a in tree_flatten(tree))


class BatchQuantizedKVCache:
    """One layer's quantized KV of several rows, right-aligned at the shared index `_idx` (mlx-lm's cache protocol)."""

    step = 256

    def __init__(self, group_size: int, bits: int) -> None:
        self.group_size, self.bits = group_size, bits
        self.keys: Quantized | None = None
        self.values: Quantized | None = None
        self.offset = mx.array([], mx.int32)
        self.left_padding = mx.array([], mx.int32)
        self._idx = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Quantized, Quantized]:
        prev, num_steps = self._idx, keys.shape[2]
        if self.keys is None or prev + num_steps > self.keys[0].shape[2]:
            width = -(-(prev + num_steps) // self.step) * self.step
            if self.keys is None:  # a fresh batch (a prefill forward's rows at offset 0)
                self.keys, self.values = self._zeros(keys, width), self._zeros(values, width)
            else:
                self.keys, self.values = tree_map(
                    lambda x: placed(x[..., :prev, :], 0, width - prev), (self.keys, self.values))
        self._idx += num_steps
        self.offset = self.offset + num_steps
        new_keys = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        new_values = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for i in range(3):
            self.keys[i][..., prev : self._idx, :] = new_keys[i]
            self.values[i][..., prev : self._idx, :] = new_values[i]
        return positions(self.keys, 0, self._idx), positions(self.values, 0, self._idx)

    def _zeros(self, x: mx.array, width: int) -> Quantized:
        rows, heads, _, dim = x.shape
        packed = mx.zeros((rows, heads, width, dim * self.bits // 32), mx.uint32)
        scales = mx.zeros((rows, heads, width, dim // self.group_size), x.dtype)
        return packed, scales, mx.zeros_like(scales)

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    @property
    def state(self) -> tuple[Quantized, Quantized, mx.array, mx.array, int]:
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: tuple[Quantized, Quantized, mx.array, mx.array, int]) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    def is_trimmable(self) -> bool:
        return False  # speculative decoding (which trims) is refused with kv_bits

    @property
    def nbytes(self) -> int:
        return quantized_nbytes((self.keys, self.values))


def is_quantized_batch(batch: LayerCaches) -> bool:
    return bool(batch) and isinstance(batch[0], BatchQuantizedKVCache)


def append_rows(batch: LayerCaches, padding: list[int], joiners: Sequence[LayerCaches]) -> tuple[LayerCaches, list[int]]:
    """`batch` (BatchQuantizedKVCaches; may be empty) with the joiners' QuantizedKVCaches appended as rows, in
    order; returns the caches and the new padding (one entry per row)."""
    old_index = batch[0].size() if batch else 0
    old_width = batch[0].keys[0].shape[2] if batch else 0
    lengths = [cache[0].offset for cache in joiners]
    index = max([old_index, *lengths])
    # As plain_batch.append_rows with no room reserved (room=1): keep spare room, else make room for the next token.
    keep_width = index == old_index and old_width > index
    width = old_width if keep_width else -(-(index + 1) // BatchQuantizedKVCache.step) * BatchQuantizedKVCache.step
    new_padding = [p + index - old_index for p in padding] + [index - n for n in lengths]
    offsets, lefts = row_arrays(new_padding, index)
    first = joiners[0][0]
    caches = batch or [BatchQuantizedKVCache(first.group_size, first.bits) for _ in joiners[0]]
    for layer, cache in enumerate(caches):
        parts = []
        for which in ("keys", "values"):
            rows = []
            if batch:
                old = getattr(cache, which)
                rows.append(old if keep_width else tuple(placed(a[..., :old_index, :], index - old_index, width - index) for a in old))
            for joiner, n in zip(joiners, lengths):
                mine = positions(getattr(joiner[layer], which), 0, n)
                rows.append(tuple(placed(a, index - n, width - index) for a in mine))
            parts.append(tuple(concat_rows([row[i] for row in rows]) for i in range(3)))
        cache.state = (parts[0], parts[1], offsets, lefts, index)
    return caches, new_padding


def filter_rows(batch: LayerCaches, padding: list[int], keep_rows: list[int]) -> tuple[LayerCaches, list[int]]:
    """Only the rows `keep_rows`, with the padding every kept row shares cut off the left."""
    if not keep_rows:
        return [], []
    shift = min(padding[i] for i in keep_rows)
    new_padding = [padding[i] - shift for i in keep_rows]
    index = batch[0].size() - shift
    offsets, lefts = row_arrays(new_padding, index)
    gather = None if keep_rows == list(range(len(padding))) else mx.array(keep_rows, mx.int32)

    def kept(x: mx.array) -> mx.array:
        x = x[..., shift:, :] if shift else x
        return mx.take(x, gather, axis=0) if gather is not None else x

    for cache in batch:
        keys, values = tree_map(kept, (cache.keys, cache.values))
        cache.state = (keys, values, offsets, lefts, index)
    return batch, new_padding


def row_cache(batch: LayerCaches, padding: list[int], row: int) -> LayerCaches:
    """Row `row`'s KV as single-request QuantizedKVCaches (views of the batch: slice before it changes)."""
    out = []
    for layer in batch:
        start, index = padding[row], layer.size()
        keys, values = (tuple(a[row : row + 1, :, start:index, :] for a in x) for x in (layer.keys, layer.values))
        cache = QuantizedKVCache(layer.group_size, layer.bits)
        cache.state = (keys, values, index - start, layer.group_size, layer.bits)
        out.append(cache)
    return out


def stacked_rows(caches: Sequence[LayerCaches]) -> LayerCaches:
    """Request caches that all hold the same number of tokens as one batch with no padding (a prefill forward's
    rows, right-padded past their ends; cut them back with row_cut)."""
    if caches[0][0].offset:
        return append_rows([], [], caches)[0]
    fresh = []
    for layer in caches[0]:
        batch = BatchQuantizedKVCache(layer.group_size, layer.bits)
        batch.offset, batch.left_padding = mx.zeros((len(caches),), mx.int32), mx.zeros((len(caches),), mx.int32)
        fresh.append(batch)
    return fresh


def row_cut(batch: LayerCaches, row: int, length: int) -> LayerCaches:
    """Row `row` of an unpadded batch, its first `length` positions, as single-request QuantizedKVCaches."""
    return [
        filled_request_cache(KVQuantization(layer.bits, layer.group_size),
                             *(tuple(a[row : row + 1, :, :length, :] for a in x) for x in (layer.keys, layer.values)),
                             length)
        for layer in batch
    ]

"""Short multi-position forwards that attend over a KV cache's whole allocated buffer, its unwritten tail masked.

MLX's CUDA backend runs half-precision attention of more than one query through cuDNN and builds a graph for
every new (queries, keys) shape: a verifying forward of 1 + K positions meets a new key length every step, and
the build (~50 ms on an H100, against ~9 ms for a plain 8B decode step) swamps what drafting saves. mlx-lm's
caches allocate their buffers in steps of 256 positions, so attending over the whole buffer meets a new shape
once per growth. MLX does the same itself for single-position decoding (`unslice_kv` in its CUDA SDPA).
The masked positions get zero weight, so the output is that of the exact-length forward.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

LayerCaches = list[Any]


def builds_attention_per_shape(dtype: mx.Dtype) -> bool:
    """Whether multi-query attention in this dtype builds a kernel graph per shape on this device (CUDA, half)."""
    return mx.cuda.is_available() and mx.default_device().type == mx.gpu and dtype in (mx.bfloat16, mx.float16)


def forward_caches(caches: LayerCaches, num_positions: int) -> LayerCaches:
    """The caches a short forward of `num_positions` should run on: whole-buffer views where multi-query
    attention builds per shape and the buffers have room, else the caches themselves."""
    if num_positions < 2 or not caches or caches[0].empty() or not builds_attention_per_shape(caches[0].keys.dtype):
        return caches
    return whole_buffer_caches(caches, num_positions) or caches


def whole_buffer_caches(caches: LayerCaches, num_positions: int) -> LayerCaches | None:
    """Every layer seen through its whole buffer for a forward of `num_positions`, or None when some buffer lacks
    room for them (that forward grows the buffers, so it runs on the caches themselves)."""
    for layer in caches:
        if layer.empty() or layer.size() + num_positions > layer.keys.shape[2]:
            return None
    return [WholeBufferView(layer) for layer in caches]


class WholeBufferView:
    """One plain layer cache (KVCache or BatchKVCache) through mlx-lm's cache protocol, fetching the whole buffer."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer

    @property
    def offset(self) -> Any:
        return self.layer.offset

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        written = self.layer.size()
        mask = create_causal_mask(N, offset=written, window_size=window_size,
                                  left_padding=getattr(self.layer, "left_padding", None))
        unwritten = self.layer.keys.shape[2] - written - N
        return mx.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, unwritten)], constant_values=False)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.layer.update_and_fetch(keys, values)  # writes in place: whole_buffer_caches checked there is room
        return self.layer.keys, self.layer.values

    def __getattr__(self, name: str) -> Any:
        return getattr(self.layer, name)  # any other read a model makes (e.g. `keys`), from the cache itself

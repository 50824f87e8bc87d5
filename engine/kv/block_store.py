"""MLX side of the prefix cache: cut per-request KV into cached blocks and rebuild caches from them.

Models whose every layer uses mlx-lm's plain `KVCache` are cut by token position.
Sliding-window (`RotatingKVCache`) and recurrent (`ArraysCache`) layers cannot be cut:
for them a whole-cache snapshot is kept at the last block boundary of each prompt
(the scheduler ends a prefill chunk there), and a later prompt extending that block
prefix resumes from a copy of the snapshot.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import mlx.core as mx

from engine.device_memory import accelerator_memory_bytes
from engine.kv.batch_cache import LayerCaches, new_request_cache
from engine.kv.cache_manager import PrefixCache
from engine.kv.plain_batch import is_plain_request_cache
from engine.kv.quantized_kv import (
    KVQuantization, concat_positions, copied_positions, filled_request_cache, positions, quantized_nbytes,
)

FALLBACK_BUDGET_BYTES = 1 << 30
DEVICE_MEMORY_FRACTION = 0.1
BUFFER_CACHE_FRACTION = 0.05


def prefix_cache_mode(model: Any) -> str | None:
    """"blocks" (cut by position), "snapshots" (whole-cache copies) or None (cannot batch at all)."""
    layers = new_request_cache(model)
    if is_plain_request_cache(layers):
        return "blocks"
    if all(hasattr(layer, "merge") for layer in layers):
        return "snapshots"
    return None


def new_prefix_cache(model: Any, enabled: bool, block_size: int, budget_bytes: int | None) -> PrefixCache | None:
    """The model's prefix cache: blocks or snapshots by its cache types (None: off, or caches it cannot keep);
    budget_bytes None: a tenth of device memory."""
    mode = prefix_cache_mode(model) if enabled else None
    if mode is None:
        return None
    budget = budget_bytes if budget_bytes is not None else default_budget_bytes()
    return PrefixCache(block_size, budget, snapshot_only=mode == "snapshots")


def default_budget_bytes() -> int:
    """A tenth of the device's memory (unified memory on Apple silicon), else 1 GiB."""
    memory = accelerator_memory_bytes()
    return int(memory * DEVICE_MEMORY_FRACTION) if memory else FALLBACK_BUDGET_BYTES


def buffer_cache_limit_bytes() -> int:
    """Cap on MLX's cache of freed buffers: a twentieth of the device's memory, at least 1 GiB."""
    return max(FALLBACK_BUDGET_BYTES, int(accelerator_memory_bytes() * BUFFER_CACHE_FRACTION))


class KVBlockStore:
    def __init__(self, model: Any, cache: PrefixCache, quantization: KVQuantization | None = None) -> None:
        self.model = model
        self.cache = cache
        # With quantized KV, blocks hold each layer's quantized (packed, scales, biases) keys and values as stored.
        self.quantization = quantization
        # New blocks' copies, materialised together by flush(): one async_eval per block cost
        # more than the copies (~25 ms a step for 8 prompts of 512 tokens on an H100).
        self._unevaluated: list[Any] = []

    def flush(self) -> None:
        """Start materialising the blocks inserted since the last flush, off the critical path."""
        if self._unevaluated:
            mx.async_eval(self._unevaluated)
            self._unevaluated = []

    def request_cache(self, block_hashes: Sequence[int], tail_tokens: int = 0) -> LayerCaches:
        """A fresh per-request cache, pre-filled with the KV of the matched blocks (by hash: locked in the cache
        while their request runs); `tail_tokens` > 0: of the last block only its first tail_tokens positions."""
        blocks = [self.cache.block(block_hash) for block_hash in block_hashes]
        if blocks and self.cache.snapshot_only:
            return copy.deepcopy(blocks[-1].payload)
        caches = new_request_cache(self.model, self.quantization)
        if not blocks:
            return caches
        size = self.cache.block_size
        ends = [size] * len(blocks)
        if tail_tokens:
            ends[-1] = tail_tokens
        num_tokens = sum(ends)
        if self.quantization is not None:
            return [
                filled_request_cache(self.quantization, *(concat_positions(
                    [positions(b.payload[layer][which], 0, end) for b, end in zip(blocks, ends)])
                    for which in (0, 1)), num_tokens)
                for layer in range(len(caches))
            ]
        if all(isinstance(b.payload, mx.array) for b in blocks):
            # [layers, k/v, 1, heads, tokens, dim]
            stacked = mx.concatenate([_first(b.payload, end) for b, end in zip(blocks, ends)], axis=-2)
            for layer, layer_cache in enumerate(caches):
                layer_cache.state = (stacked[layer, 0], stacked[layer, 1], num_tokens)
            return caches
        for layer, layer_cache in enumerate(caches):
            keys = mx.concatenate([_first(b.payload[layer][0], end) for b, end in zip(blocks, ends)], axis=2)
            values = mx.concatenate([_first(b.payload[layer][1], end) for b, end in zip(blocks, ends)], axis=2)
            layer_cache.state = (keys, values, num_tokens)
        return caches

    def insert(self, token_ids: Sequence[int], caches: LayerCaches | Any) -> None:
        """Cache the full blocks of token_ids, whose KV is at the start of `caches`.

        `caches` may be a callable returning the caches, so that copy is made only when
        a block is actually new. New blocks always form the chain's tail, so their KV is
        gathered once, as one array over all layers, and each block copies its slice.
        Call flush() once the step's inserts are done.
        """
        block_size = self.cache.block_size
        num_blocks = len(token_ids) // block_size
        tail: list[tuple[int, Any]] = []  # (first new block index, gathered KV)

        def payload(index: int) -> tuple[Any, int]:
            if not tail:
                layers = caches() if callable(caches) else caches
                tail.append((index, _gather(layers, index * block_size, num_blocks * block_size)))
            first, gathered = tail[0]
            start, end = (index - first) * block_size, (index - first + 1) * block_size
            if isinstance(gathered, mx.array):
                block = mx.array(gathered[..., start:end, :])  # a copy: frees the source once evaluated
                nbytes = block.nbytes
                self._unevaluated.append(block)
            elif self.quantization is not None:
                block = [(copied_positions(k, start, end), copied_positions(v, start, end)) for k, v in gathered]
                nbytes = quantized_nbytes(block)
                self._unevaluated.extend(a for pair in block for part in pair for a in part)
            else:
                block = [(mx.array(k[..., start:end, :]), mx.array(v[..., start:end, :])) for k, v in gathered]
                nbytes = sum(k.nbytes + v.nbytes for k, v in block)
                self._unevaluated.extend(a for pair in block for a in pair)
            return block, nbytes

        self.cache.insert(token_ids, payload)

    def insert_rows(self, prompts: Sequence[Sequence[int]], batch: LayerCaches, rows: Sequence[int]) -> bool:
        """Cache the full blocks of several prompts whose KV is at the start of rows `rows` of one
        batched cache (a padded prefill forward): the rows are gathered over all layers in one copy,
        not one per prompt (on a GPU each layer's slice is a kernel launch). False, and nothing
        done, where the layers' shapes differ (use insert per prompt)."""
        block_size = self.cache.block_size
        end = max(len(p) // block_size for p in prompts) * block_size
        gathered = _gather(batch, 0, end)  # [layers, k/v, rows, heads, tokens, dim]; lazy until a block is new
        if not isinstance(gathered, mx.array):
            return False

        def payload_of(row: int):
            def payload(index: int) -> tuple[Any, int]:
                block = mx.array(gathered[:, :, row : row + 1, :, index * block_size : (index + 1) * block_size, :])
                self._unevaluated.append(block)
                return block, block.nbytes

            return payload

        for prompt, row in zip(prompts, rows):
            self.cache.insert(prompt, payload_of(row))
        return True

    def insert_snapshot(self, token_ids: Sequence[int], caches: LayerCaches) -> None:
        """Keep a copy of `caches`, which hold exactly token_ids (a whole number of blocks)."""
        assert len(token_ids) % self.cache.block_size == 0

        def snapshot(index: int) -> tuple[LayerCaches, int]:
            copied = copy.deepcopy(caches)
            mx.async_eval([layer.state for layer in copied])
            return copied, sum(layer.nbytes for layer in copied)

        self.cache.insert(token_ids, snapshot)


def _first(array: mx.array, end: int) -> mx.array:
    """Its first `end` positions (the axis before the last); the array itself when that is all of them."""
    return array if end == array.shape[-2] else array[..., :end, :]


def _gather(layers: LayerCaches, start: int, end: int) -> Any:
    """KV of tokens [start, end) of every layer: one [layers, 2, 1, heads, tokens, dim] array
    when all layers share a shape, else a list of per-layer (keys, values); quantized KV as per-layer
    (keys, values) of (packed, scales, biases)."""
    if isinstance(layers[0].keys, tuple):
        return [(positions(layer.keys, start, end), positions(layer.values, start, end)) for layer in layers]
    pairs = [(layer.keys[..., start:end, :], layer.values[..., start:end, :]) for layer in layers]
    shapes = {(k.shape, v.shape, k.dtype, v.dtype) for k, v in pairs}
    if len(shapes) == 1 and pairs[0][0].shape == pairs[0][1].shape:
        stacked = mx.stack([array for pair in pairs for array in pair])  # one copy, not one per layer
        return stacked.reshape(len(pairs), 2, *stacked.shape[1:])
    return pairs

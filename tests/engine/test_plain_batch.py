"""engine/kv/plain_batch.py against mlx-lm's own BatchKVCache merge / extend / filter / extract."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache

from engine.kv import plain_batch

LAYERS, HEADS, DIM = 2, 2, 4


def request_cache(length: int, seed: int) -> list[KVCache]:
    layers = []
    for layer in range(LAYERS):
        cache = KVCache()
        key = mx.random.key(seed * 10 + layer)
        keys = mx.random.normal((1, HEADS, length, DIM), key=key)
        cache.update_and_fetch(keys, keys * 2 + 1)
        layers.append(cache)
    return layers


def reference_batch(requests: list[list[KVCache]]) -> list[BatchKVCache]:
    return [BatchKVCache.merge([r[layer] for r in requests]) for layer in range(LAYERS)]


def assert_same_rows(ours: list[BatchKVCache], padding: list[int], ref: list[BatchKVCache]) -> None:
    """Every row holds the same real KV at the same positions, with the same offsets and padding."""
    assert padding == ref[0].left_padding.tolist()
    for mine, theirs in zip(ours, ref):
        assert mine.state[4] == theirs.state[4]  # the shared index
        assert mine.offset.tolist() == theirs.offset.tolist()
        assert mine.left_padding.tolist() == padding
        for row, start in enumerate(padding):
            for which in (0, 1):
                a = np.array(mine.state[which][row, :, start : mine.state[4]])
                b = np.array(theirs.state[which][row, :, start : theirs.state[4]])
                np.testing.assert_array_equal(a, b)


def decode_step(batches: list[list[BatchKVCache]], seed: int) -> None:
    """The same new token's KV written into each batch, as a model forward would."""
    rows = batches[0][0].offset.shape[0]
    for layer in range(LAYERS):
        new = mx.random.normal((rows, HEADS, 1, DIM), key=mx.random.key(1000 + seed * 10 + layer))
        for batch in batches:
            batch[layer].update_and_fetch(new, new - 3)


def test_joins_leaves_and_extracts_match_mlx_lm():
    first = [request_cache(n, seed) for seed, n in enumerate((5, 9, 3))]
    ours, padding = plain_batch.append_rows([], [], first)
    ref = reference_batch(first)
    assert_same_rows(ours, padding, ref)
    decode_step([ours, ref], seed=1)
    decode_step([ours, ref], seed=2)
    assert_same_rows(ours, padding, ref)

    # The longest row leaves: both cut the padding every kept row shares.
    ours, padding = plain_batch.filter_rows(ours, padding, [0, 2])
    for layer in ref:
        layer.filter([0, 2])
    assert_same_rows(ours, padding, ref)

    # A joiner longer than the batch (the batch is re-padded), then two shorter ones of equal length.
    for joiners, seed in (([request_cache(30, 7)], 3), ([request_cache(4, 8), request_cache(4, 9)], 4)):
        ours, padding = plain_batch.append_rows(ours, padding, joiners)
        for layer, merged in zip(ref, reference_batch(joiners)):
            layer.extend(merged)
        assert_same_rows(ours, padding, ref)
        decode_step([ours, ref], seed=seed)
        assert_same_rows(ours, padding, ref)

    for row in range(len(padding)):
        extracted = plain_batch.row_cache(ours, padding, row)
        for mine, theirs in zip(extracted, (layer.extract(row) for layer in ref)):
            assert mine.offset == theirs.offset
            np.testing.assert_array_equal(np.array(mine.keys), np.array(theirs.keys))
            np.testing.assert_array_equal(np.array(mine.values), np.array(theirs.values))


def test_a_join_keeps_spare_room_so_the_next_token_does_not_regrow_the_batch():
    ours, padding = plain_batch.append_rows([], [], [request_cache(6, 1), request_cache(2, 2)])
    width = ours[0].state[0].shape[2]
    assert width == BatchKVCache.step  # room for the next tokens
    decode_step([ours], seed=5)
    assert ours[0].state[0].shape[2] == width and ours[0].state[4] == 7
    ours, padding = plain_batch.append_rows(ours, padding, [request_cache(3, 3)])
    assert ours[0].state[0].shape[2] == width and padding == [0, 4, 4]

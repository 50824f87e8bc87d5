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


def blocks(requests: list[list[KVCache]]) -> list[plain_batch.RowBlock]:
    return [plain_batch.RowBlock.of_request(r) for r in requests]


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
    ours, padding = plain_batch.append_rows([], [], blocks(first))
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
        ours, padding = plain_batch.append_rows(ours, padding, blocks(joiners))
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
    ours, padding = plain_batch.append_rows([], [], blocks([request_cache(6, 1), request_cache(2, 2)]))
    width = ours[0].state[0].shape[2]
    assert width == BatchKVCache.step  # room for the next tokens
    decode_step([ours], seed=5)
    assert ours[0].state[0].shape[2] == width and ours[0].state[4] == 7
    ours, padding = plain_batch.append_rows(ours, padding, blocks([request_cache(3, 3)]))
    assert ours[0].state[0].shape[2] == width and padding == [0, 4, 4]


def test_a_join_reserves_the_rows_room_so_decoding_them_never_regrows_the_batch():
    # Rows at index 250 that will write 40 more positions: mlx-lm's step boundary (256) would make the batch
    # grow (copy every layer) 6 tokens in; the join lays the buffers out with the room instead, in a whole number
    # of WIDTH_QUANTUM positions (290 -> 320).
    first = [request_cache(250, 1), request_cache(240, 2)]
    ours, padding = plain_batch.append_rows([], [], blocks(first), room=40)
    ref = reference_batch(first)
    assert ours[0].state[0].shape[2] == 320 and plain_batch.WIDTH_QUANTUM == 32
    buffers = [id(layer.keys) for layer in ours]
    for step in range(40):
        decode_step([ours, ref], seed=20 + step)
    assert [id(layer.keys) for layer in ours] == buffers  # written in place: no growth
    assert_same_rows(ours, padding, ref)

    # A joiner while rows are left to write: kept when the buffers hold the room, laid out anew when not; never
    # more than one allocation step past the index (what kv/budget.py counts), however much room is asked.
    ours, padding = plain_batch.append_rows([], [], blocks(first), room=40)
    ours, padding = plain_batch.append_rows(ours, padding, blocks([request_cache(30, 3)]), room=70)
    assert ours[0].state[0].shape[2] == 320
    ours, padding = plain_batch.append_rows(ours, padding, blocks([request_cache(30, 4)]), room=100)
    assert ours[0].state[0].shape[2] == 352
    ours, padding = plain_batch.append_rows([], [], blocks(first), room=10_000)
    assert ours[0].state[0].shape[2] == 480  # the last whole quantum within 250 + BatchKVCache.step
    ours, padding = plain_batch.append_rows([], [], blocks([request_cache(6, 1)]), room=0)
    assert ours[0].state[0].shape[2] == BatchKVCache.step  # at least the next step boundary, as before


def stacked(requests: list[list[KVCache]], spare: int) -> list[KVCache]:
    """The requests' KV as rows of one plain batched cache per layer, `spare` padded positions beyond
    (as a padded prefill forward leaves them)."""
    out = []
    for layer in range(LAYERS):
        cache = KVCache()
        keys = mx.concatenate([r[layer].keys[..., : r[layer].offset, :] for r in requests])
        values = mx.concatenate([r[layer].values[..., : r[layer].offset, :] for r in requests])
        cache.state = (mx.pad(keys, [(0, 0), (0, 0), (0, spare), (0, 0)]), mx.pad(values, [(0, 0), (0, 0), (0, spare), (0, 0)]),
                       keys.shape[2])
        out.append(cache)
    return out


def test_rows_of_one_batched_cache_join_as_one_block_like_separate_requests():
    base = [request_cache(7, 1), request_cache(3, 2)]
    burst = [request_cache(5, seed) for seed in (3, 4, 5, 6)]
    batch = stacked(burst, spare=3)
    rows = [plain_batch.RowBlock(batch, i, i + 1, 5) for i in range(4)]
    merged = plain_batch.merged_blocks([rows[1], rows[2], rows[3], rows[0]])
    assert [(b.start, b.stop) for b in merged] == [(1, 4), (0, 1)]
    ours, padding = plain_batch.append_rows([], [], blocks(base))
    ours, padding = plain_batch.append_rows(ours, padding, merged)
    ref = reference_batch(base)
    for layer, joined in zip(ref, reference_batch([burst[1], burst[2], burst[3], burst[0]])):
        layer.extend(joined)
    assert_same_rows(ours, padding, ref)
    decode_step([ours, ref], seed=7)
    assert_same_rows(ours, padding, ref)


def test_dropping_row_tails_keeps_each_rows_accepted_kv_right_aligned():
    # Rows of 5, 9 and 3 tokens each verify 4 positions, then keep 4, 1 and 2 of them (drop 0, 3 and 2).
    requests = [request_cache(n, seed) for seed, n in enumerate((5, 9, 3))]
    caches, padding = plain_batch.append_rows([], [], blocks(requests))
    written = [request_cache(4, 10 + row) for row in range(3)]
    for layer, cache in enumerate(caches):
        keys = mx.concatenate([w[layer].keys[..., :4, :] for w in written])
        cache.update_and_fetch(keys, keys * 2 + 1)
    padding = plain_batch.drop_row_tails(caches, padding, [0, 3, 2])
    kept = [4, 1, 2]
    for row, (request, new) in enumerate(zip(requests, written)):
        got = plain_batch.row_cache(caches, padding, row)
        for layer in range(LAYERS):
            expected = mx.concatenate([request[layer].keys[..., : request[layer].offset, :], new[layer].keys[..., : kept[row], :]], axis=2)
            assert got[layer].offset == expected.shape[2]
            np.testing.assert_array_equal(np.array(got[layer].keys), np.array(expected))
            np.testing.assert_array_equal(np.array(got[layer].values), np.array(expected * 2 + 1))
    # Offsets and padding agree with the shared index, and the buffers kept their width (no regrowth next step).
    index = caches[0].state[4]
    assert caches[0].offset.tolist() == [index - p for p in padding] and caches[0].left_padding.tolist() == padding
    assert caches[0].keys.shape[2] >= index + 1


def test_joiners_written_over_free_rows_hold_what_a_rebuilt_batch_holds():
    # Rows 1 and 3 of four are free (their requests left); two joiners of other lengths take them in place.
    first = [request_cache(n, seed) for seed, n in enumerate((6, 4, 9, 5))]
    ours, padding = plain_batch.append_rows([], [], blocks(first), room=4)
    joiners = [request_cache(n, 10 + seed) for seed, n in enumerate((7, 2))]
    assert plain_batch.fits_in_place(ours, blocks(joiners), room=4)
    assert not plain_batch.fits_in_place(ours, blocks([request_cache(10, 20)]), room=4)  # longer than the index
    buffer = ours[0].state[0]
    padding = plain_batch.fill_rows(ours, padding, [1, 3], blocks(joiners))
    assert ours[0].state[0] is buffer  # the same array: written, not rebuilt
    ref = reference_batch([first[0], joiners[0], first[2], joiners[1]])
    assert_same_rows(ours, padding, ref)
    decode_step([ours, ref], seed=1)
    assert_same_rows(ours, padding, ref)


def test_vacant_rows_show_one_position_of_zero_kv_until_a_joiner_takes_one():
    first = [request_cache(n, seed) for seed, n in enumerate((3, 5))]
    ours, padding = plain_batch.append_rows([], [], blocks(first), room=2, vacant=2)
    assert padding == [2, 0, 4, 4] and ours[0].offset.tolist() == [3, 5, 1, 1]
    for layer in ours:
        for which in (0, 1):
            np.testing.assert_array_equal(np.array(layer.state[which][2:]), 0)
    joiner = request_cache(4, 30)
    padding = plain_batch.fill_rows(ours, padding, [2], blocks([joiner]))
    assert padding == [2, 0, 1, 4] and ours[0].offset.tolist() == [3, 5, 4, 1]
    for row, request in enumerate([*first, joiner]):
        assert_row_holds(ours, padding, row, request)


def assert_row_holds(batch: list[BatchKVCache], padding: list[int], row: int, request: list[KVCache]) -> None:
    for mine, theirs in zip(batch, request):
        for which in (0, 1):
            a = np.array(mine.state[which][row, :, padding[row] : mine.state[4]])
            np.testing.assert_array_equal(a, np.array(theirs.state[which][0, :, : theirs.offset]))

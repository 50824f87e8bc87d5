"""Decode batches of models whose layers are all plain KV caches, built without device syncs.

mlx-lm's `BatchKVCache` keeps rows right-aligned at a shared index `_idx`, each row's left
padding in a device array. Its own `filter` and `extract` read that array back (one device
sync per layer: on an H100 a step that drops 8 of 128 rows took ~50 ms against ~10 ms), and
`merge` + `extend` copy the batch twice. Here the left padding lives host-side, shared by
every layer (all layers see the same joins and leaves), and the caches are rebuilt through
`BatchKVCache`'s public `state`: rows join in one pad + concatenate per layer, leave in one
gather, and a leaving row's KV is sliced with no read-back. The model still runs on mlx-lm's
`BatchKVCache` (its `update_and_fetch` and mask).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

LayerCaches = list[Any]


def is_plain_request_cache(cache: LayerCaches) -> bool:
    return bool(cache) and all(type(layer) is KVCache for layer in cache)


@dataclass(frozen=True)
class RowBlock:
    """Rows [start, stop) of plain KVCaches (one per layer), each holding `length` tokens: joiners
    whose KV already sits together (a padded prefill forward's rows) join with one slice per layer,
    not one per row (on a GPU each is a kernel launch: 32 rows took ~20 ms on an H100)."""

    caches: LayerCaches
    start: int
    stop: int
    length: int

    @classmethod
    def of_request(cls, cache: LayerCaches) -> "RowBlock":
        return cls(cache, 0, 1, cache[0].offset)

    @property
    def num_rows(self) -> int:
        return self.stop - self.start

    def continues(self, previous: "RowBlock") -> bool:
        """Whether these rows directly follow `previous`'s in the same caches, at the same length."""
        return self.caches is previous.caches and self.start == previous.stop and self.length == previous.length


def merged_blocks(blocks: Sequence[RowBlock]) -> list[RowBlock]:
    """Consecutive blocks of adjacent rows of the same caches, merged."""
    merged: list[RowBlock] = []
    for block in blocks:
        if merged and block.continues(merged[-1]):
            last = merged[-1]
            merged[-1] = RowBlock(last.caches, last.start, block.stop, last.length)
        else:
            merged.append(block)
    return merged


def append_rows(
    batch: LayerCaches, padding: list[int], joiners: Sequence[RowBlock], room: int = 1, vacant: int = 0
) -> tuple[LayerCaches, list[int]]:
    """`batch` (BatchKVCaches with rows' left `padding`; may be empty) with the joiners' rows
    appended, in order, then `vacant` rows for joiners to come (fill_rows); returns the caches and the new
    padding (one entry per row). `room`: the positions the batch's rows will still write (their most tokens
    left), reserved up to one step."""
    old_index, old_width = _index(batch), (batch[0].state[0].shape[2] if batch else 0)
    lengths = [block.length for block in joiners]
    index = max([old_index, *lengths])
    # Keep the batch's buffers when they hold the room; else lay them out anew with it (the joiners' rows are
    # copied in either way).
    keep_width = index == old_index and old_width >= index + reserved(room)
    width = old_width if keep_width else batch_width(index, room)
    # A vacant row shows one position of zero KV: a row with none would take a softmax over nothing (NaN).
    new_padding = ([p + index - old_index for p in padding]
                   + [index - b.length for b in joiners for _ in range(b.num_rows)] + [index - 1] * vacant)
    offsets, lefts = row_arrays(new_padding, index)
    caches = batch or [BatchKVCache([]) for _ in joiners[0].caches]
    for layer, cache in enumerate(caches):
        parts = []
        for which in (0, 1):  # keys, values
            rows = []
            if batch:
                old = cache.state[which]
                rows.append(old if keep_width else placed(old[..., :old_index, :], index - old_index, width - index))
            rows += _placed_runs(joiners, layer, which, index, width)
            if vacant:
                rows.append(mx.zeros((vacant, *rows[-1].shape[1:]), rows[-1].dtype))
            parts.append(concat_rows(rows))
        cache.state = (parts[0], parts[1], offsets, lefts, index)
    return caches, new_padding


def fits_in_place(batch: LayerCaches, joiners: Sequence[RowBlock], room: int) -> bool:
    """Whether joiners can be written into rows of the batch as it is laid out: no prompt longer than its index,
    and its buffers hold the room its rows will write."""
    index = _index(batch)
    width = batch[0].state[0].shape[2] if batch else 0
    return bool(batch) and all(b.length <= index for b in joiners) and width >= index + reserved(room)


def fill_rows(batch: LayerCaches, padding: list[int], slots: list[int], joiners: Sequence[RowBlock]) -> list[int]:
    """The joiners' rows written over rows `slots` (rows no request holds), in order, in place: one scatter per
    layer's keys and values instead of copying the whole KV to a larger batch (fits_in_place holds). Returns the
    new padding; a slot's old KV left of its joiner's prompt is masked as padding."""
    index, width = _index(batch), batch[0].state[0].shape[2]
    new_padding = list(padding)
    for slot, length in zip(slots, [b.length for b in joiners for _ in range(b.num_rows)]):
        new_padding[slot] = index - length
    offsets, lefts = row_arrays(new_padding, index)
    contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
    where = slice(slots[0], slots[0] + len(slots)) if contiguous else mx.array(slots, mx.int32)
    for layer, cache in enumerate(batch):
        keys, values = cache.state[:2]
        for which, buffer in ((0, keys), (1, values)):
            buffer[where] = concat_rows(_placed_runs(joiners, layer, which, index, width))
        cache.state = (keys, values, offsets, lefts, index)
    return new_padding


def batch_width(index: int, room: int) -> int:
    """Positions to allocate for a batch at `index` whose rows will write `room` more: the next step boundary, or
    further, in multiples of WIDTH_QUANTUM up to one step past the index (what the KV budget counts, kv/budget.py).
    Room reserved here is room mlx-lm's update need not grow later: its growth copies every layer's whole KV (on an
    H200, 36-79 ms for the steps of 128 rows that crossed 256 positions, against ~15 ms for a step), while this join
    copies it anyway."""
    boundary = _round_up(index + 1, BatchKVCache.step)
    wanted = _round_up(index + reserved(room), WIDTH_QUANTUM)
    return max(boundary, min(wanted, (index + BatchKVCache.step) // WIDTH_QUANTUM * WIDTH_QUANTUM))


# Widths past the step boundary come in multiples of this: a few buffer shapes, not one per index and room. At
# 007bcdc each wave of bench.engine_throughput's 128-row burst was laid out one position wider (257 to 261); on the
# H200 the first run of those widths held a step of 2.6 s, the runs after it none.
WIDTH_QUANTUM = 32


def _round_up(n: int, quantum: int) -> int:
    return -(-n // quantum) * quantum


def reserved(room: int) -> int:
    """Positions reserved past the index: at least the next token's, at most one allocation step."""
    return min(max(room, 1), BatchKVCache.step)


def filter_rows(batch: LayerCaches, padding: list[int], keep_rows: list[int]) -> tuple[LayerCaches, list[int]]:
    """Only the rows `keep_rows`, with the padding every kept row shares cut off the left."""
    if not keep_rows:
        return [], []
    shift = min(padding[i] for i in keep_rows)
    new_padding = [padding[i] - shift for i in keep_rows]
    index = _index(batch) - shift
    offsets, lefts = row_arrays(new_padding, index)
    gather = None if keep_rows == list(range(len(padding))) else mx.array(keep_rows, mx.int32)
    for cache in batch:
        keys, values = cache.state[:2]
        if shift:  # slice first, so that the gather leaves contiguous arrays
            keys, values = keys[..., shift:, :], values[..., shift:, :]
        if gather is not None:
            keys, values = mx.take(keys, gather, axis=0), mx.take(values, gather, axis=0)
        cache.state = (keys, values, offsets, lefts, index)
    return batch, new_padding


def row_cache(batch: LayerCaches, padding: list[int], row: int) -> LayerCaches:
    """Row `row`'s KV as single-request KVCaches (views of the batch: slice before it changes)."""
    out = []
    for layer in batch:
        keys, values, _, _, index = layer.state
        cache = KVCache()
        start = padding[row]
        cache.state = (keys[row : row + 1, :, start:index, :], values[row : row + 1, :, start:index, :], index - start)
        out.append(cache)
    return out


def _index(batch: LayerCaches) -> int:
    return batch[0].state[4] if batch else 0


def placed(x: mx.array, left: int, right: int) -> mx.array:
    return mx.pad(x, [(0, 0), (0, 0), (left, right), (0, 0)]) if left or right else x


def concat_rows(arrays: list[mx.array]) -> mx.array:
    """Arrays joined along the batch axis (a lone one as it is: no copy)."""
    return arrays[0] if len(arrays) == 1 else mx.concatenate(arrays, axis=0)


def _placed_runs(joiners: Sequence[RowBlock], layer: int, which: int, index: int, width: int) -> list[mx.array]:
    """The joiners' keys or values at `layer`, right-aligned at `index` in rows `width` positions wide."""
    return [placed(run, index - n, width - index) for run, n in _equal_length_runs(joiners, layer, which)]


def _equal_length_runs(blocks: Sequence[RowBlock], layer: int, which: int):
    """Consecutive blocks of equal length, concatenated: (rows of their keys or values at `layer`, length)."""
    start = 0
    while start < len(blocks):
        end = start
        while end + 1 < len(blocks) and blocks[end + 1].length == blocks[start].length:
            end += 1
        n = blocks[start].length
        parts = []
        for b in blocks[start : end + 1]:
            cache = b.caches[layer]
            parts.append((cache.keys if which == 0 else cache.values)[b.start : b.stop, :, :n, :])
        yield concat_rows(parts), n
        start = end + 1


def row_arrays(padding: list[int], index: int) -> tuple[mx.array, mx.array]:
    """(offset, left padding) arrays of the rows, one pair shared by every layer: creating small
    arrays per layer costs more than the step's bookkeeping, and nothing here mutates them in place
    (BatchKVCache's update rebinds its offset)."""
    return mx.array([index - p for p in padding]), mx.array(padding)


def drop_row_tails(batch: LayerCaches, padding: list[int], drops: list[int]) -> list[int]:
    """Drop the last drops[i] positions of each row (rejected drafts), in place; returns the new padding.

    Rows share one end index: all lose the fewest drops by moving that index back; a row that loses more is
    shifted right by the difference, its dropped positions becoming left padding. The shift gathers whole
    head vectors (one take over [rows * heads * width, dim] per array: a per-element gather took ~25 ms per
    call on an H100 for 8 rows of an 8B model). The buffers keep their width, so the next update does not grow them.
    """
    shared = min(drops)
    shifts = [d - shared for d in drops]
    index = _index(batch) - shared
    new_padding = [p + s for p, s in zip(padding, shifts)]
    offsets, lefts = row_arrays(new_padding, index)
    rows = _shifted_vectors(batch[0].state[0].shape, shifts) if any(shifts) else None
    for cache in batch:
        keys, values = cache.state[:2]
        if rows is not None:
            keys, values = _take_vectors(keys, rows), _take_vectors(values, rows)
        cache.state = (keys, values, offsets, lefts, index)
    return new_padding


def _shifted_vectors(shape: tuple[int, ...], shifts: list[int]) -> mx.array:
    """For [B, H, W, D] arrays flattened to [B * H * W, D]: the source vector of each position once row b is
    shifted right by shifts[b] (positions shifted in from the left take the row's tail: padding)."""
    batch, heads, width = shape[:3]
    positions = (mx.arange(width)[None, :] - mx.array(shifts)[:, None]) % width  # [B, W]
    base = (mx.arange(batch) * heads * width)[:, None, None] + (mx.arange(heads) * width)[None, :, None]  # [B, H, 1]
    return (base + positions[:, None, :]).reshape(-1)


def _take_vectors(x: mx.array, rows: mx.array) -> mx.array:
    batch, heads, width, dim = x.shape
    return mx.take(x.reshape(batch * heads * width, dim), rows, axis=0).reshape(batch, heads, width, dim)

"""Padded prefill shapes: buckets, row grouping bounds, logits splits, warm-up shape lists (no model)."""

from __future__ import annotations

import sys

from hypothesis import given, strategies as st

from engine.runner.prefill_shapes import (
    LENGTH_BUCKETS,
    MAX_PADDING_FACTOR,
    MAX_ROW_PADDING,
    SMALL_FORWARD_TOKENS,
    RowSlice,
    bucket_length,
    group_rows,
    largest_forward_tokens,
    largest_step_within,
    row_buckets,
    split_rows,
    warmup_shapes,
)
from engine.runner.plain_prefill import split_for_logits


def test_bucket_length_rounds_up_to_the_next_bucket():
    assert [bucket_length(n) for n in (1, 16, 17, 100, 257, 513, 517, 577, 641, 1000, 1025, 2047, 2048)] == [
        16, 16, 32, 128, 384, 576, 576, 640, 704, 1024, 1280, 2048, 2048]
    assert bucket_length(3000) == 3000  # beyond the largest bucket: unpadded windows


@given(st.lists(st.integers(1, 2048), min_size=1, max_size=8))
def test_groups_cover_each_row_once_and_bound_their_padding(lengths):
    groups = group_rows(lengths)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    for group in groups:
        padded = len(group) * bucket_length(max(lengths[i] for i in group))
        real = sum(lengths[i] for i in group)
        assert len(group) == 1 or padded <= max(SMALL_FORWARD_TOKENS, MAX_PADDING_FACTOR * real)


def test_rows_of_similar_length_share_one_forward():
    assert group_rows([520] * 8) == [list(range(8))]
    assert group_rows([2000, 10]) == [[0], [1]]


def test_warmup_shapes_stay_within_the_step_budget_smallest_first():
    shapes = warmup_shapes(8, 8192, 2048)
    sizes = [s.rows * s.length for s in shapes]
    assert sizes == sorted(sizes)
    assert all(s.length in LENGTH_BUCKETS and 1 <= s.rows <= 8 for s in shapes)
    shortest = {b: 1 + ([0] + list(LENGTH_BUCKETS))[i] for i, b in enumerate(LENGTH_BUCKETS)}
    assert all(s.rows == 1 or s.rows * shortest[s.length] <= 8192 for s in shapes)  # up to 8 rows: no row padding
    got = {(s.rows, s.length, s.completing) for s in shapes}
    assert {(1, 2048, True), (1, 2048, False), (8, 1024, True), (4, 512, False)} <= got


def test_the_largest_forward_grows_with_the_step_budget_so_a_bisection_finds_the_step_that_fits():
    for chunk in (512, 2048):
        sizes = [largest_forward_tokens(32, step, chunk) for step in range(32, 16385, 211)]
        assert sizes == sorted(sizes) and sizes[-1] > sizes[0]
    fits = largest_forward_tokens(32, 3000, 2048)
    step = largest_step_within(fits, 32, 2048, 32, 16384)
    assert step >= 3000 and largest_forward_tokens(32, step, 2048) <= fits < largest_forward_tokens(32, step + 1, 2048)
    assert largest_step_within(10, 32, 2048, 32, 16384) == 32  # not even the smallest step fits: the smallest
    assert largest_step_within(1e9, 32, 2048, 32, 16384) == 16384


def test_split_for_logits_keeps_full_logits_under_budget():
    budget = split_for_logits.__globals__["LOGITS_ELEMENTS_BUDGET"]
    vocab = budget // (512 * 4)  # four 512-token rows of logits fit
    assert split_for_logits([512] * 10, [True] * 10, vocab) == [list(range(10))]  # equal lengths: body + tail
    assert split_for_logits([500] * 10, [False] * 10, vocab) == [list(range(10))]  # no logits at all
    ragged = split_for_logits([512, 500, 499, 480, 470, 460], [True] * 6, vocab)
    assert ragged == [[0, 1, 2, 3], [4, 5]]
    mixed = split_for_logits([512, 500, 499, 480, 470], [True, False, False, False, False], vocab)
    assert [i for part in mixed for i in part] == list(range(5)) and all(len(p) <= 4 for p in mixed)


def test_prefill_shapes_do_not_import_mlx():
    assert "engine.runner.prefill_shapes" in sys.modules
    assert all(not name.startswith("mlx") for name in vars(sys.modules["engine.runner.prefill_shapes"]))


def test_row_buckets_are_every_count_to_eight_then_a_quarter_apart_up_to_the_limit():
    assert row_buckets(1) == [1]
    assert row_buckets(6) == [1, 2, 3, 4, 5, 6]
    assert row_buckets(8) == list(range(1, 9))
    assert row_buckets(12) == list(range(1, 9)) + [11, 12]
    assert row_buckets(32) == list(range(1, 9)) + [11, 15, 20, 26, 32]
    assert row_buckets(48) == list(range(1, 9)) + [11, 15, 20, 26, 33, 42, 48]


@given(st.integers(1, 32), st.sampled_from(LENGTH_BUCKETS), st.integers(1, 32))
def test_split_rows_covers_the_rows_at_bucket_sizes_with_bounded_padding(rows, length, max_rows):
    max_rows = max(max_rows, rows)
    slices = split_rows(rows, length, max_rows)
    assert sum(s.rows for s in slices) == rows
    for s in slices:
        assert s.padded_rows in row_buckets(max_rows) and s.padded_rows >= s.rows
        small = s.padded_rows * length <= SMALL_FORWARD_TOKENS
        assert s.padded_rows == s.rows or small or s.padded_rows <= s.rows * (1 + MAX_ROW_PADDING)


def test_split_rows_pads_small_forwards_and_splits_large_ones():
    assert split_rows(5, 1536, 8) == [RowSlice(5, 5)]  # the default limit: every count is a bucket
    assert split_rows(12, 64, 32) == [RowSlice(12, 15)]
    assert split_rows(14, 1024, 32) == [RowSlice(14, 15)]  # one filler row in fifteen
    assert split_rows(9, 640, 32) == [RowSlice(9, 11)]  # not 8 + 1: a second forward's fixed cost
    assert split_rows(22, 640, 32) == [RowSlice(22, 26)]
    assert split_rows(40, 512, 32) == [RowSlice(32, 32), RowSlice(8, 8)]  # beyond the limit


def test_warmup_shapes_use_the_row_buckets():
    assert {s.rows for s in warmup_shapes(32, 16384, 2048)} == set(range(1, 9)) | {11, 15, 20, 26, 32}
    assert {s.rows for s in warmup_shapes(8, 8192, 2048)} == set(range(1, 9))
    # Every row bucket up to 640 (26 rows of 577 tokens fit the step), fewer beyond as the step budget allows.
    assert len(warmup_shapes(32, 16384, 2048)) == 2 * (9 * 13 + 3 * 12 + 3 * 11 + 2 * 10 + 2 * 9)


@given(st.integers(1, 32), st.integers(1, 2048))
def test_every_forward_a_step_within_budget_can_run_is_warmed(rows, length):
    step_tokens, max_rows = 16384, 32
    if rows * length > step_tokens:
        rows = max(1, step_tokens // length)
    warmed = {(s.rows, s.length) for s in warmup_shapes(max_rows, step_tokens, 2048, head_split=True)}
    width = bucket_length(length)
    for part in split_rows(rows, width, max_rows):
        assert (part.padded_rows, width) in warmed


def test_with_a_head_split_only_completing_shapes_are_warmed():
    both = warmup_shapes(32, 16384, 2048)
    split = warmup_shapes(32, 16384, 2048, head_split=True)
    assert split == [s for s in both if s.completing] and len(split) == len(both) // 2

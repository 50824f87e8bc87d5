"""Padded prefill shapes: few distinct forward shapes, so GPU kernels and plans are built once.

MLX's GPU backends build kernels and attention plans for each new input shape: on an H100 the
first forward at a new prefill shape cost 70-190 ms against 8-20 ms warm (bench/attention_probe.py, commit 8960592).
Serving meets a new prompt length nearly every step, so each forward's length is padded up to a
bucket, rows of very different lengths go to separate forwards, and the buckets are warmed at load.
Plain Python: no MLX.
"""

from __future__ import annotations

from dataclasses import dataclass

# Powers of two up to 256, steps of 128 up to 512, of 64 up to 1,024, then of 256 up to 2,048 (a prefill
# window's largest size): a chat prompt just over 512 tokens pads to 576, not 640. On an H100, 32 prompts of
# 517 tokens padded to 640 took 1.34x a bare forward's time on Llama-3.1-8B's shape (495 against 361 ms).
LENGTH_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 576, 640, 704, 768, 832, 896, 960, 1024, 1280, 1536, 1792, 2048)
# A forward this small costs its fixed overhead whatever its padding.
SMALL_FORWARD_TOKENS = 1024
# Rows join a forward while its padded size stays within this multiple of its real tokens
# (a second forward costs a fixed ~8-10 ms on an H100 whatever its size).
MAX_PADDING_FACTOR = 2.0
# Unpadded path: up to this many rows x positions, one forward computes full logits ([rows,
# positions, vocab], ~0.6 GB at 2,048 x 152k in bf16) and keeps the completing rows' last: a
# second forward costs more than that.
SHORT_FORWARD_LOGITS_TOKENS = 2048
# A forward's rows are padded up to a row bucket (row_buckets) while that adds at most this share of
# its rows, or the forward stays small; else they run as several bucket-sized forwards.
MAX_ROW_PADDING = 0.25


def bucket_length(n: int) -> int:
    """The padded length of an n-token forward (n itself beyond the largest bucket)."""
    for bucket in LENGTH_BUCKETS:
        if n <= bucket:
            return bucket
    return n


def group_rows(lengths: list[int]) -> list[list[int]]:
    """Split row indices into forwards, longest first, bounding each forward's padding."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    real = 0
    for index in order:
        if groups:
            rows, width = len(groups[-1]) + 1, bucket_length(lengths[groups[-1][0]])
            padded = rows * width
            if padded <= SMALL_FORWARD_TOKENS or padded <= MAX_PADDING_FACTOR * (real + lengths[index]):
                groups[-1].append(index)
                real += lengths[index]
                continue
        groups.append([index])
        real = lengths[index]
    return [sorted(group) for group in groups]


# Row counts up to this are each their own bucket (a prefill batch of 8 runs any count in one forward);
# beyond it each bucket is a quarter above the count after the last, so any count runs as one forward
# padded by at most MAX_ROW_PADDING (9 rows as 8 + 1 cost a second forward, ~10 ms on an H100).
EVERY_ROW_COUNT_UP_TO = 8


def row_buckets(max_rows: int) -> list[int]:
    """The row counts padded forwards run with: 1-8, then 11, 15, 20, 26, 33, ... up to the row limit."""
    buckets = list(range(1, min(max_rows, EVERY_ROW_COUNT_UP_TO) + 1))
    while buckets[-1] < max_rows:
        buckets.append(min(max_rows, int((buckets[-1] + 1) * (1 + MAX_ROW_PADDING))))
    return buckets


@dataclass(frozen=True)
class RowSlice:
    """`rows` consecutive rows of a group, run as one forward of `padded_rows` rows."""

    rows: int
    padded_rows: int


def split_rows(num_rows: int, length: int, max_rows: int) -> list[RowSlice]:
    """Forwards for `num_rows` rows of padded `length`, each at a row bucket (few shapes to build)."""
    buckets = row_buckets(max_rows)
    slices: list[RowSlice] = []
    left = num_rows
    while left:
        up = next((b for b in buckets if b >= left), None)
        if up is not None and (up * length <= SMALL_FORWARD_TOKENS or up <= left * (1 + MAX_ROW_PADDING)):
            slices.append(RowSlice(left, up))
            break
        down = max(b for b in buckets if b <= left)
        slices.append(RowSlice(down, down))
        left -= down
    return slices


@dataclass(frozen=True)
class WarmupShape:
    rows: int
    length: int
    # Whether the rows complete their prompts (the forward then also yields first-token logits:
    # full logits within the budget, else bodies then one token each; see plain_prefill.py).
    completing: bool


def warmup_shapes(
    max_rows: int, step_tokens: int | None, chunk_tokens: int | None, head_split: bool = False
) -> list[WarmupShape]:
    """The padded shapes a step can produce within its budget of real tokens, smallest first.

    Rows of different lengths share their bucket's shapes, row counts their row bucket's
    (split_rows); rows split to fit the logits budget meet the smaller buckets, warmed too.
    A shape is reachable when its fewest real tokens fit the budget: 26 rows of 513 tokens
    (13,338) run as 32 x 640 (20,480 padded).
    With a head split (head_split.py) a forward's body is the same whether its rows complete
    or not, so only completing shapes are warmed.
    """
    longest = bucket_length(min(chunk_tokens or LENGTH_BUCKETS[-1], LENGTH_BUCKETS[-1]))
    limit = max(step_tokens or max_rows * longest, SMALL_FORWARD_TOKENS)
    shapes = []
    lengths = [b for b in LENGTH_BUCKETS if b <= longest]
    for shortest, length in zip([1] + [b + 1 for b in lengths], lengths):
        for rows in row_buckets(max_rows):
            if rows > 1 and _fewest_rows_padded_to(rows, length, max_rows) * shortest > limit:
                break
            shapes.append(WarmupShape(rows, length, completing=True))
            if not head_split:
                shapes.append(WarmupShape(rows, length, completing=False))
    return sorted(shapes, key=lambda s: (s.rows * s.length, s.rows, not s.completing))


def _fewest_rows_padded_to(padded_rows: int, length: int, max_rows: int) -> int:
    """The fewest rows whose first forward split_rows runs at `padded_rows` rows."""
    return next(n for n in range(1, padded_rows + 1) if split_rows(n, length, max_rows)[0].padded_rows == padded_rows)


def largest_forward_tokens(max_rows: int, step_tokens: int, chunk_tokens: int | None) -> int:
    """The most tokens, padding included, one prefill forward computes in a step of step_tokens real tokens."""
    return max(shape.rows * shape.length for shape in warmup_shapes(max_rows, step_tokens, chunk_tokens))


def largest_step_within(forward_tokens: float, max_rows: int, chunk_tokens: int | None, lowest: int, highest: int) -> int:
    """The largest step budget in lowest..highest whose padded forwards compute at most forward_tokens tokens each
    (lowest when none does). largest_forward_tokens grows with the budget, so a bisection finds it."""
    if largest_forward_tokens(max_rows, highest, chunk_tokens) <= forward_tokens:
        return highest  # the usual case (memory to spare): one look instead of a bisection at every engine start
    if largest_forward_tokens(max_rows, lowest, chunk_tokens) > forward_tokens:
        return lowest
    while lowest < highest:
        middle = (lowest + highest + 1) // 2
        if largest_forward_tokens(max_rows, middle, chunk_tokens) <= forward_tokens:
            lowest = middle
        else:
            highest = middle - 1
    return lowest

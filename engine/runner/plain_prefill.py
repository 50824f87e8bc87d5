"""Padded prefill on plain batched KV caches: rows that share a cache offset run as one forward.

Every row of a forward is right-padded to one bucket length (prefill_shapes.py). Right padding
sits after a row's real tokens, so the causal mask keeps the real positions exact and no
per-row array mask is needed: on a GPU backend an array mask costs a non-fused attention, and
mlx-lm's batched cache adds per-row bookkeeping ops; the plain mlx-lm KVCache takes a batch
as it is. Each row's cache is then cut back to its real length. Measured on an H100 (bench/
prefill_probe.py, commit 52b8302): 8 prompts of 512 tokens took 73 ms through the masked batch against 16 ms for
one plain forward. Only for models whose layers are all plain KVCaches (the runner's padded mode).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from engine.kv.batch_cache import LayerCaches, cache_arrays
from engine.kv.plain_batch import concat_rows
from engine.models.head_split import HeadSplit, logits_at
from engine.runner.prefill_shapes import bucket_length
from engine.scheduler_output import PrefillChunk

# A forward whose rows complete their prompts at different lengths computes full logits and keeps
# each row's last position; rows are split so those logits stay under this many elements (2 GiB bf16).
LOGITS_ELEMENTS_BUDGET = 1 << 30


def cache_offset(cache: LayerCaches) -> int:
    return cache[0].offset


def split_for_logits(
    lengths: list[int], completing: list[bool], vocab_size: int, split: HeadSplit | None = None
) -> list[list[int]]:
    """Row groups of one padded forward: whole unless its completing rows need full logits over budget
    (never with a head split: it computes the completing rows' logits only)."""
    rows = list(range(len(lengths)))
    same_length_completion = all(completing) and len(set(lengths)) == 1
    if split is not None or not any(completing) or same_length_completion:
        return [rows]
    per_forward = max(1, LOGITS_ELEMENTS_BUDGET // (bucket_length(max(lengths)) * vocab_size))
    return [rows[i : i + per_forward] for i in range(0, len(rows), per_forward)]


def plain_prefill(
    model: Any, chunks: list[PrefillChunk], caches: list[LayerCaches], vocab_size: int, padded_rows: int = 0,
    split: HeadSplit | None = None,
) -> tuple[list[LayerCaches], mx.array | None, LayerCaches]:
    """One forward of rows sharing a cache offset: their caches, the completing rows' last logits,
    and the batched cache the rows' caches are views of (row i holds chunk i).

    With a head split, the head runs on the completing rows' last positions only. Without one,
    full logits where they fit the budget (one forward); equal-length completions beyond it
    write their bodies, then one token each (a second, decode-sized forward). Up to `padded_rows`,
    filler rows (token 0 on zero KV) follow the real ones; their outputs are never read.
    """
    lengths = [c.num_tokens for c in chunks]
    width = bucket_length(max(lengths))
    completing = [i for i, c in enumerate(chunks) if c.completes_prefill]
    offset = cache_offset(caches[0])
    fillers = max(0, padded_rows - len(chunks))
    batch = _stack(caches, offset, fillers)
    over_budget = split is None and (len(chunks) + fillers) * width * vocab_size > LOGITS_ELEMENTS_BUDGET
    tokens = _right_padded(chunks, width, fillers=fillers)
    logits = None
    if completing and over_budget and len(completing) == len(chunks) and len(set(lengths)) == 1 and lengths[0] > 1:
        logits = _body_then_tail(model, chunks, batch, fillers)
    elif completing:
        logits = logits_at(model, split, tokens, batch, completing, [lengths[i] - 1 for i in completing])
    else:
        model(tokens, cache=batch)
        mx.async_eval(cache_arrays(batch))
    return [_row_cache(batch, row, offset + n) for row, n in enumerate(lengths)], logits, batch


def _body_then_tail(model: Any, chunks: list[PrefillChunk], batch: LayerCaches, fillers: int) -> mx.array:
    """Equal-length rows: the bodies without logits, then each row's last token alone for its logits."""
    length = chunks[0].num_tokens
    body = _right_padded(chunks, bucket_length(length - 1), drop_last=True, fillers=fillers)
    model(body, cache=batch)
    padding = body.shape[1] - (length - 1)
    for layer in batch:
        layer.trim(padding)  # the padded positions are overwritten by the tail
    tail = mx.array([[c.token_ids[-1]] for c in chunks] + [[0]] * fillers, mx.uint32)
    return model(tail, cache=batch)[: len(chunks), -1, :]


def _right_padded(chunks: list[PrefillChunk], width: int, drop_last: bool = False, fillers: int = 0) -> mx.array:
    rows = [list(c.token_ids[:-1] if drop_last else c.token_ids) for c in chunks] + [[]] * fillers
    return mx.array([row + [0] * (width - len(row)) for row in rows], mx.uint32)


def _stack(caches: list[LayerCaches], offset: int, fillers: int) -> LayerCaches:
    """The rows' caches as one plain batched cache per layer (a fresh one at offset 0), then zero KV
    for the filler rows."""
    batch = []
    for layer in range(len(caches[0])):
        stacked = KVCache()
        if offset:
            keys = [c[layer].keys[..., :offset, :] for c in caches]
            values = [c[layer].values[..., :offset, :] for c in caches]
            if fillers:
                keys.append(mx.zeros((fillers, *keys[0].shape[1:]), keys[0].dtype))
                values.append(mx.zeros((fillers, *values[0].shape[1:]), values[0].dtype))
            stacked.state = (concat_rows(keys), concat_rows(values), offset)
        batch.append(stacked)
    return batch


def _row_cache(batch: LayerCaches, row: int, length: int) -> LayerCaches:
    """One row of the batch, cut to its real length (the padding's KV is dropped)."""
    out = []
    for layer in batch:
        cache = KVCache()
        cache.state = (layer.keys[row : row + 1, :, :length, :], layer.values[row : row + 1, :, :length, :], length)
        out.append(cache)
    return out


__all__ = ["LOGITS_ELEMENTS_BUDGET", "cache_offset", "plain_prefill", "split_for_logits"]

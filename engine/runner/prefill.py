"""Prefill forwards: write prompt chunks to their caches; a chunk that completes its prompt
also yields the logits of its last position, from which the first token is sampled.

Logits are only computed where needed: a short batch with completing chunks computes them
in its one forward and keeps the completing rows' last positions; otherwise the chunks' bodies are written
without logits (MLX never evaluates the unused lm_head) and a one-token tail forward of
the completing rows gives them.

With a padded-rows limit, rows are grouped by cache offset and length, each forward is right-padded
to a bucket length and its row count to a row bucket (prefill_shapes.py), so the GPU meets few
distinct shapes; rows of one forward share a plain batched cache (plain_prefill.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from engine.device_memory import on_gpu
from engine.kv import quantized_kv
from engine.kv.batch_cache import LayerCaches, cache_arrays, eval_caches, extract_request_cache, merge_request_caches
from engine.kv.block_store import prefix_cache_mode
from engine.kv.plain_batch import RowBlock
from engine.kv.quantized_kv import is_quantized_request_cache
from engine.models.head_split import HeadSplit, logits_at
from engine.runner.plain_prefill import cache_offset, plain_prefill, split_for_logits
from engine.runner.prefill_shapes import SHORT_FORWARD_LOGITS_TOKENS, bucket_length, group_rows, split_rows
from engine.scheduler_output import PrefillChunk

# Largest number of prompt tokens per row in one forward call (bounds activation memory).
MAX_FORWARD_TOKENS = 2048


@dataclass
class SharedBatch:
    """Rows of one padded forward: chunk i's cache is a view of row `rows.index(i)` of `caches`."""

    caches: LayerCaches
    rows: list[int]


@dataclass
class PrefillResult:
    # Each chunk's request cache after this step, in chunk order.
    caches: list[LayerCaches]
    # The chunks that completed their prompt, and their last position's logits [len(completing), vocab].
    completing: list[PrefillChunk]
    last_logits: mx.array | None
    # Padded forwards' batched caches, for copying many rows' KV at once (prefix cache, decode joins).
    shared: list[SharedBatch] = field(default_factory=list)

    def followed_by(self, later: "PrefillResult") -> "PrefillResult":
        """This result, then that of the chunks that come after this one's in the step (their padded forwards'
        rows renumbered: a shared batch's rows index the step's chunks)."""
        logits = [r.last_logits for r in (self, later) if r.last_logits is not None]
        joined = None if not logits else logits[0] if len(logits) == 1 else mx.concatenate(logits)
        offset = len(self.caches)
        shared = self.shared + [SharedBatch(batch.caches, [row + offset for row in batch.rows]) for batch in later.shared]
        return PrefillResult(self.caches + later.caches, self.completing + later.completing, joined, shared)

    def kv_arrays(self) -> list:
        """The step's KV: padded forwards' batches whole (their rows' caches are views of them: one
        array per layer, not one per row), other caches as they are."""
        in_shared = {i for shared in self.shared for i in shared.rows}
        arrays = [cache_arrays(shared.caches) for shared in self.shared]
        return arrays + [cache_arrays(c) for i, c in enumerate(self.caches) if i not in in_shared]

    def row_blocks(self) -> dict[int, RowBlock]:
        """Chunk index -> where its KV sits in a padded forward's batch, for the chunks that ran in one."""
        return {
            i: RowBlock(batch.caches, position, position + 1, self.caches[i][0].offset)
            for batch in self.shared for position, i in enumerate(batch.rows)
        }


def run_prefill(
    model: Any, chunks: list[PrefillChunk], caches: list[LayerCaches], padded_rows_limit: int | None,
    vocab_size: int, split: HeadSplit | None = None,
) -> PrefillResult:
    """With a padded-rows limit (plain KVCache models only), rows sharing a cache offset run as
    plain batches padded to a length bucket and a row bucket up to that limit; None: unpadded.
    With a head split (head_split.py), logits are computed at the completing positions only."""
    if padded_rows_limit is None and len(chunks) > 1 and is_quantized_request_cache(caches[0]):
        return _quantized_prefill(model, chunks, caches, vocab_size, split)
    if padded_rows_limit is None:
        return _prefill_rows(model, chunks, caches, split)
    results = []
    out_caches: list[LayerCaches] = list(caches)
    for group, padded_rows in padded_forwards(chunks, caches, vocab_size, padded_rows_limit, split):
        group_chunks, group_caches = [chunks[i] for i in group], [caches[i] for i in group]
        if group_chunks[0].num_tokens > MAX_FORWARD_TOKENS:  # a long row alone, unpadded, in windows
            result = _prefill_rows(model, group_chunks, group_caches, split)
        else:
            new_caches, logits, batch = plain_prefill(model, group_chunks, group_caches, vocab_size, padded_rows, split)
            completing = [c for c in group_chunks if c.completes_prefill]
            result = PrefillResult(new_caches, completing, logits, [SharedBatch(batch, group)])
        for i, cache in zip(group, result.caches):
            out_caches[i] = cache
        results.append(result)
    return _combined(out_caches, results)


def padded_forwards(
    chunks: list[PrefillChunk], caches: list[LayerCaches], vocab_size: int, max_rows: int, split: HeadSplit | None
) -> list[tuple[list[int], int]]:
    """Each forward's chunk indices and padded row count (split_rows)."""
    forwards = []
    for group in _padded_groups(chunks, caches, vocab_size, split):
        width = bucket_length(max(chunks[i].num_tokens for i in group))
        start = 0
        for part in split_rows(len(group), width, max_rows):
            forwards.append((group[start : start + part.rows], part.padded_rows))
            start += part.rows
    return forwards


def _padded_groups(
    chunks: list[PrefillChunk], caches: list[LayerCaches], vocab_size: int, split: HeadSplit | None
) -> list[list[int]]:
    """Forwards of rows sharing a cache offset and a padded length; rows beyond one window go alone."""
    by_offset: dict[int, list[int]] = {}
    groups = []
    for i, chunk in enumerate(chunks):
        if chunk.num_tokens > MAX_FORWARD_TOKENS:
            groups.append([i])
        else:
            by_offset.setdefault(cache_offset(caches[i]), []).append(i)
    for rows in by_offset.values():
        for group in group_rows([chunks[i].num_tokens for i in rows]):
            indices = [rows[i] for i in group]
            lengths = [chunks[i].num_tokens for i in indices]
            completing = [chunks[i].completes_prefill for i in indices]
            groups += [[indices[j] for j in part] for part in split_for_logits(lengths, completing, vocab_size, split)]
    return groups


def _quantized_prefill(
    model: Any, chunks: list[PrefillChunk], caches: list[LayerCaches], vocab_size: int, split: HeadSplit | None
) -> PrefillResult:
    """Quantized KV (mlx-lm's QuantizedKVCache has no merge): rows sharing a cache offset run as one right-padded
    forward on a BatchQuantizedKVCache, each row's cache then cut back to its real length; lone rows run alone."""
    out_caches, results = list(caches), []
    for group in _padded_groups(chunks, caches, vocab_size, split):
        group_chunks, group_caches = [chunks[i] for i in group], [caches[i] for i in group]
        if len(group) == 1:
            result = _prefill_rows(model, group_chunks, group_caches, split)
        else:
            result = _quantized_forward(model, group_chunks, group_caches, split)
        for i, cache in zip(group, result.caches):
            out_caches[i] = cache
        results.append(result)
    return _combined(out_caches, results)


def _quantized_forward(
    model: Any, chunks: list[PrefillChunk], caches: list[LayerCaches], split: HeadSplit | None
) -> PrefillResult:
    lengths = [c.num_tokens for c in chunks]
    offset, width = cache_offset(caches[0]), max(lengths)
    batch = quantized_kv.stacked_rows(caches)
    tokens = mx.array([list(c.token_ids) + [0] * (width - n) for c, n in zip(chunks, lengths)], mx.uint32)
    completing = [i for i, c in enumerate(chunks) if c.completes_prefill]
    logits = None
    if completing:
        logits = logits_at(model, split, tokens, batch, completing, [lengths[i] - 1 for i in completing])
    else:
        model(tokens, cache=batch)
    cut = [quantized_kv.row_cut(batch, row, offset + n) for row, n in enumerate(lengths)]
    return PrefillResult(cut, [chunks[i] for i in completing], logits)


def _combined(out_caches: list[LayerCaches], results: list[PrefillResult]) -> PrefillResult:
    shared = [batch for r in results for batch in r.shared]
    with_logits = [r for r in results if r.completing]
    if not with_logits:
        return PrefillResult(out_caches, [], None, shared)
    completing = [chunk for r in with_logits for chunk in r.completing]
    logits = with_logits[0].last_logits if len(with_logits) == 1 else mx.concatenate([r.last_logits for r in with_logits])
    return PrefillResult(out_caches, completing, logits, shared)


def _prefill_rows(
    model: Any, chunks: list[PrefillChunk], caches: list[LayerCaches], split: HeadSplit | None = None
) -> PrefillResult:
    """One unpadded forward of these rows (plus a one-token tail forward where the logits need it)."""
    completing = [i for i, c in enumerate(chunks) if c.completes_prefill]
    width = max(c.num_tokens for c in chunks)
    # Full logits of every position only while small; with a head split, any one window.
    one_forward = width <= MAX_FORWARD_TOKENS if split is not None else len(chunks) * width <= SHORT_FORWARD_LOGITS_TOKENS
    if completing and one_forward:
        caches, logits = _forward_with_logits(model, chunks, caches, split)
        return PrefillResult(caches, [chunks[i] for i in completing], logits[mx.array(completing)])
    bodies = [list(c.token_ids[:-1]) if c.completes_prefill else list(c.token_ids) for c in chunks]
    with_body = [i for i, body in enumerate(bodies) if body]
    written = _forward_bodies(model, [bodies[i] for i in with_body], [caches[i] for i in with_body])
    caches = list(caches)
    for i, cache in zip(with_body, written):
        caches[i] = cache
    if not completing:
        return PrefillResult(caches, [], None)
    tail_tokens = [chunks[i].token_ids[-1] for i in completing]
    tail_caches, logits = _forward_tail(model, tail_tokens, [caches[i] for i in completing])
    for i, cache in zip(completing, tail_caches):
        caches[i] = cache
    return PrefillResult(caches, [chunks[i] for i in completing], logits)


def _forward_with_logits(
    model: Any, chunks: list[PrefillChunk], caches: list[LayerCaches], split: HeadSplit | None
) -> tuple[list[LayerCaches], mx.array]:
    lengths = [c.num_tokens for c in chunks]
    width = max(lengths)
    last = [n - 1 for n in lengths]
    if len(chunks) == 1 and lengths[0] == width:
        tokens = mx.array(chunks[0].token_ids, mx.uint32)[None]
        return caches, logits_at(model, split, tokens, caches[0], [0], last)
    merged, tokens, padded = merge_right_padded(caches, [list(c.token_ids) for c in chunks], width)
    logits = logits_at(model, split, tokens, merged, list(range(len(chunks))), last)
    if padded:
        for layer in merged:
            layer.finalize()
    return [extract_request_cache(merged, row) for row in range(len(chunks))], logits


def _forward_bodies(model: Any, bodies: list[list[int]], caches: list[LayerCaches]) -> list[LayerCaches]:
    """Write token bodies ([rows] of lists) to their caches; no logits are evaluated."""
    if not bodies:
        return []
    width = max(len(body) for body in bodies)
    if len(bodies) == 1 and len(bodies[0]) == width:
        _forward_windows(model, mx.array(bodies[0], mx.uint32)[None], caches[0])
        return caches
    merged, tokens, padded = merge_right_padded(caches, bodies, width)
    _forward_windows(model, tokens, merged)
    if padded:
        for layer in merged:
            layer.finalize()
        eval_caches(merged)
    return [extract_request_cache(merged, row) for row in range(len(bodies))]


def _forward_windows(model: Any, tokens: mx.array, caches: LayerCaches) -> None:
    for start in range(0, tokens.shape[1], MAX_FORWARD_TOKENS):
        model(tokens[:, start : start + MAX_FORWARD_TOKENS], cache=caches)
        eval_caches(caches)


def _forward_tail(
    model: Any, tokens: list[int], caches: list[LayerCaches]
) -> tuple[list[LayerCaches], mx.array]:
    """One token per row on top of each cache: the last prompt position's logits."""
    inputs = mx.array(tokens, mx.uint32)[:, None]
    if len(tokens) == 1:
        return caches, model(inputs, cache=caches[0])[:, -1, :]
    merged = merge_request_caches(caches)
    logits = model(inputs, cache=merged)[:, -1, :]
    return [extract_request_cache(merged, row) for row in range(len(tokens))], logits


def merge_right_padded(
    caches: list[LayerCaches], token_rows: list[list[int]], width: int
) -> tuple[LayerCaches, mx.array, bool]:
    """Batch per-request caches for rows of different lengths, padding each row on the right to `width`."""
    merged = merge_request_caches(caches)
    lengths = [len(row) for row in token_rows]
    padding = [width - n for n in lengths]
    tokens = mx.array([row + [0] * p for row, p in zip(token_rows, padding)], mx.uint32)
    if any(padding):
        for layer in merged:
            layer.prepare(lengths=lengths, right_padding=padding)
    return merged, tokens, any(padding)


__all__ = ["MAX_FORWARD_TOKENS", "PrefillResult", "SharedBatch", "merge_right_padded", "padded_forwards", "run_prefill"]


def resolve_pad_shapes(setting: bool | None, model, quantized_kv: bool = False) -> bool:
    """Padding needs caches that take right padding and cut it off exactly: plain KV caches (not quantized)."""
    if quantized_kv or prefix_cache_mode(model) != "blocks":
        return False
    return setting if setting is not None else on_gpu()

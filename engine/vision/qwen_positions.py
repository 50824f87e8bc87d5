"""Qwen2.5-VL's vision-tower index arrays, computed on the host from the images' grids.

mlx-vlm's `rot_pos_emb` and `get_window_index` build them with MLX ops and read them back (`.item()`, `.tolist()`,
`np.where` on an MLX array): each read waits for everything queued on the device, so an image arriving beside
running decode rows stalled the pipeline several times before its tower could even be queued. The same integers
from numpy need no device; the rotary table itself stays an MLX computation, as mlx-vlm's.
Equal to mlx-vlm's on the grids tests/engine/test_vision_tower.py tries.

The same holds for a prompt's M-RoPE delta (`image_rope_delta`): mlx-vlm's `get_rope_index` builds every position
of the prompt with MLX ops and five reads back (~2 ms of host time on an H200 for a 672x672 image's prompt, paid
before the first token of each question on a cached image); the delta alone is a sum over the images' grids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from engine.vision.inputs import media_token_runs

PAD = -100  # mlx-vlm's mark for a padded window cell


@dataclass(frozen=True)
class TowerIndex:
    window_index: np.ndarray  # merged-patch order inside windows (int64)
    window_bounds: list[int]  # cumulative patch counts of the windows (mlx-vlm's cu_window_seqlens)
    position_ids: np.ndarray  # [patches, 2]: each patch's (row, column) for the 2-D rotary embedding
    largest_side: int  # the longest grid side in patches: the rotary table's length


def tower_index(grids: Sequence[Sequence[int]], tower: Any) -> TowerIndex:
    """`tower`: mlx-vlm's Qwen2.5-VL VisionModel (its window size, patch size and merge size)."""
    merge = tower.spatial_merge_size
    window = tower.window_size // merge // tower.patch_size
    indices, bounds, offset, positions = [], [0], 0, []
    for t, h, w in grids:
        rows, cols = h // merge, w // merge
        index = np.arange(t * rows * cols).reshape(t, rows, cols)
        pad_h, pad_w = window - rows % window, window - cols % window
        across_h, across_w = (rows + pad_h) // window, (cols + pad_w) // window
        padded = np.pad(index, ((0, 0), (0, pad_h), (0, pad_w)), constant_values=PAD)
        padded = padded.reshape(t, across_h, window, across_w, window).transpose(0, 1, 3, 2, 4)
        padded = padded.reshape(t, across_h * across_w, window, window)
        sizes = (padded != PAD).sum(axis=(2, 3)).reshape(-1)
        flat = padded.reshape(-1)
        indices.append(flat[flat != PAD] + offset)
        bounds.extend((np.cumsum(sizes) * tower.spatial_merge_unit + bounds[-1]).tolist())
        offset += t * rows * cols
        positions.append(np.tile(_patch_positions(h, w, merge), (t, 1)))
    largest = max(max(int(h), int(w)) for _, h, w in grids)
    return TowerIndex(np.concatenate(indices), bounds, np.concatenate(positions), largest)


def image_rope_delta(token_ids: Sequence[int], grids: Sequence[Sequence[int]], merge: int, image_token: int) -> int | None:
    """Qwen2/2.5-VL's M-RoPE delta of a prompt whose media are images (grids: image_grid_thw, in prompt order): an
    image of t x h x w patches takes t*(h/merge)*(w/merge) tokens but max(t, h/merge, w/merge) positions, and text
    goes on after its last position. None where the prompt's image token runs do not match the grids."""
    runs = media_token_runs(token_ids, image_token)
    if len(runs) != len(grids):
        return None
    delta = 0
    for (start, end), (t, h, w) in zip(runs, grids):
        tokens, span = t * (h // merge) * (w // merge), max(t, h // merge, w // merge)
        if end - start != tokens:
            return None
        delta += span - tokens
    return delta


def mrope_positions(
    token_ids: Sequence[int], grids: Sequence[Sequence[int]], merge: int, image_token: int,
    runs: Sequence[tuple[int, int]] | None = None,
) -> tuple[np.ndarray, int] | None:
    """A prompt's M-RoPE positions [3, L] and rope delta, as mlx-vlm's `get_rope_index` lays them out for a prompt
    whose media are images (grids in prompt order): text counts on from the last position on all three axes; an
    image's tokens take (frame, row, column) from there. None where the image token runs (`runs`, where the caller
    has them: media_token_runs) do not match the grids."""
    runs = media_token_runs(token_ids, image_token) if runs is None else runs
    if len(runs) != len(grids):
        return None
    pieces, at, next_position = [], 0, 0
    for (start, end), (t, h, w) in zip(runs, grids):
        rows, cols = h // merge, w // merge
        if end - start != t * rows * cols:
            return None
        pieces.append(np.broadcast_to(np.arange(start - at) + next_position, (3, start - at)))
        first = next_position + start - at
        image = np.stack([np.repeat(np.arange(t), rows * cols), np.tile(np.repeat(np.arange(rows), cols), t),
                          np.tile(np.arange(cols), t * rows)]) + first
        pieces.append(image)
        next_position, at = int(image.max()) + 1, end
    pieces.append(np.broadcast_to(np.arange(len(token_ids) - at) + next_position, (3, len(token_ids) - at)))
    positions = np.concatenate(pieces, axis=1)
    return positions, int(positions.max()) + 1 - len(token_ids)


def _patch_positions(h: int, w: int, merge: int) -> np.ndarray:
    """mlx-vlm's rot_pos_emb order: merge x merge blocks, row-major inside each block."""
    rows = np.repeat(np.arange(h)[:, None], w, axis=1).reshape(h // merge, merge, w // merge, merge)
    cols = np.repeat(np.arange(w)[None, :], h, axis=0).reshape(h // merge, merge, w // merge, merge)
    rows, cols = rows.transpose(0, 2, 1, 3).reshape(-1), cols.transpose(0, 2, 1, 3).reshape(-1)
    return np.stack([rows, cols], axis=-1)


def rotary_table(tower: Any, index: TowerIndex) -> mx.array:
    """mlx-vlm's rot_pos_emb output for these grids, from the host positions (no read back)."""
    rotary = tower.rotary_pos_emb
    inv_freq = 1.0 / (rotary.theta ** (mx.arange(0, rotary.dim, 2, dtype=mx.float32) / rotary.dim))
    freqs = mx.outer(mx.arange(index.largest_side, dtype=inv_freq.dtype), inv_freq)
    positions = index.position_ids
    return freqs[mx.array(positions)].reshape(positions.shape[0], -1)


__all__ = ["TowerIndex", "image_rope_delta", "mrope_positions", "rotary_table", "tower_index"]

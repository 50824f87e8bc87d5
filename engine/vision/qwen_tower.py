"""Qwen2.5-VL's vision tower run by Orchard over many images at once: mlx-vlm's `VisionModel` layers and weights,
its attention windows batched (one attention call per window length, not one per window).

Why not mlx-vlm's own forward: it calls attention once per window (36 calls a layer for a 672x672 image), one image
set per call, and where an image's merged grid divides into whole windows it also calls it on empty windows (its
de-duplication of window boundaries compares MLX arrays, which hash by identity); on MLX's CUDA backend a bf16 or
fp16 attention over zero rows dies (SIGFPE), so such a tower could only run in float32 there.

The first use checks this forward against mlx-vlm's on a probe grid that has no empty window (`agrees`); a model
whose tower differs keeps mlx-vlm's path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

# Probe grids (t, h, w in patches): merged 5x6 and 3x3, neither a whole number of 4x4-unit windows, so mlx-vlm's
# forward runs no empty window on them; two images, to check that images batched together stay apart.
PROBE_GRIDS = ((1, 10, 12), (1, 6, 6))
# Largest relative difference from mlx-vlm's forward accepted: the same arithmetic in another call order.
AGREEMENT = {mx.float32: 1e-3, mx.bfloat16: 5e-2, mx.float16: 2e-2}


@dataclass(frozen=True)
class AttentionGroups:
    """One layer kind's attention segments in a forward, grouped by length: each group's rows (a gather index of
    count x length), and where the groups' outputs, concatenated, go back in sequence order (None: already)."""

    groups: tuple[tuple[mx.array, int, int], ...]  # (rows, count, length)
    restore: mx.array | None


def attention_groups(boundaries: Sequence[int]) -> AttentionGroups:
    """Segments [b_i, b_i+1) of a sequence, empty ones dropped, batched by length."""
    starts_by_length: dict[int, list[int]] = {}
    for start, end in zip(boundaries, boundaries[1:]):
        if end > start:
            starts_by_length.setdefault(end - start, []).append(start)
    groups, order = [], []
    for length, starts in starts_by_length.items():
        rows = (np.asarray(starts)[:, None] + np.arange(length)[None]).reshape(-1)
        groups.append((mx.array(rows, mx.int32), len(starts), length))
        order.append(rows)
    flat = np.concatenate(order)
    restore = None if np.array_equal(flat, np.arange(len(flat))) else mx.array(np.argsort(flat), mx.int32)
    return AttentionGroups(tuple(groups), restore)


class WindowedTower:
    """Forward of an mlx-vlm Qwen2.5-VL `VisionModel` over several images (their patches end to end, as mlx-vlm
    takes them); its output rows are the images' merged tokens, in image order."""

    def __init__(self, tower: Any) -> None:
        self.tower = tower
        self.dtype = tower.patch_embed.proj.weight.dtype

    @staticmethod
    def fits(tower: Any) -> bool:
        """An mlx-vlm tower of the layout this forward reads."""
        names = ("patch_embed", "rot_pos_emb", "get_window_index", "blocks", "merger", "fullatt_block_indexes")
        return type(tower).__module__.endswith("qwen2_5_vl.vision") and all(hasattr(tower, n) for n in names)

    def __call__(self, pixel_values: mx.array, grids: Sequence[Sequence[int]]) -> mx.array:
        tower = self.tower
        grid = mx.array([list(g) for g in grids])
        x = tower.patch_embed(pixel_values.astype(self.dtype))
        rotary = tower.rot_pos_emb(grid)
        window_index, window_bounds = tower.get_window_index(grid)
        unit = tower.spatial_merge_unit
        rows = x.shape[0]
        x = x.reshape(rows // unit, unit, -1)[window_index].reshape(rows, -1)
        rotary = rotary.reshape(rows // unit, unit, -1)[window_index].reshape(rows, -1)
        windowed = attention_groups(window_bounds.tolist())
        frames = [h * w for t, h, w in grids for _ in range(t)]
        full = attention_groups(np.concatenate([[0], np.cumsum(frames)]).tolist())
        for index, block in enumerate(tower.blocks):
            groups = full if index in tower.fullatt_block_indexes else windowed
            x = x + _attention(block.attn, block.norm1(x), groups, rotary)
            x = x + block.mlp(block.norm2(x))
        return tower.merger(x)[mx.argsort(window_index)]

    def agrees(self, vlm: Any) -> bool:
        """On the probe images (seeded noise): this forward matches mlx-vlm's within the tower dtype's rounding, and
        the model merges features handed to it (`cached_image_features`) exactly as its own tower's."""
        patch = int(np.prod(self.tower.patch_embed.proj.weight.shape[1:]))
        pixels = mx.random.normal((sum(t * h * w for t, h, w in PROBE_GRIDS), patch), key=mx.random.key(0))
        pixels = pixels.astype(self.dtype)
        try:
            ours = self(pixels, PROBE_GRIDS).astype(mx.float32)
            theirs = self.tower(pixels, mx.array(PROBE_GRIDS))
            merges = _merges_given_features(vlm, pixels, theirs)
        except Exception as exc:  # noqa: BLE001 — a tower of another layout under the same names
            log.info("vision tower: Orchard's batched forward does not run on it (%s)", exc)
            return False
        if ours.shape != theirs.shape or not merges:
            log.info("vision tower: Orchard's batched forward not used (%s)", "shape" if merges else "merge differs")
            return False
        theirs = theirs.astype(mx.float32)
        scale = max(float(mx.abs(theirs).max().item()), 1e-6)
        error = float(mx.abs(ours - theirs).max().item()) / scale
        agrees = error <= AGREEMENT.get(self.dtype, 1e-3)
        log.info("vision tower: batched forward vs mlx-vlm's, relative difference %.2e (%s)",
                 error, "used" if agrees else "not used")
        return agrees


def _merges_given_features(vlm: Any, pixels: mx.array, features: mx.array) -> bool:
    """The probe prompt (text, then each probe image between vision markers) embedded from the pixels and from the
    tower's output given: equal bit for bit."""
    config = vlm.config
    unit = vlm.vision_tower.spatial_merge_unit
    ids: list[int] = [11, 12]
    for t, h, w in PROBE_GRIDS:
        image = [config.image_token_id] * (t * h * w // unit)
        ids += [config.vision_start_token_id, *image, config.vision_end_token_id]
    tokens = mx.array([ids + [13]], mx.int32)
    arrays = {"mask": mx.ones(tokens.shape, mx.int32), "image_grid_thw": mx.array(PROBE_GRIDS)}
    own = vlm.get_input_embeddings(tokens, pixels, **arrays).to_dict()
    given = vlm.get_input_embeddings(tokens, pixels, cached_image_features=features, **arrays).to_dict()
    return own.keys() == given.keys() and all(_equal(own[k], given[k]) for k in own)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, mx.array) and isinstance(b, mx.array):
        return a.shape == b.shape and a.dtype == b.dtype and bool(mx.array_equal(a, b).item())
    return type(a) is type(b) and (a is b or a == b)


def _attention(attn: Any, x: mx.array, groups: AttentionGroups, rotary: mx.array) -> mx.array:
    """mlx-vlm's vision `Attention` over each group of equal-length segments in one call."""
    from mlx_vlm.models.qwen2_5_vl.vision import apply_rotary_pos_emb_vision

    rows = x.shape[0]
    qkv = attn.qkv(x).reshape(rows, 3, attn.num_heads, -1)
    q = apply_rotary_pos_emb_vision(qkv[None, :, 0], rotary)[0]
    k = apply_rotary_pos_emb_vision(qkv[None, :, 1], rotary)[0]
    v = qkv[:, 2]
    outputs = []
    for index, count, length in groups.groups:
        def segments(t: mx.array) -> mx.array:
            return t[index].reshape(count, length, attn.num_heads, -1).transpose(0, 2, 1, 3)

        out = mx.fast.scaled_dot_product_attention(segments(q), segments(k), segments(v), scale=attn.scale)
        outputs.append(out.transpose(0, 2, 1, 3).reshape(count * length, -1))
    out = mx.concatenate(outputs) if len(outputs) > 1 else outputs[0]
    if groups.restore is not None:
        out = out[groups.restore]
    return attn.proj(out)


__all__ = ["AttentionGroups", "WindowedTower", "attention_groups"]

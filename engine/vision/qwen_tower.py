"""Qwen2.5-VL's vision tower run by Orchard over many images at once: mlx-vlm's `VisionModel` layers and weights,
its attention windows batched (one attention call per window length, not one per window).

Why not mlx-vlm's own forward: it calls attention once per window (36 calls a layer for a 672x672 image), one image
set per call, and where an image's merged grid divides into whole windows it also calls it on empty windows (its
de-duplication of window boundaries compares MLX arrays, which hash by identity); on MLX's CUDA backend a bf16 or
fp16 attention over zero rows dies (SIGFPE), so such a tower could only run in float32 there.

The first use checks this forward against mlx-vlm's on probe grids that have no empty window (`agrees`), and the
model's merge of given features on a prompt of those images (`probe_prompt`, checked by VisionLanguageModel as for
kept features); a model that differs in either keeps mlx-vlm's path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from engine.vision.qwen_positions import rotary_table, tower_index

log = logging.getLogger(__name__)

# Probe grids (t, h, w in patches): merged 5x6 and 3x3, neither a whole number of 4x4-unit windows, so mlx-vlm's
# forward runs no empty window on them; two images, to check that images batched together stay apart.
PROBE_GRIDS = ((1, 10, 12), (1, 6, 6))
# Blocks computed per evaluation in a run the caller waits for (WindowedTower.__call__): each evaluation waits for
# the device once (~a launch's latency), and the buffers held at once are those of this many blocks.
EVAL_BLOCKS = 4
# Largest relative difference from mlx-vlm's forward accepted: the same arithmetic in another call order.
AGREEMENT = {mx.float32: 1e-3, mx.bfloat16: 5e-2, mx.float16: 2e-2}


@dataclass(frozen=True)
class AttentionGroups:
    """One layer kind's attention segments in a forward, grouped by length: each group's rows (a gather index of
    count x length; its first row where they are one run of rows in order, else None), and where the groups'
    outputs, concatenated, go back in sequence order (None: already)."""

    groups: tuple[tuple[mx.array, int, int, int | None], ...]  # (rows, count, length, first row of a run)
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
        run = int(rows[0]) if np.array_equal(rows, np.arange(rows[0], rows[0] + len(rows))) else None
        groups.append((mx.array(rows, mx.int32), len(starts), length, run))
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
        names = ("patch_embed", "rotary_pos_emb", "window_size", "patch_size", "spatial_merge_size",
                 "spatial_merge_unit", "blocks", "merger", "fullatt_block_indexes")
        return type(tower).__module__.endswith("qwen2_5_vl.vision") and all(hasattr(tower, n) for n in names)

    def __call__(self, pixel_values: mx.array, grids: Sequence[Sequence[int]], waited: bool = False) -> mx.array:
        """Queued without reading anything back: the index arrays come from the host (qwen_positions.py). Not
        mx.compile'd: on an H200 a compile of this graph took ~23 s per grid set (each count of images in a
        forward is one), a stall no per-image saving repays (docs/architecture.md).

        `waited`: the caller waits for the output anyway; the blocks are then computed EVAL_BLOCKS at a time. MLX
        allocates a graph's buffers as it queues it, ahead of the device, and frees them as the device finishes:
        queued whole, one 672x672 image's float32 tower held ~15 MB per image token at its peak on an H100
        (~8.7 GB), which bounded the images a step could run ahead of admission to one or two."""
        grids = [tuple(int(n) for n in grid) for grid in grids]
        tower = self.tower
        layout = tower_index(grids, tower)
        x = tower.patch_embed(pixel_values.astype(self.dtype))
        rotary = rotary_table(tower, layout)
        window_index = mx.array(layout.window_index, mx.int32)
        unit = tower.spatial_merge_unit
        rows = x.shape[0]
        x = x.reshape(rows // unit, unit, -1)[window_index].reshape(rows, -1)
        rotary = _RotaryTable.of(rotary.reshape(rows // unit, unit, -1)[window_index].reshape(rows, -1))
        windowed = attention_groups(layout.window_bounds)
        frames = [h * w for t, h, w in grids for _ in range(t)]
        full = attention_groups(np.concatenate([[0], np.cumsum(frames)]).tolist())
        for index, block in enumerate(tower.blocks):
            groups = full if index in tower.fullatt_block_indexes else windowed
            x = x + _attention(block.attn, block.norm1(x), groups, rotary)
            x = x + block.mlp(block.norm2(x))
            if waited and (index + 1) % EVAL_BLOCKS == 0:
                mx.eval(x)
        return tower.merger(x)[mx.array(np.argsort(layout.window_index), mx.int32)]

    def agrees(self) -> bool:
        """This forward matches mlx-vlm's on the probe images within the tower dtype's rounding."""
        pixels = self.probe_pixels()
        try:
            ours = self(pixels, PROBE_GRIDS).astype(mx.float32)
            theirs = self.tower(pixels, mx.array(PROBE_GRIDS)).astype(mx.float32)
        except Exception as exc:  # noqa: BLE001 — a tower of another layout under the same names
            log.info("vision tower: Orchard's batched forward does not run on it (%s)", exc)
            return False
        if ours.shape != theirs.shape:
            log.info("vision tower: Orchard's batched forward gives another shape (%s, not %s)",
                     ours.shape, theirs.shape)
            return False
        scale = max(float(mx.abs(theirs).max().item()), 1e-6)
        error = float(mx.abs(ours - theirs).max().item()) / scale
        agrees = error <= AGREEMENT.get(self.dtype, 1e-3)
        log.info("vision tower: batched forward vs mlx-vlm's, relative difference %.2e (%s)",
                 error, "used" if agrees else "not used")
        return agrees

    def probe_pixels(self) -> mx.array:
        """The probe images' patches: seeded noise in the tower's dtype."""
        patch = int(np.prod(self.tower.patch_embed.proj.weight.shape[1:]))
        pixels = mx.random.normal((sum(t * h * w for t, h, w in PROBE_GRIDS), patch), key=mx.random.key(0))
        return pixels.astype(self.dtype)

    def probe_prompt(self, config: Any) -> tuple[tuple[int, ...], dict[str, mx.array]]:
        """A prompt of the probe images as Qwen2.5-VL's processor lays one out (text, then each image's tokens
        between vision markers), and its image grids."""
        unit = self.tower.spatial_merge_unit
        ids: list[int] = [11, 12]
        for t, h, w in PROBE_GRIDS:
            image = [config.image_token_id] * (t * h * w // unit)
            ids += [config.vision_start_token_id, *image, config.vision_end_token_id]
        return (*ids, 13), {"image_grid_thw": mx.array(PROBE_GRIDS)}


@dataclass(frozen=True)
class _RotaryTable:
    """mlx-vlm's `apply_rotary_pos_emb_vision` operands (cos, sin of the angles, tiled to the head width) made once
    per forward, not per layer and tensor: [rows, 1, 1, head_dim] each."""

    cos: mx.array
    sin: mx.array

    @classmethod
    def of(cls, angles: mx.array) -> "_RotaryTable":
        def tiled(values: mx.array) -> mx.array:
            return mx.tile(values[:, None, None, :], (1, 1, 1, 2))

        return cls(tiled(mx.cos(angles)), tiled(mx.sin(angles)))

    def rotate(self, qk: mx.array) -> mx.array:
        """q and k ([rows, 2, heads, head_dim]) rotated together: mlx-vlm's arithmetic, element by element."""
        from mlx_vlm.models.rope_utils import rotate_half

        return ((qk * self.cos) + (rotate_half(qk) * self.sin)).astype(qk.dtype)


def _attention(attn: Any, x: mx.array, groups: AttentionGroups, rotary: _RotaryTable) -> mx.array:
    """mlx-vlm's vision `Attention` over each group of equal-length segments in one call."""
    rows = x.shape[0]
    qkv = attn.qkv(x).reshape(rows, 3, attn.num_heads, -1)
    qk = rotary.rotate(qkv[:, :2])
    q, k, v = qk[:, 0], qk[:, 1], qkv[:, 2]
    outputs = []
    for index, count, length, run in groups.groups:
        def segments(t: mx.array) -> mx.array:
            picked = t[run:run + count * length] if run is not None else t[index]  # a run needs no gather
            return picked.reshape(count, length, attn.num_heads, -1).transpose(0, 2, 1, 3)

        out = mx.fast.scaled_dot_product_attention(segments(q), segments(k), segments(v), scale=attn.scale)
        outputs.append(out.transpose(0, 2, 1, 3).reshape(count * length, -1))
    out = mx.concatenate(outputs) if len(outputs) > 1 else outputs[0]
    if groups.restore is not None:
        out = out[groups.restore]
    return attn.proj(out)


__all__ = ["AttentionGroups", "WindowedTower", "attention_groups"]

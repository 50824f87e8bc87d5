"""Qwen2.5-VL's merge of an image prompt's given features, with its M-RoPE positions, built from the host.

mlx-vlm's `get_input_embeddings` reads back from the device while it builds the merge (the image tokens' count, each
image's grid, the positions it assembled: ~7 reads a prompt), and each read waits for the embedding stream: on an
H100 the engine thread spent 18 ms embedding 8 prompts with their features in hand, ~4 ms a prompt inside a loaded
step, for arrays the host already knows (the token ids and the grids). Here the positions come from numpy
(qwen_positions.mrope_positions) and the merge is a concatenation of the token embeddings' text runs with the
features; nothing is read back. Used only after a first prompt's merge equals mlx-vlm's bit for bit (`agrees`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import mlx.core as mx

from engine.vision.inputs import media_token_runs
from engine.vision.qwen_positions import mrope_positions

log = logging.getLogger(__name__)


class HostMerge:
    """Merges for one mlx-vlm Qwen2.5-VL model: image prompts only (no video), features given."""

    def __init__(self, vlm: Any) -> None:
        self._embed = vlm.language_model.model.embed_tokens
        self._image_token = vlm.config.image_token_id
        self._merge_size = vlm.config.vision_config.spatial_merge_size
        self.agrees: bool | None = None  # checked against mlx-vlm's on the first prompt

    @staticmethod
    def fits(vlm: Any) -> bool:
        config = getattr(vlm, "config", None)
        return (type(vlm).__module__.endswith("qwen2_5_vl.qwen2_5_vl") and hasattr(config, "image_token_id")
                and hasattr(getattr(config, "vision_config", None), "spatial_merge_size"))

    def merged(self, token_ids: Sequence[int], grids: Sequence[Sequence[int]], features: mx.array,
               theirs: Callable[[], Any]) -> Any:
        """The prompt's merge (mlx-vlm's InputEmbeddingsFeatures); `theirs()` is mlx-vlm's own, taken where this
        one is not used: a layout it does not build, or a first check that differed."""
        ours = None if self.agrees is False else self._merge(token_ids, grids, features)
        if ours is None:
            return theirs()
        if self.agrees is None:
            reference = theirs()
            self.agrees = same_merge(ours, reference)
            log.info("vision merge: from the host %s", "(equal to mlx-vlm's: used)" if self.agrees else
                     "differs from mlx-vlm's: not used")
            return ours if self.agrees else reference
        return ours

    def _merge(self, token_ids: Sequence[int], grids: Sequence[Sequence[int]], features: mx.array) -> Any:
        from mlx_vlm.models.base import InputEmbeddingsFeatures

        runs = media_token_runs(token_ids, self._image_token)
        layout = mrope_positions(token_ids, grids, self._merge_size, self._image_token, runs)
        if layout is None or sum(end - start for start, end in runs) != features.shape[0]:
            return None
        positions, delta = layout
        ids = mx.array(token_ids, mx.int32)[None]
        text = self._embed(ids)
        dtype = mx.result_type(text.dtype, features.dtype)  # mlx-vlm's mx.where promotes
        pieces, at, taken = [], 0, 0
        for start, end in runs:
            pieces += [text[:, at:start], features[None, taken : taken + end - start]]
            at, taken = end, taken + end - start
        pieces.append(text[:, at:])
        embeds = mx.concatenate([piece.astype(dtype) for piece in pieces if piece.shape[1]], axis=1)
        return InputEmbeddingsFeatures(inputs_embeds=embeds, position_ids=mx.array(positions[:, None, :], mx.int32),
                                       rope_deltas=mx.array([[delta]], mx.int32))


def same_merge(a: Any, b: Any) -> bool:
    """Two of mlx-vlm's merged embeddings (and positions, ...) equal bit for bit."""
    first, second = a.to_dict(), b.to_dict()
    return first.keys() == second.keys() and all(same(first[k], second[k]) for k in first)


def same(a: Any, b: Any) -> bool:
    """Equal values: arrays bit for bit (shape and dtype too), lists item by item, anything else by ==."""
    if isinstance(a, mx.array) and isinstance(b, mx.array):
        return a.shape == b.shape and a.dtype == b.dtype and bool(mx.array_equal(a, b).item())
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and (a is b or a == b)


__all__ = ["HostMerge", "same", "same_merge"]

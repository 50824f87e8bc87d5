"""Prefill of a prompt's text after its images once the images' KV is in the cache (the prefix cache kept it, or an
earlier chunk wrote it): another question on a picture already asked about, a chat's later turns. Such a chunk needs
no embedding of the prompt (no tower, no kept features, no mlx-vlm `get_input_embeddings` over the whole prompt):
it runs as the language model's text at offset + the prompt's M-RoPE delta, as its decode rows do, in one forward
with logits at its last position: through mlx-lm's text model of the family where the model has one (text_twin.py),
its rotary offset shifted by the delta (ShiftedPositions). Where the runner pads prefill shapes, that forward is
right-padded to a length bucket (prefill_shapes.py): on an H100 each new (length, cache offset) pair cost 37-58 ms
the first time against ~8 ms after, so every question of a new length on a cached image paid that (issue 54).

The delta is summed on the host over the images' grids (Qwen2/2.5-VL: qwen_positions.image_rope_delta), else taken
from mlx-vlm's own position index over the prompt's ids and grids; either is checked once against the delta
of a prompt embedded the usual way (`AfterImages.note_embedded`); until then, and for a family where they differ,
every chunk of a prompt with images keeps the embedding path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np

from engine.kv.batch_cache import LayerCaches
from engine.kv.cache_manager import media_end
from engine.models.head_split import HeadSplit
from engine.runner.prefill import PrefillResult, run_prefill
from engine.scheduler_output import NewRequest, PrefillChunk
from engine.vision.model import EmbeddedPrompt, VisionLanguageModel
from engine.vision.qwen_positions import image_rope_delta
from engine.vision.text_twin import TextTwin


@dataclass(frozen=True)
class ShiftedText:
    """The language model on text whose positions start at the cache offset + delta."""

    model: Callable[..., mx.array]
    split: HeadSplit | None


# Families whose position index places an image as image_rope_delta counts it (mlx-vlm's qwen2_vl and qwen2_5_vl).
HOST_DELTA_FAMILIES = frozenset({"qwen2_vl", "qwen2_5_vl"})


def rope_delta(model: VisionLanguageModel, token_ids: Sequence[int], arrays: dict[str, Any]) -> int | None:
    """The prompt's M-RoPE delta (0 for families without one): summed on the host over its images' grids where the
    family's index allows, else from mlx-vlm's position index; None where neither gives one."""
    if not model.uses_rope_deltas:
        return 0
    host = _host_rope_delta(model, token_ids, arrays)
    if host is not None:
        return host
    index = getattr(model.language_model, "get_rope_index", None)
    if index is None:
        return None
    ids = mx.array(token_ids, mx.int32)[None]
    grids = [mx.array(arrays[name]) if name in arrays else None for name in ("image_grid_thw", "video_grid_thw")]
    try:
        _, deltas = index(ids, *grids, mx.ones(ids.shape, mx.int32))
    except Exception:  # noqa: BLE001 — a family whose index takes other arguments: the embedding path stays
        return None
    return int(deltas.reshape(-1)[0].item())


def _host_rope_delta(model: VisionLanguageModel, token_ids: Sequence[int], arrays: dict[str, Any]) -> int | None:
    config = getattr(model.language_model, "config", None)
    grids = arrays.get("image_grid_thw")
    if getattr(config, "model_type", None) not in HOST_DELTA_FAMILIES or grids is None or "video_grid_thw" in arrays:
        return None
    rows = [[int(n) for n in row] for row in np.asarray(grids).reshape(-1, 3)]
    return image_rope_delta(token_ids, rows, config.vision_config.spatial_merge_size, config.image_token_id)


class ShiftedPositions:
    """One layer's cache of a request as a text model sees it when the request's text positions run `delta` ahead
    of its KV (M-RoPE text after images): the rotary offset is shifted; KV is written and masked where it is."""

    def __init__(self, cache: Any, delta: int) -> None:
        self._cache, self._delta = cache, delta

    @property
    def offset(self) -> Any:
        return self._cache.offset + self._delta

    def __getattr__(self, name: str) -> Any:  # update_and_fetch, make_mask, ...: the cache's own, at its own offset
        return getattr(self._cache, name)


def shifted_twin(twin: Any, delta: int, split: HeadSplit | None) -> ShiftedText:
    """mlx-lm's text model of the family (text_twin.py: mx.fast.rope; a one-row decode step of Qwen2.5-VL-3B took
    14.3 ms through it and 21.2 ms through mlx-vlm's M-RoPE on an H200) on text whose positions start at the cache
    offset + delta."""

    def shifted(cache: Any) -> Any:
        return [ShiftedPositions(layer, delta) for layer in cache] if delta and cache else cache

    def call(inputs: mx.array, cache: Any = None) -> mx.array:
        return twin(inputs, cache=shifted(cache))

    if split is None:
        return ShiftedText(call, None)
    return ShiftedText(call, HeadSplit(lambda inputs, cache=None: split.backbone(inputs, cache=shifted(cache)), split.head))


def shifted_text(model: VisionLanguageModel, delta: int, split: HeadSplit | None) -> ShiftedText:
    deltas = mx.array([[delta]])

    def call(inputs: mx.array, cache: Any = None) -> mx.array:
        return model(inputs, cache=cache, rope_deltas=deltas)

    if split is None or not model.uses_rope_deltas:
        return ShiftedText(call if model.uses_rope_deltas else model, split)
    backbone = model.language_model.model

    def hidden(inputs: mx.array, cache: Any = None) -> mx.array:
        return backbone(inputs, cache=cache, position_ids=model.text_positions(inputs, cache, deltas))

    return ShiftedText(call, HeadSplit(hidden, split.head))


class AfterImages:
    """Which chunks of prompts with images run as text after their images, and running them."""

    def __init__(self, model: VisionLanguageModel, split: HeadSplit | None, vocab_size: int,
                 twin: TextTwin | None = None, pad_shapes: bool = False) -> None:
        self.model, self.split, self.vocab_size, self.twin = model, split, vocab_size, twin
        self._rows_limit = 1 if pad_shapes else None  # one row per forward (deltas differ), padded to its bucket
        # Our delta == the embedding's (checked once). Families without M-RoPE keep the embedding path: Gemma 3's
        # text after an image, run as text, wrote other KV than from its embeddings.
        self.agrees: bool | None = None if model.uses_rope_deltas else False

    def note_embedded(self, request: NewRequest, embedded: EmbeddedPrompt) -> None:
        if self.agrees is None and request.vision is not None:
            delta = rope_delta(self.model, request.prompt_token_ids, request.vision.model_arrays)
            self.agrees = delta == embedded.rope_delta

    def delta(self, request: NewRequest, chunk: PrefillChunk, known: int | None = None) -> int | None:
        """The delta this chunk runs at as text (`known`: the request's, found before), or None: it holds media
        tokens, or comes before the prompt's last image, or the delta is not known to agree."""
        if not self.agrees or request.vision is None or chunk.start < media_end(request.cache_keys):
            return None
        if known is not None:
            return known
        return rope_delta(self.model, request.prompt_token_ids, request.vision.model_arrays)

    def run(self, chunks: list[PrefillChunk], caches: list[LayerCaches], deltas: list[int]) -> PrefillResult:
        """Each chunk alone (their deltas differ), one forward with logits at its last position (padded to a length
        bucket where the runner pads)."""
        result = PrefillResult([], [], None)
        for chunk, cache, delta in zip(chunks, caches, deltas):
            twin = self.twin
            text = shifted_twin(twin.model, delta, twin.split) if twin else shifted_text(self.model, delta, self.split)
            result = result.followed_by(run_prefill(text.model, [chunk], [cache], self._rows_limit, self.vocab_size,
                                                     text.split))
        return result


__all__ = ["AfterImages", "ShiftedPositions", "ShiftedText", "rope_delta", "shifted_text", "shifted_twin"]

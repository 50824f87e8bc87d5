"""A vision-language model (mlx-vlm's model classes) as the runner calls it.

Text runs exactly like an mlx-lm model: `model(tokens, cache=...)` gives logits, with the same caches and the
same batched decode. A prompt with images is embedded once (`embed_prompt`: the vision tower, merged into the
token embeddings by mlx-vlm's `get_input_embeddings`) and prefilled from those embeddings, chunk by chunk
(`prefill_embedded`), the way mlx-vlm's own `generate_step` does.

Models with multimodal rotary positions (Qwen-VL's M-RoPE) place text after an image at `offset + delta`, the
delta being fixed per request by its images: every call here passes explicit positions, never the language
model's own per-generation state (`_rope_deltas`, `_position_ids`), which one shared batch would corrupt.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.errors import ImagePixelsNeededError, ModelLoadError
from engine.models.head_split import HeadSplit, agrees
from engine.vision.feature_cache import FeatureCache, VisionTowerStats
from engine.vision.host_merge import HostMerge, same, same_merge
from engine.vision.inputs import VisionInputs, media_token_runs
from engine.vision.qwen_tower import WindowedTower
from engine.vision.tower_memory import TowerMemory

log = logging.getLogger(__name__)
PROBE_TOKENS = (1, 2, 3, 4, 5)
# The batched tower's first runs are waited for and timed (its cost per image token, which the scheduler charges to
# the step's prefill budget); later runs made inside a prompt's prefill stay lazy, computed with it. Towers run
# ahead of admission (EngineCore) are always waited for and timed.
TIMED_TOWER_RUNS = 8


@dataclass(eq=False)
class EmbeddedPrompt:
    """A prompt through the vision tower: its input embeddings [1, L, hidden] and what the language model reads
    with them (positions, ...), whole-prompt arrays the language model slices at its cache offset."""

    token_ids: mx.array  # [1, L]
    inputs_embeds: mx.array
    language_kwargs: dict[str, Any] = field(default_factory=dict)
    rope_delta: int = 0  # multimodal rotary positions: text after the images sits at offset + rope_delta


@dataclass(frozen=True, eq=False)
class MediaPrompt:
    """A prompt with images (or a video) as embed_prompts takes it."""

    token_ids: tuple[int, ...]
    vision: VisionInputs
    # Its images' kept features, taken when it came in without its pixels (held_features): what the cache evicts
    # later stays here.
    held_features: list[mx.array] | None = None


class VisionLanguageModel:
    """mlx-vlm's `Model` (vision tower + language model) behind the call the runner makes of an mlx-lm model."""

    def __init__(self, model: nn.Module, image_token_id: int | None = None) -> None:
        self.vlm = model
        self.image_token_id = image_token_id
        # Whether the family merges kept tower outputs (mlx-vlm's `cached_image_features`) exactly as its own: checked
        # on the first prompt with images (None: not yet; False: its features are never kept), and in which layout:
        # every image's rows end to end (Qwen's tower output) or one image per batch row (Gemma 3's projector's).
        self.reuses_features: bool | None = None if image_token_id is not None else False
        self.stacks_features = False
        # Whether it merges kept features the same with its pixels left out (stood in for by zeros): a prompt may
        # then come without them (VisionInputs.pixels_left_out). Checked with reuses_features.
        self.merges_without_pixels: bool | None = None
        # Seconds of the batched tower per image token it made (the median of its timed runs; None: not run yet):
        # the scheduler charges a prompt's images to the step's prefill budget by it (runner/vision_prefill.py).
        self.tower_s_per_token: float | None = None
        self._timed_s_per_token: list[float] = []
        self.tower_stats = VisionTowerStats()  # what a mix of text and image requests pays for the images
        self.tower_memory = TowerMemory()  # what its runs hold, per image token
        # Orchard's forward of the tower over a step's images at once (qwen_tower.py), checked on first use.
        tower = getattr(model, "vision_tower", None)
        self.batched_tower = WindowedTower(tower) if WindowedTower.fits(tower) else None
        # Its merge of given features from the host, no device reads (host_merge.py), beside the batched tower.
        self.host_merge = HostMerge(model) if self.batched_tower is not None and HostMerge.fits(model) else None
        self._tower_checked = False
        # mlx-lm's text model of the family on these weights (vision/text_twin.py): decode rows run through it.
        self.text_twin: nn.Module | None = None
        self.language_model = model.language_model
        if hasattr(self.language_model, "make_cache"):  # sliding-window families (Gemma 3): their own caches
            self.make_cache = self.language_model.make_cache
        probe = _text_probe(model)
        # Text positions passed explicitly, [B, L] (the language model's own text-only layout), where it takes them.
        self.uses_rope_deltas = _takes_text_positions(model, probe)
        # Image features enter the language model in its own dtype: a float32 vision tower beside a bf16 language
        # model would otherwise make the prompt's KV float32, and with it every decode row batched beside it.
        self.text_dtype = probe.inputs_embeds.dtype

    @property
    def layers(self) -> list[Any]:
        return self.language_model.layers

    def __call__(self, inputs: mx.array, cache: Any = None, rope_deltas: mx.array | None = None) -> mx.array:
        """Logits [B, L, vocab] of text tokens on top of `cache`; `rope_deltas` [B, 1]: each row's delta."""
        if not self.uses_rope_deltas:
            return self.language_model(inputs, cache=cache).logits
        return self.language_model(inputs, cache=cache, position_ids=self.text_positions(inputs, cache, rope_deltas)).logits

    @staticmethod
    def text_positions(inputs: mx.array, cache: Any, rope_deltas: mx.array | None) -> mx.array:
        """[B, L]: from each row's cache offset (+ its delta) on; one position for every M-RoPE axis, as text has."""
        batch, length = inputs.shape
        offset = cache[0].offset if cache else 0
        start = offset.reshape(-1, 1) if isinstance(offset, mx.array) else mx.array([[offset]])
        if rope_deltas is not None:
            start = start + rope_deltas
        return mx.broadcast_to(start + mx.arange(length)[None], (batch, length))

    def head_split(self) -> HeadSplit | None:
        """The language model as backbone + output head (prefill logits at the completing positions only: full
        logits of a 640-token prompt over Qwen's 152k vocabulary are 390 MB), where a probe forward agrees."""
        backbone = getattr(self.language_model, "model", None)
        if not callable(backbone):
            return None

        def hidden(inputs: mx.array, cache: Any = None) -> mx.array:
            if not self.uses_rope_deltas:
                return backbone(inputs, cache=cache)
            return backbone(inputs, cache=cache, position_ids=self.text_positions(inputs, cache, None))

        heads = [self.language_model.lm_head] if "lm_head" in self.language_model else []
        if hasattr(getattr(backbone, "embed_tokens", None), "as_linear"):
            heads.append(backbone.embed_tokens.as_linear)
        for head in heads:  # tied models may still carry an lm_head: the probe picks the one the call uses
            split = HeadSplit(hidden, head)
            if agrees(self, split):
                return split
        return None

    def embed_prompts(self, prompts: list[MediaPrompt], features: FeatureCache | None = None) -> list[EmbeddedPrompt]:
        """Embed several prompts (a step's new ones): with the batched tower, every image neither held nor kept goes
        through it in one forward; otherwise each prompt through embed_prompt."""
        tower = self._checked_tower()
        if tower is None or any(not _images_only(prompt.vision) for prompt in prompts):
            return [self.embed_prompt(p.token_ids, p.vision, features, p.held_features) for p in prompts]
        kept = [p.held_features or (features.lookup(p.vision.image_digests) if features is not None else None)
                for p in prompts]
        # Held features merge beside zeros of the pixels' shape where the family reads none (no host copy of them).
        pixels = [_stand_in(p.vision.model_pixel_shape()) if p.held_features is not None and self.merges_without_pixels
                  else _pixels(p.vision) for p in prompts]
        to_run = [(prompt.vision, p) for prompt, p, k in zip(prompts, pixels, kept) if k is None]
        fresh = iter(self._tower_features(to_run, features))
        embedded = []
        for prompt, prompt_pixels, images in zip(prompts, pixels, kept):
            images = images if images is not None else next(fresh)
            tokens = mx.array(prompt.token_ids, mx.int32)[None]
            arrays = {name: mx.array(value) for name, value in prompt.vision.model_arrays.items()}
            merged = self._merged(prompt, tokens, prompt_pixels, arrays, mx.concatenate(images) if len(images) > 1
                                  else images[0])
            embedded.append(self._embedded(tokens, merged, arrays))
        return embedded

    def _merged(self, prompt: MediaPrompt, tokens: mx.array, pixels: mx.array, arrays: dict[str, mx.array],
                features: mx.array) -> Any:
        """The prompt's images' features merged into its embeddings: from the host where the family allows
        (host_merge.py), else by mlx-vlm's get_input_embeddings."""
        def theirs() -> Any:
            return self.vlm.get_input_embeddings(tokens, pixels, mask=mx.ones(tokens.shape, mx.int32), **arrays,
                                                 cached_image_features=features)
        if self.host_merge is None:
            return theirs()
        grids = [tuple(int(n) for n in row) for row in prompt.vision.model_arrays["image_grid_thw"]]
        return self.host_merge.merged(prompt.token_ids, grids, features, theirs)

    def run_towers_ahead(
        self, visions: list[VisionInputs], features: FeatureCache | None
    ) -> tuple[list[list[mx.array] | None], list[int]]:
        """These prompts' images' features now: kept ones looked up (a hit or miss counted here, not again at their
        embedding), the others through the batched tower, waited for (the caller's stream): MLX's launch of a
        graph this size waits for most of it anyway (at most 10 command buffers in flight), and a request whose
        features are done can be admitted at once. Each prompt's features (None: not images the batched tower
        takes), and the prompts whose tower ran."""
        tower = self._checked_tower()
        takes = [i for i, vision in enumerate(visions) if tower is not None and _images_only(vision)]
        held: list[list[mx.array] | None] = [None] * len(visions)
        for i in takes:
            held[i] = features.lookup(visions[i].image_digests) if features is not None else None
        ran = [i for i in takes if held[i] is None]
        runs = self._tower_features([(visions[i], _pixels(visions[i])) for i in ran], features, wait=True)
        for i, images in zip(ran, runs):
            held[i] = images
        return held, ran

    def held_features(self, vision: VisionInputs, features: FeatureCache | None) -> list[mx.array]:
        """The kept features of a prompt sent without its pixels, each image's; ImagePixelsNeededError when some
        are not kept (evicted, a restarted engine), never_kept where this engine keeps none it could merge so."""
        if features is None or features.budget_bytes == 0 or False in (self.reuses_features, self.merges_without_pixels):
            raise ImagePixelsNeededError("This engine needs the images' pixels", never_kept=True)
        kept = features.lookup(vision.image_digests) if self.merges_without_pixels else None
        if kept is None:
            raise ImagePixelsNeededError("The engine no longer keeps these images' features")
        return kept

    def _tower_features(
        self, prompts: list[tuple[VisionInputs, mx.array]], features: FeatureCache | None, wait: bool = False
    ) -> list[list[mx.array]]:
        """Every image of these prompts (and their pixels) through the batched tower in one forward: each prompt's
        images' rows (kept by digest where the prompt names one per image); `wait`: computed and timed here."""
        if not prompts:
            return []
        assert self.batched_tower is not None
        visions = [vision for vision, _ in prompts]
        grids = [[tuple(int(n) for n in row) for row in vision.model_arrays["image_grid_thw"]] for vision in visions]
        pixels = mx.concatenate([p for _, p in prompts]) if len(prompts) > 1 else prompts[0][1]
        timed = wait or self.tower_stats.timed_runs < TIMED_TOWER_RUNS or self.tower_s_per_token is None
        held = self.tower_memory.before_run() if timed else 0
        started = time.perf_counter()
        out = self.batched_tower(pixels, [grid for prompt in grids for grid in prompt], waited=timed)
        unit = self.batched_tower.tower.spatial_merge_unit
        bounds = np.cumsum([0] + [t * h * w // unit for prompt in grids for t, h, w in prompt]).tolist()
        rows = [out[start:end] * 1 for start, end in zip(bounds, bounds[1:])]  # own buffers, kept apart
        self._count_tower_run(rows, bounds[-1], started, sum(len(prompt) for prompt in grids), timed)
        if timed:
            self.tower_memory.note_run(held, bounds[-1])
        per_prompt, taken = [], 0
        for vision, prompt in zip(visions, grids):
            images = rows[taken:taken + len(prompt)]
            taken += len(prompt)
            if features is not None and len(vision.image_digests) == len(images):
                for digest, image in zip(vision.image_digests, images):
                    features.put(digest, image)
            per_prompt.append(images)
        return per_prompt

    def _count_tower_run(self, rows: list[mx.array], tokens: int, started: float, images: int, timed: bool) -> None:
        """Time the run (waiting for it) where asked to or while the tower's cost is being learnt (`timed`); else
        count it at the learnt cost and leave it lazy (TIMED_TOWER_RUNS)."""
        if timed:
            mx.eval(rows)
            seconds = time.perf_counter() - started
            self._note_tower_time(seconds / max(1, tokens))
            self.tower_stats.timed_runs += 1
        else:
            seconds = tokens * self.tower_s_per_token
        self.tower_stats.images += images
        self.tower_stats.seconds += seconds

    def _note_tower_time(self, seconds_per_token: float) -> None:
        """The median, not a mean: a run that built kernels for a new shape takes seconds, and a rate it inflated
        would charge image prompts' prefill budget (vision_cost_tokens) for far more than their towers take."""
        self._timed_s_per_token.append(seconds_per_token)
        self.tower_s_per_token = float(np.median(self._timed_s_per_token))

    def _checked_tower(self) -> WindowedTower | None:
        """The batched tower once it agrees with mlx-vlm's and the family merges its features as its own tower's
        (checked at the first prompt with images)."""
        if not self._tower_checked:
            self._tower_checked = True
            tower = self.batched_tower
            if tower is not None and not (tower.agrees() and self._merges_probe_features(tower)):
                self.batched_tower = None
        return self.batched_tower

    def _merges_probe_features(self, tower: WindowedTower) -> bool:
        """The kept-features check (_merges_kept_features) on the tower's probe prompt, whose grids run mlx-vlm's
        own tower safely; it settles reuses_features. The batched tower hands features in the concatenated layout."""
        token_ids, arrays = tower.probe_prompt(self.vlm.config)
        ids, pixels = mx.array(token_ids, mx.int32)[None], tower.probe_pixels()
        try:
            merged = self.vlm.get_input_embeddings(ids, pixels, mask=mx.ones(ids.shape, mx.int32), **arrays)
        except Exception:  # noqa: BLE001 — a family whose prompts are laid out otherwise
            return False
        rows = [merged.inputs_embeds[0, start:end] for start, end in media_token_runs(token_ids, self.image_token_id)]
        self.reuses_features = self._merges_kept_features(merged, rows, (ids, pixels, arrays))
        return self.reuses_features and not self.stacks_features

    def _embedded(self, tokens: mx.array, merged: Any, arrays: dict[str, mx.array]) -> EmbeddedPrompt:
        extra = {k: v for k, v in merged.to_dict().items() if k != "inputs_embeds" and v is not None}
        delta = 0
        if self.uses_rope_deltas and extra.get("rope_deltas") is not None:
            delta = int(extra["rope_deltas"].reshape(-1)[0].item())
        return EmbeddedPrompt(tokens, merged.inputs_embeds.astype(self.text_dtype), {**arrays, **extra}, delta)

    def embed_prompt(
        self, token_ids: tuple[int, ...], vision: VisionInputs, features: FeatureCache | None = None,
        held: list[mx.array] | None = None,
    ) -> EmbeddedPrompt:
        """Run the vision tower over the prompt's images (or take their features: `held`, else kept in `features`)
        and merge them into its token embeddings."""
        ids = mx.array(token_ids, mx.int32)[None]
        arrays = {name: mx.array(value) for name, value in vision.model_arrays.items()}
        pixels = _pixels(vision)  # None: a video's frames
        keeps = features is not None and pixels is not None and bool(vision.image_digests) and self.reuses_features is not False
        kept = held or (features.lookup(vision.image_digests) if keeps else None)
        reuse = {} if kept is None else {"cached_image_features": self._kept_layout(kept)}
        merged = self.vlm.get_input_embeddings(ids, pixels, mask=mx.ones(ids.shape, mx.int32), **arrays, **reuse)
        if keeps and kept is None:
            self._keep_features(token_ids, vision.image_digests, merged, (ids, pixels, arrays), features)
        return self._embedded(ids, merged, arrays)

    def _keep_features(
        self, token_ids: tuple[int, ...], digests: tuple[str, ...], merged: Any, inputs: tuple, features: FeatureCache
    ) -> None:
        """Each image's rows of the merged embeddings (its tokens' run), kept by its digest. The first time, the
        family's merge of kept features is checked against its own (else nothing is ever kept)."""
        runs = media_token_runs(token_ids, self.image_token_id)
        if len(runs) != len(digests):  # images split in tiles, or placeholders the processor moved: not kept
            return
        rows = [merged.inputs_embeds[0, start:end] * 1 for start, end in runs]  # own buffers, not the prompt's
        mx.eval(rows)
        if self.reuses_features is None:
            self.reuses_features = self._merges_kept_features(merged, rows, inputs)
            if not self.reuses_features:
                log.info("%s: the vision tower's outputs are not kept (its merge of kept features differs)",
                         type(self.vlm).__module__)
                return
        for digest, row in zip(digests, rows):
            features.put(digest, row)

    def _kept_layout(self, rows: list[mx.array]) -> mx.array:
        if self.stacks_features:
            return mx.stack(rows)
        return mx.concatenate(rows) if len(rows) > 1 else rows[0]

    def _merges_kept_features(self, merged: Any, rows: list[mx.array], inputs: tuple) -> bool:
        """The family reads kept features (zeros change its embeddings) and merges them as its own tower's, in one
        of the two layouts (stacked needs images of equal token counts)."""
        ids, pixels, arrays = inputs

        def merge(features: mx.array, with_pixels: mx.array = pixels) -> Any:
            return self.vlm.get_input_embeddings(ids, with_pixels, mask=mx.ones(ids.shape, mx.int32), **arrays,
                                                 cached_image_features=features)
        for stacked in (False, True):
            if stacked and len({row.shape for row in rows}) != 1:
                break
            self.stacks_features = stacked
            kept = self._kept_layout(rows)
            try:
                again, zeros = merge(kept), merge(mx.zeros_like(kept))
            except Exception:  # noqa: BLE001 — a family that takes kept features in another shape
                continue
            if same_merge(merged, again):
                self.merges_without_pixels = _merges_alike(lambda: merge(kept, _stand_in(pixels.shape)), merged)
                return not same(merged.inputs_embeds, zeros.inputs_embeds)
        self.stacks_features = False
        return False

    def prefill_embedded(self, prompt: EmbeddedPrompt, start: int, end: int, cache: Any) -> mx.array:
        """Write prompt positions [start, end) to `cache` (which holds exactly `start`); their logits (lazy)."""
        output = self.language_model(
            prompt.token_ids[:, start:end], inputs_embeds=prompt.inputs_embeds[:, start:end], cache=cache,
            n_to_process=end - start, **prompt.language_kwargs,
        )
        return output.logits


def _images_only(vision: VisionInputs) -> bool:
    """Prompts the batched tower takes: images with their grid (not a video's frames)."""
    return vision.pixel_values is not None and "image_grid_thw" in vision.model_arrays and not vision.video_digests


def _pixels(vision: VisionInputs) -> mx.array | None:
    """The prompt's pixels on the device; zeros of their shape where they were left out (the merge of held
    features reads no pixel: merges_without_pixels)."""
    if vision.pixels_left_out:
        return _stand_in(vision.pixel_shape)
    if vision.pixel_values is None:
        return None
    pixels = mx.array(vision.pixel_values)
    if vision.pixel_frames == 1:
        return pixels
    # Folded (inputs.fold_repeated_frames): each frame repeated here, on the device, is the processor's layout
    # bit for bit; the host copied half the bytes.
    patches, channels, frame = pixels.shape
    repeated = mx.broadcast_to(pixels[:, :, None], (patches, channels, vision.pixel_frames, frame))
    return repeated.reshape(patches, channels * vision.pixel_frames * frame)


def _stand_in(shape: tuple[int, ...]) -> mx.array:
    return mx.zeros(shape, mx.float32)  # lazy: never computed where nothing reads it


def _merges_alike(merge: Any, merged: Any) -> bool:
    try:
        return same_merge(merge(), merged)
    except Exception:  # noqa: BLE001 — a family that reads the pixels' values or layout beside kept features
        return False


def _text_probe(model: nn.Module) -> Any:
    """mlx-vlm's own embedding path on a text prompt: what the language model gets for text."""
    ids = mx.array([PROBE_TOKENS], mx.int32)
    return model.get_input_embeddings(ids, None, mask=mx.ones(ids.shape, mx.int32))


def _takes_text_positions(model: nn.Module, probe: Any) -> bool:
    """Whether the language model takes rotary positions from the caller (M-RoPE families): the text probe says
    so. Positions laid out otherwise than we build them are refused at load rather than decoded wrong."""
    positions = probe.position_ids
    if positions is None:
        return False
    expected = mx.arange(len(PROBE_TOKENS))[None]
    if positions.shape != expected.shape or not bool(mx.array_equal(positions, expected).item()):
        raise ModelLoadError(
            f"{type(model).__module__}: its text positions have a layout Orchard does not build ({positions.shape})"
        )
    return True


__all__ = ["EmbeddedPrompt", "VisionLanguageModel"]

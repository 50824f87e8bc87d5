"""Prefill of prompts with images, from the embeddings their images were merged into.

Text prompts of a vision-language model take the batched path (prefill.py); a prompt with images needs its
embeddings in place of the image tokens' (VisionLanguageModel.embed_prompts, once per request). Where the model
splits into backbone + head on embedded prompts (vision/embedded_split.py), a step's chunks run together, with logits
at their last positions only: with padded shapes (the GPU's default) every chunk of one window, in the text path's
padded forwards; else its completing chunks of one window, right-padded. Other chunks run one request at a time through
the model's call, in windows, with a one-token tail forward for the completing position's logits (a short completing
chunk: one forward). A prompt's text after its images, once their KV is cached, runs as text instead
(text_after_images.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx

from engine.device_memory import on_gpu
from engine.kv.batch_cache import LayerCaches, cache_arrays, extract_request_cache, new_request_cache
from engine.kv.quantized_kv import is_quantized_request_cache
from engine.models.head_split import HeadSplit
from engine.request import Request
from engine.runner.plain_prefill import cache_offset, plain_prefill
from engine.runner.prefill import (
    MAX_FORWARD_TOKENS, PrefillResult, SharedBatch, merge_right_padded, padded_forwards,
)
from engine.runner.prefill_shapes import SHORT_FORWARD_LOGITS_TOKENS, bucket_length, group_rows
from engine.runner.text_after_images import AfterImages
from engine.scheduler_output import NewRequest, PrefillChunk
from engine.vision.feature_cache import FeatureCache
from engine.vision.embedded_split import POSITIONS, EmbeddedSplit, embedded_split, padded_rows
from engine.vision.model import EmbeddedPrompt, MediaPrompt, VisionLanguageModel
from engine.vision.text_twin import TextTwin

TEXT, TEXT_AFTER_IMAGES, WITH_IMAGES = 0, 1, 2  # a vision model's prefill chunks, in the order they run
log = logging.getLogger(__name__)
RunText = Callable[[list[PrefillChunk], list[LayerCaches]], PrefillResult]

# On a GPU a completing chunk of up to this many tokens runs in one forward whose logits cover every position (152k-
# vocabulary rows: 78 MB in bf16 at 256 tokens, 200 MB at a 672x672 image's 656), not a body forward and a one-token
# tail forward: the tail is a whole launch-bound forward of host time in a host-bound step (a repeated image's
# question, and each new image prompt at 32 streams, where the image_mix rate stayed at 0.61-0.66 of text-only's on
# the H200 at b4540fd). The text path's bound on full logits (prefill_shapes.py). Not on the CPU, where those
# logits cost more than the forward saved (a tiny Qwen2.5-VL's 207-token question: 444-530 ms against 86-95 ms in
# two forwards).
GPU_ONE_FORWARD_TOKENS = SHORT_FORWARD_LOGITS_TOKENS


def one_forward_tokens() -> int:
    return GPU_ONE_FORWARD_TOKENS if on_gpu() else 0


@dataclass
class SplitForward:
    """One forward of prompts with images through the split: the step's chunk indices it ran, their caches after
    it, its completing chunks' last-position logits (in index order), and, padded, the plain batch those caches
    are views of (for copying their KV: prefix cache, decode joins)."""

    rows: list[int]
    caches: list[LayerCaches]
    logits: mx.array | None
    batch: LayerCaches | None = None


def run_vision_prefill(
    model: VisionLanguageModel, chunks: list[PrefillChunk], caches: list[LayerCaches],
    prompts: dict[str, EmbeddedPrompt], one_forward: int = 0, split: EmbeddedSplit | None = None,
    rows_limit: int | None = None, vocab_size: int = 0,
) -> PrefillResult:
    """Each chunk through the model's call, but those the split takes: with a padded-rows limit (`rows_limit`,
    padded shapes), every chunk of one window, as the text path pads them (_padded_split_forwards); else the
    completing chunks of one window (_split_rows, _prefill_split). Caches and first-token logits in chunk order."""
    caches = list(caches)
    logits_at: dict[int, mx.array] = {}
    forwards = []
    if split is not None and rows_limit is not None:
        forwards = _padded_split_forwards(split, chunks, caches, prompts, rows_limit, vocab_size)
    elif split is not None:
        forwards = [_prefill_split(split, group, chunks, caches, prompts) for group in _split_rows(chunks, caches, prompts)]
    for forward in forwards:
        completing = [i for i in forward.rows if chunks[i].completes_prefill]
        for i, cache in zip(forward.rows, forward.caches):
            caches[i] = cache
        for row, i in enumerate(completing):
            logits_at[i] = forward.logits[row : row + 1]
    done = {i for forward in forwards for i in forward.rows}
    for i, (chunk, cache) in enumerate(zip(chunks, caches)):
        if i not in done:
            last = _prefill_alone(model, chunk, cache, prompts[chunk.request_id], one_forward)
            if last is not None:
                logits_at[i] = last
    order = sorted(logits_at)
    logits = None if not order else mx.concatenate([logits_at[i] for i in order]) if len(order) > 1 else logits_at[order[0]]
    shared = [SharedBatch(forward.batch, forward.rows) for forward in forwards if forward.batch is not None]
    return PrefillResult(caches, [chunks[i] for i in order], logits, shared)


def _prefill_alone(
    model: VisionLanguageModel, chunk: PrefillChunk, cache: LayerCaches, prompt: EmbeddedPrompt, one_forward: int
) -> mx.array | None:
    """One chunk through the model's call; a completing chunk's last-position logits [1, vocab]."""
    if chunk.completes_prefill and chunk.num_tokens <= one_forward:
        return model.prefill_embedded(prompt, chunk.start, chunk.end, cache)[:, -1, :]
    body_end = chunk.end - 1 if chunk.completes_prefill else chunk.end
    for start in range(chunk.start, body_end, MAX_FORWARD_TOKENS):
        model.prefill_embedded(prompt, start, min(start + MAX_FORWARD_TOKENS, body_end), cache)
        # Queued, not waited for (the engine thread goes on building the step), and the unused logits are
        # never computed.
        mx.async_eval(cache_arrays(cache))
    if not chunk.completes_prefill:
        return None
    return model.prefill_embedded(prompt, body_end, chunk.end, cache)[:, -1, :]


def _padded_split_forwards(
    split: EmbeddedSplit, chunks: list[PrefillChunk], caches: list[LayerCaches], prompts: dict[str, EmbeddedPrompt],
    rows_limit: int, vocab_size: int,
) -> list[SplitForward]:
    """The chunks of one window the split takes, in the text path's padded forwards (prefill.padded_forwards: by
    cache offset, length bucket and row bucket): shapes the text prefill's warm-up built, and plain caches with no
    array mask. Unpadded, a step's image prompts met a new (rows, length) nearly every step, each forward paying
    for new kernels and attention plans (70-190 ms on an H100, prefill_shapes.py), and a masked batched cache."""
    takes = [i for i, chunk in enumerate(chunks)
             if chunk.num_tokens <= MAX_FORWARD_TOKENS and EmbeddedSplit.takes(prompts[chunk.request_id])]
    if not takes:
        return []
    head = HeadSplit(split.backbone, split.head)
    forwards = []
    for group, rows in padded_forwards([chunks[i] for i in takes], [caches[i] for i in takes], vocab_size,
                                       rows_limit, head):
        indices = [takes[j] for j in group]
        forwards.append(_padded_split_forward(split, indices, chunks, caches, prompts, rows, vocab_size))
    return forwards


def _padded_split_forward(
    split: EmbeddedSplit, indices: list[int], chunks: list[PrefillChunk], caches: list[LayerCaches],
    prompts: dict[str, EmbeddedPrompt], rows: int, vocab_size: int,
) -> SplitForward:
    """These chunks (one cache offset) as plain_prefill runs text, the backbone fed their embeddings and positions,
    right-padded to the length bucket, with zero rows up to `rows` (its filler rows)."""
    group = [chunks[i] for i in indices]
    width = bucket_length(max(chunk.num_tokens for chunk in group))
    embedded = [prompts[chunk.request_id] for chunk in group]
    embeds = padded_rows([e.inputs_embeds[:, c.start : c.end] for e, c in zip(embedded, group)], 1, width)
    positions = padded_rows([e.language_kwargs[POSITIONS][..., c.start : c.end] for e, c in zip(embedded, group)], 2,
                            width)
    fillers = rows - len(group)
    if fillers > 0:
        embeds = mx.concatenate([embeds, mx.zeros((fillers, *embeds.shape[1:]), embeds.dtype)])
        filler_positions = mx.zeros((positions.shape[0], fillers, width), positions.dtype)
        positions = mx.concatenate([positions, filler_positions], axis=1)

    def backbone(tokens: mx.array, cache: Any = None) -> mx.array:
        return split.hidden(tokens, embeds, cache, positions)

    written, logits, batch = plain_prefill(backbone, group, [caches[i] for i in indices], vocab_size, rows,
                                           HeadSplit(backbone, split.head))
    return SplitForward(indices, written, logits, batch)


def _split_rows(chunks: list[PrefillChunk], caches: list[LayerCaches], prompts: dict[str, EmbeddedPrompt]) -> list[list[int]]:
    """The chunks the split runs, unpadded, as forwards: completing ones of one window, on caches of one offset and
    type that batch, grouped within the padding bound (group_rows)."""
    by_offset: dict[int, list[int]] = {}
    for i, (chunk, cache) in enumerate(zip(chunks, caches)):
        if (chunk.completes_prefill and chunk.num_tokens <= MAX_FORWARD_TOKENS and not is_quantized_request_cache(cache)
                and EmbeddedSplit.takes(prompts[chunk.request_id])):
            by_offset.setdefault(cache_offset(cache), []).append(i)
    forwards = []
    for rows in by_offset.values():
        forwards += [[rows[j] for j in group] for group in group_rows([chunks[i].num_tokens for i in rows])]
    return forwards


def _prefill_split(
    split: EmbeddedSplit, indices: list[int], all_chunks: list[PrefillChunk], all_caches: list[LayerCaches],
    prompts: dict[str, EmbeddedPrompt],
) -> SplitForward:
    """These completing chunks in one right-padded forward on a masked batched cache: their caches, and their last
    positions' logits."""
    chunks, caches = [all_chunks[i] for i in indices], [all_caches[i] for i in indices]
    embedded = [prompts[chunk.request_id] for chunk in chunks]
    lengths = [chunk.num_tokens for chunk in chunks]
    width = max(lengths)
    if len(chunks) == 1:
        tokens, batch, padded = embedded[0].token_ids[:, chunks[0].start : chunks[0].end], caches[0], False
    else:
        batch, tokens, padded = merge_right_padded(caches, [list(chunk.token_ids) for chunk in chunks], width)
    embeds = padded_rows([e.inputs_embeds[:, c.start : c.end] for e, c in zip(embedded, chunks)], 1, width)
    positions = padded_rows([e.language_kwargs[POSITIONS][..., c.start : c.end] for e, c in zip(embedded, chunks)], 2,
                            width)
    hidden = split.hidden(tokens, embeds, batch, positions)
    logits = split.head(hidden[mx.arange(len(chunks)), mx.array([n - 1 for n in lengths])])
    if len(chunks) == 1:
        return SplitForward(indices, caches, logits)
    if padded:
        for layer in batch:
            layer.finalize()
    return SplitForward(indices, [extract_request_cache(batch, row) for row in range(len(chunks))], logits)


def vision_cost_tokens(
    model: VisionLanguageModel, features: FeatureCache | None, request: Request, prefill_tokens_per_s: float | None
) -> int:
    """The time the vision tower will take over the request's images (none where their features are held or
    kept), as the prompt tokens the device prefills in that time: what the scheduler charges its step budget, so
    that a burst of images does not stall the decode rows for a whole batch of towers."""
    per_token = model.tower_s_per_token
    vision = request.vision
    if per_token is None or not prefill_tokens_per_s or vision is None or vision.pixel_values is None:
        return 0
    if request.held_image_features is not None or (features is not None and features.holds(vision.image_digests)):
        return 0
    return int(request.num_media_tokens * per_token * prefill_tokens_per_s)


class VisionPrompts:
    """A vision-language model's prefill beside the runner's text path: which of a step's chunks are text, text
    after their images (text_after_images.py) or need the prompt's embeddings (made at a request's first such
    chunk, kept to its last), and running them. `rope_deltas` is the runner's (its decode rows read them)."""

    def __init__(self, model: VisionLanguageModel, features: FeatureCache, split: HeadSplit | None, vocab_size: int,
                 rope_deltas: dict[str, int], twin: TextTwin | None = None, pad_shapes: bool = False,
                 max_rows: int = 1) -> None:
        self.model, self.features, self.rope_deltas = model, features, rope_deltas
        self.after_images = AfterImages(model, split, vocab_size, twin, pad_shapes)
        self._vocab_size = vocab_size
        self._rows_limit = max_rows if pad_shapes else None  # prompts with images padded as text is (run_vision_prefill)
        self._embedded: dict[str, EmbeddedPrompt] = {}
        self._kinds: dict[str, int] = {}  # this step's chunks'
        self._one_forward = one_forward_tokens()
        self._split: EmbeddedSplit | None = None  # prompts with images batched (embedded_split.py), once checked
        self._split_checked = False
        # The embedding (the tower's graph, mlx-vlm's merge and positions) is built on a stream of its own: the reads
        # back mlx-vlm makes there (token counts, the M-RoPE index, the rope delta) then wait for their own small
        # work, not for the decode step queued on the runner's stream; the tower and merge are computed, lazily,
        # with the prompt's prefill.
        self._stream = mx.new_stream(mx.default_device())
        # Towers run ahead of admission on a third stream: waited for there, they wait for themselves alone, not for
        # the embeddings of admitted prompts queued on the embedding's stream.
        self._tower_stream = mx.new_stream(mx.default_device())

    def order(self, chunks: list[PrefillChunk], requests: dict[str, NewRequest]) -> list[PrefillChunk]:
        self._kinds = {chunk.request_id: self._kind(chunk, requests[chunk.request_id]) for chunk in chunks}
        return sorted(chunks, key=lambda chunk: self._kinds[chunk.request_id])

    def _kind(self, chunk: PrefillChunk, request: NewRequest) -> int:
        if request.vision is None:
            return TEXT
        if chunk.request_id not in self._embedded:  # a prompt being embedded keeps that path to its end
            delta = self.after_images.delta(request, chunk, self.rope_deltas.get(chunk.request_id))
            if delta is not None:
                if delta:
                    self.rope_deltas[chunk.request_id] = delta
                return TEXT_AFTER_IMAGES
        return WITH_IMAGES

    def run(self, chunks: list[PrefillChunk], caches: list[LayerCaches], requests: dict[str, NewRequest],
            run_text: RunText) -> PrefillResult:
        """`chunks` as order() left them: text batched (run_text), text after images one prompt at a time, then
        the chunks of prompts with images, one request at a time."""
        kinds = [self._kinds[chunk.request_id] for chunk in chunks]
        split, images_from = kinds.count(TEXT), len(chunks) - kinds.count(WITH_IMAGES)
        result = run_text(chunks[:split], caches[:split]) if split else PrefillResult([], [], None)
        if split < images_from:
            after = chunks[split:images_from]
            deltas = [self.rope_deltas.get(chunk.request_id, 0) for chunk in after]
            result = result.followed_by(self.after_images.run(after, caches[split:images_from], deltas))
        if images_from == len(chunks):
            return result
        prompts = self._embedded_prompts([chunk.request_id for chunk in chunks[images_from:]], requests)
        images = run_vision_prefill(self.model, chunks[images_from:], caches[images_from:], prompts, self._one_forward,
                                    self._split_after(prompts), self._rows_limit, self._vocab_size)
        for chunk in chunks[images_from:]:
            if chunk.completes_prefill:
                self._embedded.pop(chunk.request_id)
        return result.followed_by(images)

    def _split_after(self, prompts: dict[str, EmbeddedPrompt]) -> EmbeddedSplit | None:
        """The model's embedded split, checked once on the first prompt that carries positions (embedded_split.py)."""
        if self._split_checked:
            return self._split
        probe = next((prompt for prompt in prompts.values() if EmbeddedSplit.takes(prompt)), None)
        if probe is None:
            return None
        self._split_checked = True
        self._split = embedded_split(self.model, probe, lambda: new_request_cache(self.model))
        log.info("vision prefill: prompts with images %s", "batched through the backbone and head (checked)"
                 if self._split is not None else "each through the model's call")
        return self._split

    def _embedded_prompts(self, request_ids: list[str], requests: dict[str, NewRequest]) -> dict[str, EmbeddedPrompt]:
        """The prompts' embeddings (their images through the vision tower), made at their first chunk: the
        step's new prompts together (one tower forward where the model has the batched tower)."""
        new = [requests[rid] for rid in request_ids if rid not in self._embedded]
        if new:
            prompts = [MediaPrompt(r.prompt_token_ids, r.vision, r.held_image_features) for r in new]
            with mx.stream(self._stream):
                embeddings = self.model.embed_prompts(prompts, self.features)
            for request, embedded in zip(new, embeddings):
                self._embedded[request.request_id] = embedded
                self.after_images.note_embedded(request, embedded)
                if embedded.rope_delta:
                    self.rope_deltas[request.request_id] = embedded.rope_delta
        return {rid: self._embedded[rid] for rid in request_ids}

    def run_towers_ahead(self, requests: list[Request]) -> list[Request]:
        """These requests' images' features now, on the towers' stream: kept ones, else through the batched
        tower, waited for. Each request holds its features (its prefill merges them and runs no tower). The
        requests whose tower ran."""
        with mx.stream(self._tower_stream):
            held, ran = self.model.run_towers_ahead([r.vision for r in requests], self.features)
        for request, features in zip(requests, held):
            if features is not None:
                request.held_image_features, request.vision_cost_tokens = features, 0
        return [requests[i] for i in ran]

    def forget(self, request_id: str) -> None:
        self._embedded.pop(request_id, None)

    def clear(self) -> None:
        self._embedded.clear()
        self.features.clear()


__all__ = ["VisionPrompts", "run_vision_prefill", "vision_cost_tokens"]

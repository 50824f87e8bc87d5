"""Prefill of prompts with images: each request on its own, from the embeddings its images were merged into.

Text prompts of a vision-language model take the batched path (prefill.py); a prompt with images needs its
embeddings in place of the image tokens' (VisionLanguageModel.embed_prompts, once per request), so its chunks run
one request at a time, in windows, with a one-token tail forward for the completing position's logits (a short
completing chunk: one forward). A prompt's text after its images, once their KV is cached, runs as text instead
(text_after_images.py).
"""

from __future__ import annotations

import mlx.core as mx

from engine.kv.batch_cache import LayerCaches, eval_caches
from engine.request import Request
from engine.runner.prefill import MAX_FORWARD_TOKENS, PrefillResult
from engine.scheduler_output import PrefillChunk
from engine.vision.feature_cache import FeatureCache
from engine.vision.model import EmbeddedPrompt, VisionLanguageModel

# A completing chunk this short runs in one forward whose logits cover every position (152k-vocabulary rows: 78 MB
# in bf16 at 256 tokens), not a body forward and a one-token tail forward: a repeated image's question (its image
# from the prefix cache) saves a whole forward of the language model.
ONE_FORWARD_TOKENS = 256


def run_vision_prefill(
    model: VisionLanguageModel, chunks: list[PrefillChunk], caches: list[LayerCaches],
    prompts: dict[str, EmbeddedPrompt],
) -> PrefillResult:
    completing: list[PrefillChunk] = []
    last_logits: list[mx.array] = []
    for chunk, cache in zip(chunks, caches):
        prompt = prompts[chunk.request_id]
        if chunk.completes_prefill and chunk.num_tokens <= ONE_FORWARD_TOKENS:
            completing.append(chunk)
            last_logits.append(model.prefill_embedded(prompt, chunk.start, chunk.end, cache)[:, -1, :])
            continue
        body_end = chunk.end - 1 if chunk.completes_prefill else chunk.end
        for start in range(chunk.start, body_end, MAX_FORWARD_TOKENS):
            model.prefill_embedded(prompt, start, min(start + MAX_FORWARD_TOKENS, body_end), cache)
            eval_caches(cache)  # the unused logits are never computed
        if chunk.completes_prefill:
            completing.append(chunk)
            last_logits.append(model.prefill_embedded(prompt, body_end, chunk.end, cache)[:, -1, :])
    logits = None if not last_logits else last_logits[0] if len(last_logits) == 1 else mx.concatenate(last_logits)
    return PrefillResult(list(caches), completing, logits)


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
    image_tokens = sum(1 for key in request.cache_keys if key < 0)
    return int(image_tokens * per_token * prefill_tokens_per_s)


__all__ = ["run_vision_prefill", "vision_cost_tokens"]

"""Prefill of prompts with images: each request on its own, from the embeddings its images were merged into.

Text prompts of a vision-language model take the batched path (prefill.py); a prompt with images needs its
embeddings in place of the image tokens' (VisionLanguageModel.embed_prompts, once per request), so its chunks run
one request at a time, in windows, with a one-token tail forward for the completing position's logits.
"""

from __future__ import annotations

import mlx.core as mx

from engine.kv.batch_cache import LayerCaches, eval_caches
from engine.runner.prefill import MAX_FORWARD_TOKENS, PrefillResult
from engine.scheduler_output import PrefillChunk
from engine.vision.model import EmbeddedPrompt, VisionLanguageModel


def run_vision_prefill(
    model: VisionLanguageModel, chunks: list[PrefillChunk], caches: list[LayerCaches],
    prompts: dict[str, EmbeddedPrompt],
) -> PrefillResult:
    completing: list[PrefillChunk] = []
    last_logits: list[mx.array] = []
    for chunk, cache in zip(chunks, caches):
        prompt = prompts[chunk.request_id]
        body_end = chunk.end - 1 if chunk.completes_prefill else chunk.end
        for start in range(chunk.start, body_end, MAX_FORWARD_TOKENS):
            model.prefill_embedded(prompt, start, min(start + MAX_FORWARD_TOKENS, body_end), cache)
            eval_caches(cache)  # the unused logits are never computed
        if chunk.completes_prefill:
            completing.append(chunk)
            last_logits.append(model.prefill_embedded(prompt, body_end, chunk.end, cache)[:, -1, :])
    logits = None if not last_logits else last_logits[0] if len(last_logits) == 1 else mx.concatenate(last_logits)
    return PrefillResult(list(caches), completing, logits)


__all__ = ["run_vision_prefill"]

"""A vision-language model's warm-up at load, per warm-up image size, through the serving path (chat template,
processor, vision tower, image prefill, decode with the image's positions): a synthetic image asked one question,
then the same image asked again at each follow-up length, so that neither a user's first image nor a later question
on it pays kernel builds. On a GPU the first images took seconds; a question after a cached image runs padded to
its length bucket (engine/runner/text_after_images.py), and each new (bucket, image offset) cost 37-58 ms the first
time on an H100 against ~8 ms after (issue 54): one follow-up per bucket up to 256 tokens builds those.

The images are synthetic (chat/synthetic_images.py, PNG); their answers are dropped. Sizes are `WxH` strings.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Awaitable, Callable

from deployments.chat.prompts import EncodedPrompt
from deployments.chat.synthetic_images import encode_image, parse_size, synthetic_image
from deployments.config import ModelConfig
from deployments.model_calls import ChatPrompt, ImageInput
from deployments.model.pixel_sends import EventStream
from engine.request import Request
from engine.sampling.params import SamplingParams

logger = logging.getLogger(__name__)
FIRST_QUESTION = "What is in this picture?"
# A follow-up's text after the image is its words, a "?" and the template's closing tokens: with Qwen2.5-VL's, 9, 25,
# 49, 97 and 193 tokens, in the length buckets 16 to 256 (prefill_shapes.LENGTH_BUCKETS).
FOLLOW_UP_WORDS = (4, 20, 44, 92, 188)
GPU_SIZES = ("448x448", "896x672")  # vision_warmup_sizes left out on a GPU; on the CPU none (no kernels to build)


def vision_warmup_sizes(config: ModelConfig) -> tuple[str, ...]:
    """The config's sizes, else the device's default."""
    if config.vision_warmup_sizes is not None:
        return tuple(config.vision_warmup_sizes)
    import mlx.core as mx  # here: building an application imports no MLX

    return GPU_SIZES if mx.default_device() == mx.gpu else ()


async def warm_vision(
    sizes: tuple[str, ...], encode: Callable[[ChatPrompt], Awaitable[EncodedPrompt]],
    submit: Callable[[Request, EncodedPrompt], EventStream],
) -> float:
    """Run requests of 2 tokens per size: one image asked FIRST_QUESTION, then the follow-ups (each takes the path
    of an image seen before: sent without its pixels as a user's repeat is (`submit`), its features kept, its blocks
    cached, the question prefilled after them); returns the seconds."""
    started = time.monotonic()
    questions = [FIRST_QUESTION, *(follow_up_question(words) for words in FOLLOW_UP_WORDS)]
    for size in sizes:
        width, height = parse_size(size)
        png = encode_image(synthetic_image(width, height, seed=0), "png")
        for question in questions:
            image = ImageInput(png, "vision_warmup_sizes", "image/png")
            content = [{"type": "image"}, {"type": "text", "text": question}]
            prompt = await encode(ChatPrompt([{"role": "user", "content": content}], images=[image]))
            request = Request(f"warmup-{size}-{uuid.uuid4().hex[:8]}", prompt.token_ids,
                              SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), vision=prompt.vision,
                              prompt_cache_keys=prompt.cache_keys)
            async for _ in submit(request, prompt):
                pass
    seconds = time.monotonic() - started
    if sizes:
        logger.info("vision warm-up: %s in %.1f s", ", ".join(sizes), seconds)
    return seconds


def follow_up_question(words: int) -> str:
    return " ".join(["picture"] * words) + "?"


__all__ = ["GPU_SIZES", "vision_warmup_sizes", "warm_vision"]

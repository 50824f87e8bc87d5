"""A vision-language model's warm-up at load: two short requests per warm-up image size, through the serving
path (chat template, processor, vision tower, image prefill, decode with the image's positions; then the same image
with another question), so that neither a user's first image nor the first repeated one pays kernel builds (on a
GPU they took seconds; a repeated image's first requests ran 3x slower than later ones, issue 54).

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
from engine.client.interface import RequestStream
from engine.request import Request
from engine.sampling.params import SamplingParams

logger = logging.getLogger(__name__)
WARMUP_QUESTIONS = ("What is in this picture?", "Which colours does it have, and where are they?")
GPU_SIZES = ("448x448", "896x672")  # vision_warmup_sizes left out on a GPU; on the CPU none (no kernels to build)


def vision_warmup_sizes(config: ModelConfig) -> tuple[str, ...]:
    """The config's sizes, else the device's default."""
    if config.vision_warmup_sizes is not None:
        return tuple(config.vision_warmup_sizes)
    import mlx.core as mx  # here: building an application imports no MLX

    return GPU_SIZES if mx.default_device() == mx.gpu else ()


async def warm_vision(
    sizes: tuple[str, ...], encode: Callable[[ChatPrompt], Awaitable[EncodedPrompt]],
    submit: Callable[[Request], RequestStream],
) -> float:
    """Run two requests of 2 tokens per size: one image with two questions (the second takes the path of an image
    seen before: its features kept, its blocks cached, the question prefilled after them); returns the seconds."""
    started = time.monotonic()
    for size in sizes:
        width, height = parse_size(size)
        png = encode_image(synthetic_image(width, height, seed=0), "png")
        for question in WARMUP_QUESTIONS:
            image = ImageInput(png, "vision_warmup_sizes", "image/png")
            content = [{"type": "image"}, {"type": "text", "text": question}]
            prompt = await encode(ChatPrompt([{"role": "user", "content": content}], images=[image]))
            request = Request(f"warmup-{size}-{uuid.uuid4().hex[:8]}", prompt.token_ids,
                              SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), vision=prompt.vision,
                              prompt_cache_keys=prompt.cache_keys)
            async for _ in submit(request):
                pass
    seconds = time.monotonic() - started
    if sizes:
        logger.info("vision warm-up: %s in %.1f s", ", ".join(sizes), seconds)
    return seconds


__all__ = ["GPU_SIZES", "vision_warmup_sizes", "warm_vision"]

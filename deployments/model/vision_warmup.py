"""A vision-language model's warm-up at load: one short request per warm-up image size, through the serving path
(chat template, processor, vision tower, image prefill, decode with the image's positions), so that the first
user image pays no kernel builds (on a GPU they took seconds; issue 54).

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
    """Run one request of 2 tokens per size; returns the seconds it took."""
    started = time.monotonic()
    for size in sizes:
        width, height = parse_size(size)
        png = encode_image(synthetic_image(width, height, seed=0), "png")
        image = ImageInput(png, "vision_warmup_sizes", "image/png")
        content = [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]
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

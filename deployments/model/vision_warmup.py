"""A vision-language model's warm-up at load: one short request per warm-up image size, through the serving path
(chat template, processor, vision tower, image prefill, decode with the image's positions), so that the first
user image pays no kernel builds (on a GPU they took seconds; issue 54).

The images are synthetic (a gradient with noise, PNG); their answers are dropped. Sizes are `WxH` strings.
"""

from __future__ import annotations

import io
import logging
import time
import uuid
from typing import Awaitable, Callable

import numpy as np

from deployments.chat.prompts import EncodedPrompt
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


def parse_size(size: str) -> tuple[int, int]:
    width, height = size.lower().split("x")
    return int(width), int(height)


def synthetic_png(width: int, height: int, seed: int = 0) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    x = np.linspace(0, 255, width)[None, :, None]
    y = np.linspace(0, 255, height)[:, None, None]
    pixels = np.concatenate([x + 0 * y, y + 0 * x, (x + y) / 2], axis=2) + rng.normal(0, 12, (height, width, 3))
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


async def warm_vision(
    sizes: tuple[str, ...], encode: Callable[[ChatPrompt], Awaitable[EncodedPrompt]],
    submit: Callable[[Request], RequestStream],
) -> float:
    """Run one request of 2 tokens per size; returns the seconds it took."""
    started = time.monotonic()
    for size in sizes:
        width, height = parse_size(size)
        image = ImageInput(synthetic_png(width, height), "vision_warmup_sizes", "image/png")
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


__all__ = ["GPU_SIZES", "parse_size", "synthetic_png", "vision_warmup_sizes", "warm_vision"]

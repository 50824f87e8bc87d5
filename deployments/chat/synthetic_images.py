"""Synthetic photographs for vision benchmarks (cli/loadgen) and a multimodal model's warm-up at load
(model/vision_warmup.py): seeded, different pixels per seed, encoded as real PNG / JPEG.

Each image is a smooth colour field (a seeded gradient), a few seeded ellipses and rectangles, and light
noise: it compresses like a photo (JPEG quality 90 at 672x672: ~60-100 KB) rather than like white noise
(~1.3 MB), and no two seeds share pixels, so neither Orchard's prefix cache (keyed by image content) nor
mlx-vlm's vision-feature cache (keyed by processed pixels) sees the same image twice unless a seed repeats.
Needs numpy and Pillow only.
"""

from __future__ import annotations

import base64
import io
from typing import Sequence, Union

import numpy as np
from PIL import Image, ImageDraw

FORMATS = {"jpeg": ("JPEG", "image/jpeg"), "png": ("PNG", "image/png")}
Seed = Union[int, Sequence[int]]  # non-negative ints


def image_tokens(width: int, height: int, patch_size: int = 14, merge_size: int = 2) -> int:
    """Placeholder tokens Qwen2.5-VL's processor gives an image whose sides are multiples of patch * merge
    (28 px) and within its min / max pixels (so it is not resized): one per 28x28 px."""
    unit = patch_size * merge_size
    return (height // unit) * (width // unit)


def synthetic_image(width: int, height: int, seed: Seed) -> Image.Image:
    rng = np.random.default_rng([*((seed,) if isinstance(seed, int) else seed), width, height])
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    corners = rng.uniform(0, 255, size=(4, 3)).astype(np.float32)
    fx, fy = (xs / max(width - 1, 1))[..., None], (ys / max(height - 1, 1))[..., None]
    field = (corners[0] * (1 - fx) * (1 - fy) + corners[1] * fx * (1 - fy)
             + corners[2] * (1 - fx) * fy + corners[3] * fx * fy)
    field += rng.normal(0, 6, size=field.shape).astype(np.float32)
    image = Image.fromarray(np.clip(field, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(4, 9))):
        x0, x1 = sorted(rng.integers(0, width, size=2).tolist())
        y0, y1 = sorted(rng.integers(0, height, size=2).tolist())
        colour = tuple(int(c) for c in rng.integers(0, 256, size=3))
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        shape((x0, y0, max(x1, x0 + 2), max(y1, y0 + 2)), fill=colour)
    return image


def encode_image(image: Image.Image, image_format: str = "jpeg") -> bytes:
    kind, _ = FORMATS[image_format]
    buffer = io.BytesIO()
    image.save(buffer, format=kind, **({"quality": 90} if kind == "JPEG" else {}))
    return buffer.getvalue()


def image_data_url(width: int, height: int, seed: Seed, image_format: str = "jpeg") -> str:
    """A `data:image/...;base64,` URL of the seed's image, as an OpenAI `image_url` part carries it."""
    _, media_type = FORMATS[image_format]
    data = encode_image(synthetic_image(width, height, seed), image_format)
    return f"data:{media_type};base64,{base64.b64encode(data).decode('ascii')}"


def parse_size(text: str) -> tuple[int, int]:
    """"672x672" (or "672") -> (width, height)."""
    width, _, height = text.lower().partition("x")
    return int(width), int(height or width)

"""Real image bytes made in a test: PNG noise, JPEG gradients, and a truncated PNG."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image


def png_bytes(width: int, height: int, seed: int = 0) -> bytes:
    """A PNG of random RGB noise: different seeds give images that differ everywhere."""
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return _encode(Image.fromarray(pixels, "RGB"), "PNG")


def jpeg_bytes(width: int, height: int, seed: int = 0, quality: int = 90) -> bytes:
    """A JPEG of smooth random colour waves (JPEG would smear noise into grey)."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    waves = [np.sin(xs * rng.uniform(0.02, 0.3) + ys * rng.uniform(0.02, 0.3) + rng.uniform(0, 6.3))
             for _ in range(3)]
    pixels = ((np.stack(waves, axis=-1) + 1) * 127.5).astype(np.uint8)
    return _encode(Image.fromarray(pixels, "RGB"), "JPEG", quality=quality)


def truncated_png_bytes(width: int = 64, height: int = 64, seed: int = 0) -> bytes:
    """A PNG cut in half: PIL opens it (signature and header are intact), decoding the pixels fails."""
    data = png_bytes(width, height, seed)
    return data[: len(data) // 2]


def _encode(image: Image.Image, fmt: str, **options: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()

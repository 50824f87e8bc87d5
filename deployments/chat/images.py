"""Images of a request, decoded and checked on the model side (in the tokenizing threads, off the event loop).

Each refusal is a 400 naming the image's place in the request and, where one applies, the limit.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from deployments.model_calls import ImageInput
from engine.errors import InvalidRequestError

# Formats every client API names (Anthropic: jpeg, png, gif, webp; OpenAI adds none), plus BMP.
MEDIA_TYPES = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif", "WEBP": "image/webp", "BMP": "image/bmp"}
# A side this short carries no picture (a 1x1 tracking pixel); processors divide images into 14-32 px patches.
MIN_IMAGE_SIDE = 2
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000
# OpenAI's detail "low" sees the image at 512 x 512 at most: here it is shrunk to fit that box (fewer image tokens).
LOW_DETAIL_SIDE = 512
# Pillow's own bomb check refuses at open, before the size is known; ours (max_image_pixels) reads the header
# first and names the size, before any pixel is decoded.
Image.MAX_IMAGE_PIXELS = None


@dataclass(frozen=True)
class DecodedImage:
    image: Image.Image  # RGB unless asked otherwise
    source: ImageInput


def decode_image(image: ImageInput, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, mode: str | None = "RGB") -> DecodedImage:
    """The image's pixels in `mode` (None: the file's own, e.g. an edit mask's alpha); InvalidRequestError naming
    it when it cannot be read or breaks a limit."""
    try:
        opened = Image.open(io.BytesIO(image.data))
    except (UnidentifiedImageError, OSError, ValueError):
        raise InvalidRequestError(
            f"The image at {image.param} is not an image Orchard can read (PNG, JPEG, GIF, WebP or BMP)", param=image.param
        ) from None
    with opened:
        _check_header(image, opened, max_pixels)
        try:
            opened.load()
            rgb = opened.convert(mode) if mode is not None else opened.copy()
            if image.detail == "low":
                rgb.thumbnail((LOW_DETAIL_SIDE, LOW_DETAIL_SIDE), Image.Resampling.BICUBIC)
        except (OSError, ValueError, SyntaxError) as exc:  # truncated or corrupt data
            raise InvalidRequestError(f"The image at {image.param} is truncated or corrupt ({exc})", param=image.param) from None
    return DecodedImage(rgb, image)


def _check_header(image: ImageInput, opened: Image.Image, max_pixels: int) -> None:
    kind = MEDIA_TYPES.get(opened.format or "")
    if kind is None:
        raise InvalidRequestError(
            f"The image at {image.param} is {opened.format or 'an unknown format'}; Orchard reads PNG, JPEG, GIF, "
            "WebP and BMP", param=image.param,
        )
    declared = _normalized(image.media_type)
    if declared is not None and declared != kind:
        raise InvalidRequestError(
            f"The image at {image.param} is declared as {image.media_type} but holds {kind} data", param=image.param
        )
    width, height = opened.size
    if width * height > max_pixels:
        raise _too_many_pixels(image, (width, height), max_pixels)
    if min(width, height) < MIN_IMAGE_SIDE:
        raise InvalidRequestError(
            f"The image at {image.param} is {width}x{height} pixels; images need at least {MIN_IMAGE_SIDE} pixels a side",
            param=image.param,
        )


def _normalized(media_type: str | None) -> str | None:
    if not media_type:
        return None
    kind = media_type.split(";", 1)[0].strip().lower()
    return "image/jpeg" if kind == "image/jpg" else kind


def _too_many_pixels(image: ImageInput, size: tuple[int, int], max_pixels: int) -> InvalidRequestError:
    return InvalidRequestError(
        f"The image at {image.param} is {size[0]}x{size[1]} pixels; this model takes at most {max_pixels:,} pixels "
        "an image (max_image_pixels)", param=image.param,
    )


__all__ = ["DecodedImage", "decode_image", "DEFAULT_MAX_IMAGE_PIXELS"]

"""An image request's pictures in and out (Pillow): edit inputs read and checked, results encoded, masks applied.

OpenAI's edit mask: where it is fully transparent the image is edited, elsewhere kept. The FLUX.2 [klein] editor
takes no mask, so the edit is made on the whole image and the kept region put back from the input (resized to the
output), the mask's alpha as the blend: an unmasked pixel comes out as it went in.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from deployments.chat.images import decode_image
from deployments.model_calls import ImageInput
from engine.errors import InvalidRequestError

PIL_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}
MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


@dataclass
class EditInputs:
    """An edit's first image and its mask's alpha (both PIL images), for putting the kept region back."""

    image: object
    alpha: object


def edit_inputs(images: list[bytes], mask: bytes | None, max_pixels: int) -> EditInputs | None:
    """The images checked readable (the chat routes' decoder: format, pixel limit, corruption), and the mask (if
    any) checked against the first: same size, an alpha channel. Decodes pixels: call it off the event loop."""
    if not images:
        raise InvalidRequestError("An edit needs 'image': the image (or images) to edit", param="image")
    first = decode_image(ImageInput(images[0], "image"), max_pixels).image
    for index, data in enumerate(images[1:], start=1):
        decode_image(ImageInput(data, f"image[{index}]"), max_pixels)
    if mask is None:
        return None
    masked = decode_image(ImageInput(mask, "mask"), max_pixels, mode=None).image
    if masked.size != first.size:
        raise InvalidRequestError(f"'mask' is {masked.width}x{masked.height} but 'image' is {first.width}x"
                                  f"{first.height}: they must be the same size", param="mask")
    if "A" not in masked.getbands():
        raise InvalidRequestError("'mask' has no alpha channel: its transparent pixels say where to edit (a PNG "
                                  "with transparency)", param="mask")
    return EditInputs(first, masked.getchannel("A"))


def encoded(image, output_format: str, quality: int, kept: EditInputs | None = None) -> bytes:
    """The result in the asked format; with `kept`, the input put back where the mask is not transparent."""
    from PIL import Image

    image = image.convert("RGB")
    if kept is not None:
        original = kept.image.resize(image.size)
        image = Image.composite(original, image, kept.alpha.resize(image.size))
    out = io.BytesIO()
    options = {"quality": quality} if output_format in ("jpeg", "webp") else {}
    image.save(out, PIL_FORMATS[output_format], **options)
    return out.getvalue()


__all__ = ["EditInputs", "MEDIA_TYPES", "edit_inputs", "encoded"]

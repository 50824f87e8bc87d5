"""A chat prompt with images, for a vision-language model: its token ids (each image expanded to its tokens by the
model's processor), the processor's arrays for the engine, and the prompt as the prefix cache keys it.

Runs in the model replica's tokenizing threads: decoding and resizing images never block the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from deployments.chat.images import DecodedImage, decode_image
from deployments.model_calls import ImageInput
from engine.errors import InvalidRequestError
from engine.vision.inputs import VisionInputs, cache_key_ids, image_digest

# What the engine gets apart: the token ids (the request's prompt) and the pixels; the mask is all ones.
_NOT_MODEL_ARRAYS = frozenset({"input_ids", "attention_mask", "pixel_values"})


@dataclass
class VisionPrompt:
    token_ids: list[int]
    vision: VisionInputs
    cache_keys: tuple[int, ...]


class VisionPromptEncoder:
    def __init__(self, processor: Any, image_token_id: int, max_image_pixels: int) -> None:
        self._processor = processor
        self._image_token_id = image_token_id
        self._max_image_pixels = max_image_pixels

    def encode(self, text: str, images: list[ImageInput]) -> VisionPrompt:
        """`text`: the rendered chat prompt with the template's image placeholders, one per image, in order."""
        decoded = [decode_image(image, self._max_image_pixels) for image in images]
        inputs = self._processed(text, decoded)
        token_ids = [int(t) for t in np.asarray(inputs["input_ids"]).reshape(-1)]
        digests = tuple(image_digest(d.image.mode, d.image.size, d.image.tobytes()) for d in decoded)
        arrays = {
            name: np.asarray(value) for name, value in inputs.items()
            if name not in _NOT_MODEL_ARRAYS and value is not None and not isinstance(value, (str, list))
        }
        vision = VisionInputs(np.asarray(inputs["pixel_values"]), arrays, digests)
        return VisionPrompt(token_ids, vision, cache_key_ids(token_ids, self._image_token_id, digests))

    def _processed(self, text: str, decoded: list[DecodedImage]) -> dict[str, Any]:
        """The model's processor on the rendered prompt: it expands each image placeholder to the image's tokens.
        The template already wrote the special tokens the model expects (mlx-vlm's own preparation lets Gemma 3's
        tokenizer add a second <bos>)."""
        try:
            inputs = dict(self._processor(text=[text], images=[d.image for d in decoded], add_special_tokens=False))
        except Exception as exc:  # processors raise many types (placeholder/image count mismatches, sizes)
            raise InvalidRequestError(
                f"The model's processor could not prepare these images: {exc}", param=decoded[0].source.param
            ) from None
        if inputs.get("pixel_values") is None:
            raise InvalidRequestError(
                "The model's chat template placed no image in the prompt: it may not take images this way",
                param=decoded[0].source.param,
            )
        found = int(np.count_nonzero(np.asarray(inputs["input_ids"]) == self._image_token_id))
        if found == 0:
            raise InvalidRequestError(
                "The prompt holds no image tokens after processing: this chat template does not place images",
                param=decoded[0].source.param,
            )
        return inputs


__all__ = ["VisionPrompt", "VisionPromptEncoder"]

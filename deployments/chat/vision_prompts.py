"""A chat prompt with images, for a vision-language model: its token ids (each image expanded to its tokens by the
model's processor), the processor's arrays for the engine, and the prompt as the prefix cache keys it.

Runs in the model replica's tokenizing threads: decoding and resizing images never block the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from deployments.chat.images import decode_image
from deployments.chat.processed_images import ImageReuse, ProcessedImages, images_key
from deployments.chat.videos import decode_video, video_digest
from deployments.model_calls import ImageInput, VideoInput
from engine.errors import InvalidRequestError
from engine.vision.inputs import VisionInputs, cache_key_ids, fold_repeated_frames, image_digest

# What the engine gets apart: the token ids (the request's prompt) and the pixels; the mask is all ones.
_NOT_MODEL_ARRAYS = frozenset({"input_ids", "attention_mask", "pixel_values"})


@dataclass(frozen=True)
class MediaTokens:
    """The model's placeholder token ids: each image's (and each video's, where the model takes video) embeddings
    replace a run of them."""

    image: int
    video: int | None = None


@dataclass
class VisionPrompt:
    token_ids: list[int]
    vision: VisionInputs
    cache_keys: tuple[int, ...]
    # Its images were processed for an earlier request (processed_images.py): the engine was sent them lately.
    images_repeated: bool = False


@dataclass(frozen=True)
class RepeatedFrames:
    """The image processor's temporal patch (Qwen2-VL's: a still image's frame twice in every patch row), folded to
    one frame before the pixels go to the engine (engine/vision/inputs.fold_repeated_frames)."""

    frames: int = 1
    frame_pixels: int = 0

    @classmethod
    def of(cls, processor: Any) -> "RepeatedFrames":
        images = getattr(processor, "image_processor", None)
        frames, patch = getattr(images, "temporal_patch_size", None), getattr(images, "patch_size", None)
        if not isinstance(frames, int) or not isinstance(patch, int) or frames < 2:
            return cls()
        return cls(frames, patch * patch)

    def fold(self, pixels: np.ndarray) -> np.ndarray | None:
        return fold_repeated_frames(pixels, self.frames, self.frame_pixels) if self.frames > 1 else None


class VisionPromptEncoder:
    def __init__(self, processor: Any, tokens: MediaTokens, max_image_pixels: int, reuse_bytes: int = 0) -> None:
        self._processor = processor
        self._tokens = tokens
        self._max_image_pixels = max_image_pixels
        self._reuse = ImageReuse(reuse_bytes, tokens.image, self._text_alone)
        self._frames = RepeatedFrames.of(processor)

    def encode(self, text: str, images: list[ImageInput], videos: list[VideoInput] | None = None) -> VisionPrompt:
        """`text`: the rendered chat prompt with the template's placeholders, one per image and video, in order."""
        videos = videos or []
        self._check_kinds(images, videos)
        key = images_key(images) if images and not videos and self._reuse.expands is not False else None
        reused = self._reuse.processed(text, key) if key is not None else None
        if reused is not None:
            kept = reused.images
            vision = VisionInputs(kept.pixel_values, kept.image_arrays, kept.image_digests,
                                  pixel_frames=kept.pixel_frames)
            keys = cache_key_ids(reused.token_ids, [(self._tokens.image, kept.image_digests)])
            return VisionPrompt(reused.token_ids, vision, keys, images_repeated=True)
        decoded = [decode_image(image, self._max_image_pixels).image for image in images]
        frames = [decode_video(video, self._processor, self._max_image_pixels) for video in videos]
        first = (images or videos)[0].param
        inputs = self._processed(text, decoded, frames, first)
        token_ids = [int(t) for t in np.asarray(inputs["input_ids"]).reshape(-1)]
        image_digests = tuple(image_digest(image.mode, image.size, image.tobytes()) for image in decoded)
        video_digests = tuple(video_digest(video) for video in frames)
        arrays = {
            name: np.asarray(value) for name, value in inputs.items()
            if name not in _NOT_MODEL_ARRAYS and value is not None and not isinstance(value, (str, list))
        }
        pixels = np.asarray(inputs["pixel_values"]) if inputs.get("pixel_values") is not None else None
        folded = self._frames.fold(pixels) if pixels is not None and images else None
        pixel_frames = 1 if folded is None else self._frames.frames
        pixels = pixels if folded is None else folded
        vision = VisionInputs(pixels, arrays, image_digests, video_digests, pixel_frames=pixel_frames)
        media = [(self._tokens.image, image_digests)]
        if self._tokens.video is not None:
            media.append((self._tokens.video, video_digests))
        if key is not None and pixels is not None:
            kept = ProcessedImages(pixels, arrays, image_digests, pixel_frames=pixel_frames)
            self._reuse.remember(text, key, token_ids, kept)
        return VisionPrompt(token_ids, vision, cache_key_ids(token_ids, media))

    def _text_alone(self, text: str) -> dict[str, Any]:
        return dict(self._processor(text=[text], add_special_tokens=False))

    def _check_kinds(self, images: list[ImageInput], videos: list[VideoInput]) -> None:
        if videos and self._tokens.video is None:
            raise InvalidRequestError("This model takes images, not video", param=videos[0].param)
        if images and videos:  # mlx-vlm's models merge one kind of media per prompt
            raise InvalidRequestError(
                "A request may hold images or a video, not both: this model's code takes one kind at a time",
                param=videos[0].param)

    def _processed(self, text: str, images: list[Any], videos: list[np.ndarray], param: str) -> dict[str, Any]:
        """The model's processor on the rendered prompt: it expands each placeholder to the image's (video's) tokens.
        The template already wrote the special tokens the model expects (mlx-vlm's own preparation lets Gemma 3's
        tokenizer add a second <bos>)."""
        media: dict[str, Any] = {"images": images} if images else {"videos": videos}
        try:
            inputs = dict(self._processor(text=[text], add_special_tokens=False, **media))
        except Exception as exc:  # processors raise many types (placeholder/image count mismatches, sizes)
            raise InvalidRequestError(f"The model's processor could not prepare this media: {exc}", param=param) from None
        token = self._tokens.image if images else self._tokens.video
        if int(np.count_nonzero(np.asarray(inputs["input_ids"]) == token)) == 0:
            raise InvalidRequestError(
                "The prompt holds no image tokens after processing: this chat template does not place media",
                param=param)
        return inputs


__all__ = ["VisionPrompt", "VisionPromptEncoder"]

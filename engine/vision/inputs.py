"""A prompt's images as the engine takes them: plain numpy arrays (they cross to the engine process pickled),
and the prompt as the prefix cache sees it, where image tokens are keyed by their image's content.

No MLX here: the serving side builds these, the runner turns them into arrays on the device.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np


@dataclass(frozen=True, eq=False)
class VisionInputs:
    """What the model's processor made of a prompt's images (mlx-vlm's `get_input_embeddings` inputs)."""

    pixel_values: np.ndarray | None  # the images' (None: a prompt whose media is a video, or pixels left out)
    # The processor's other arrays the model reads with the pixels (Qwen's image_grid_thw, a video's
    # pixel_values_videos and video_grid_thw, ...), by name.
    model_arrays: dict[str, np.ndarray] = field(default_factory=dict)
    # One digest per image (of its decoded pixels) and per video (of its sampled frames), in prompt order.
    image_digests: tuple[str, ...] = ()
    video_digests: tuple[str, ...] = ()
    # Sent without its pixels (pixel_values None): the engine merges its images' kept features; their shape stands in.
    pixels_left_out: bool = False
    pixel_shape: tuple[int, ...] = ()
    # The processor's frames sent once (fold_repeated_frames): pixel_values is then [patches, channels, frame
    # pixels], and the engine repeats each frame this many times on the device.
    pixel_frames: int = 1

    def model_pixel_shape(self) -> tuple[int, ...]:
        """The pixels' shape as the model takes them (frames repeated), whether sent, folded or left out."""
        if self.pixels_left_out:
            return self.pixel_shape
        assert self.pixel_values is not None
        if self.pixel_frames == 1:
            return tuple(self.pixel_values.shape)
        patches, channels, frame = self.pixel_values.shape
        return patches, channels * self.pixel_frames * frame

    def without_pixels(self) -> "VisionInputs":
        """The same images for an engine that keeps their features: the pixels (10.8 MB for one 672x672 image in
        float32) are not sent."""
        assert self.pixel_values is not None and self.image_digests and not self.video_digests
        return replace(self, pixel_values=None, pixels_left_out=True, pixel_shape=self.model_pixel_shape(),
                       pixel_frames=1)


def fold_repeated_frames(pixels: np.ndarray, frames: int, frame_pixels: int) -> np.ndarray | None:
    """Pixels whose rows hold, per channel, `frames` frames of `frame_pixels` values each, all equal bit for bit
    (Qwen2-VL's processor repeats a still image along its temporal patch: [patches, channels*frames*frame_pixels]),
    as one frame per channel: [patches, channels, frame_pixels], half the bytes to pickle and upload at 2 frames.
    None where the rows do not split so or some frame differs (a video's)."""
    if frames < 2 or frame_pixels < 1 or pixels.ndim != 2 or pixels.shape[1] % (frames * frame_pixels):
        return None
    bits = np.ascontiguousarray(pixels).view(np.dtype(f"u{pixels.dtype.itemsize}"))
    bits = bits.reshape(pixels.shape[0], -1, frames, frame_pixels)
    if any(not np.array_equal(bits[:, :, 0], bits[:, :, t]) for t in range(1, frames)):
        return None
    return np.ascontiguousarray(pixels.reshape(bits.shape)[:, :, 0])


def image_digest(mode: str, size: tuple[int, int], pixels: bytes) -> str:
    """One image's identity: its decoded pixels, so the same picture in another encoding is the same image."""
    digest = hashlib.sha256(f"{mode}:{size[0]}x{size[1]}:".encode())
    digest.update(pixels)
    return digest.hexdigest()


def cache_key_ids(token_ids: Sequence[int], media: Sequence[tuple[int, Sequence[str]]]) -> tuple[int, ...]:
    """The prompt with each media token replaced by a negative id derived from its image's (or video's) digest;
    `media`: (placeholder token id, the digests of that kind's items in prompt order), per kind.

    Prefix-cache blocks are hashed over these ids, so a block holding image tokens matches only the same image
    at the same place. Each run of a kind's tokens is one item when the counts agree; otherwise (processors that
    split an image in tiles) every such token is keyed by all the prompt's items of that kind together.
    """
    out = list(token_ids)
    for token_id, digests in media:
        runs = media_token_runs(token_ids, token_id)
        if not runs or not digests:
            continue
        if len(runs) == len(digests):
            keys = [_negative_id(d) for d in digests]
        else:
            keys = [_negative_id(hashlib.sha256("+".join(digests).encode()).hexdigest())] * len(runs)
        for (start, end), key in zip(runs, keys):
            out[start:end] = [key] * (end - start)
    return tuple(out)


def media_token_runs(token_ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """[start, end) of each run of the placeholder token in the prompt."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, token in enumerate(token_ids):
        if token == image_token_id and start is None:
            start = i
        elif token != image_token_id and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(token_ids)))
    return runs


def _negative_id(digest: str) -> int:
    """Below every real token id (vocabularies count from 0), 56 bits of the digest."""
    return -1 - int(digest[:14], 16)


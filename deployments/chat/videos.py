"""Videos of a request, decoded on the model side (tokenizing threads): frames sampled as the model's processor
asks (mlx-vlm's sampling: ~2 frames a second, 4 to 16 frames for Qwen-VL), each checked like an image.

A video file is written to a private temporary file for OpenCV to read (it reads files, not memory) and removed.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Any

import numpy as np

from deployments.chat.images import MIN_IMAGE_SIDE, decode_image
from deployments.model_calls import VideoInput
from engine.errors import InvalidRequestError

# Frames given one by one are decoded before sampling: a bound on that work (a video file is sampled while read).
MAX_VIDEO_FRAMES = 256
_SUFFIXES = {"video/mp4": ".mp4", "video/webm": ".webm", "video/quicktime": ".mov", "video/x-matroska": ".mkv"}


def decode_video(video: VideoInput, processor: Any, max_pixels: int) -> np.ndarray:
    """The video's sampled frames, [frames, height, width, 3] uint8; InvalidRequestError naming it."""
    from mlx_vlm.utils import resolve_video_sampling

    sampling = resolve_video_sampling(processor, {})
    frames = _frames_of_images(video, max_pixels) if video.frames else _frames_of_file(video, sampling, max_pixels)
    return _sampled(frames, sampling.max_frames, sampling.min_frames)


def video_digest(frames: np.ndarray) -> str:
    digest = hashlib.sha256(f"video:{frames.shape}:".encode())
    digest.update(np.ascontiguousarray(frames).tobytes())
    return digest.hexdigest()


def _frames_of_images(video: VideoInput, max_pixels: int) -> np.ndarray:
    if len(video.frames) > MAX_VIDEO_FRAMES:
        raise InvalidRequestError(
            f"The video at {video.param} has {len(video.frames)} frames; give at most {MAX_VIDEO_FRAMES} (the model "
            "samples a few of them)", param=video.param)
    images = [decode_image(frame, max_pixels).image for frame in video.frames]
    size = images[0].size
    if any(image.size != size for image in images):
        raise InvalidRequestError(f"The video at {video.param}: its frames differ in size", param=video.param)
    return np.stack([np.asarray(image) for image in images])


def _frames_of_file(video: VideoInput, sampling: Any, max_pixels: int) -> np.ndarray:
    from mlx_vlm.utils import load_video

    handle, path = tempfile.mkstemp(suffix=_SUFFIXES.get(video.media_type or "", ".mp4"))
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(video.data)
        frames, metadata = load_video(path, sampling)
    except Exception as exc:  # OpenCV and mlx-vlm's sampling raise many types on data they cannot read
        raise InvalidRequestError(f"The video at {video.param} could not be read ({exc})", param=video.param) from None
    finally:
        os.unlink(path)
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[0] == 0:
        raise InvalidRequestError(f"The video at {video.param} has no frames Orchard can read", param=video.param)
    if frames.shape[1] == 3:  # mlx-vlm's loader gives [frames, 3, height, width]
        frames = frames.transpose(0, 2, 3, 1)
    height, width = frames.shape[1:3]
    if height * width > max_pixels or min(height, width) < MIN_IMAGE_SIDE:
        raise InvalidRequestError(
            f"The video at {video.param} is {width}x{height} pixels a frame; frames need {MIN_IMAGE_SIDE} to "
            f"{max_pixels:,} pixels (max_image_pixels)", param=video.param)
    return frames


def _sampled(frames: np.ndarray, max_frames: int, min_frames: int) -> np.ndarray:
    """At most max_frames, evenly spread; an even count (Qwen-VL pairs frames in time), repeating the last if short."""
    if len(frames) > max_frames:
        frames = frames[np.linspace(0, len(frames) - 1, max_frames).round().astype(int)]
    wanted = max(min_frames, len(frames) + len(frames) % 2)
    if len(frames) < wanted:
        frames = np.concatenate([frames, np.repeat(frames[-1:], wanted - len(frames), axis=0)])
    return frames


__all__ = ["decode_video", "video_digest"]

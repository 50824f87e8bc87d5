"""What the model's processor made of a request's images, kept by the images' bytes: a request that sends the same
images again (another question on a picture, a chat's next turn) skips decoding them and the processor's resize and
normalisation (~30 ms of CPU for one 672x672 image); only its text is tokenized, each image's placeholder token
expanded to the run of image tokens the processor made of that image before.

Used where that expansion gives the processor's own answer: checked once, on the first prompt with images
(`ImageReuse.remember`), against the processor's output for that same prompt.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np

from deployments.model_calls import ImageInput
from engine.device_memory import host_memory_bytes
from engine.vision.feature_cache import FeatureCache
from engine.vision.inputs import media_token_runs

# What the processor makes of the text: the token ids and their mask; every other array is made of the images.
TEXT_ARRAYS = frozenset({"input_ids", "attention_mask"})


@dataclass(frozen=True, eq=False)
class ProcessedImages:
    """A request's images as the processor made them, in prompt order."""

    pixel_values: np.ndarray
    image_arrays: dict[str, np.ndarray]  # the processor's other arrays of the images (Qwen's image_grid_thw)
    image_digests: tuple[str, ...]  # of the decoded pixels (engine/vision/inputs.py)
    token_runs: tuple[int, ...] = ()  # how many image tokens each image became
    pixel_frames: int = 1  # VisionInputs.pixel_frames: the pixels' repeated frames sent once

    @property
    def nbytes(self) -> int:
        return int(self.pixel_values.nbytes) + sum(int(a.nbytes) for a in self.image_arrays.values())


@dataclass(frozen=True, eq=False)
class ReusedPrompt:
    token_ids: list[int]  # the text's, each placeholder expanded to its image's tokens
    images: ProcessedImages


def reuse_budget(configured: int | None) -> int:
    """processed_image_cache_bytes: the configured bytes, else 1% of the machine's RAM."""
    return host_memory_bytes() // 100 if configured is None else configured


def images_key(images: Sequence[ImageInput]) -> str:
    """The images as sent (bytes, declared type, detail): the same key means the same processor output."""
    digest = hashlib.sha256()
    for image in images:
        digest.update(f"{image.media_type}|{image.detail}|{len(image.data)}|".encode())
        digest.update(image.data)
    return digest.hexdigest()


def expanded_ids(text_ids: Sequence[int], token: int, runs: Sequence[int]) -> list[int] | None:
    """`text_ids` with its i-th placeholder `token` repeated runs[i] times; None unless it holds one per image."""
    places = [i for i, t in enumerate(text_ids) if t == token]
    if len(places) != len(runs):
        return None
    out: list[int] = []
    last = 0
    for place, run in zip(places, runs):
        out.extend(text_ids[last:place])
        out.extend([token] * run)
        last = place + 1
    out.extend(text_ids[last:])
    return out


class ImageReuse:
    """The processed images of recent requests (least recently used out past `budget_bytes`), shared by the
    replica's tokenizing threads."""

    def __init__(self, budget_bytes: int, token: int, tokenize: Callable[[str], dict[str, Any]]) -> None:
        self._kept = FeatureCache(budget_bytes)
        self._token = token
        self._tokenize = tokenize  # the processor on text alone
        self._lock = threading.Lock()
        self.expands: bool | None = None if budget_bytes > 0 else False  # None: not checked yet

    def processed(self, text: str, key: str) -> ReusedPrompt | None:
        """The prompt's token ids and its images' (`key`: images_key) kept processing, or None (not kept, or no
        reuse here)."""
        if not self.expands:
            return None
        with self._lock:
            found = self._kept.lookup([key])
        if found is None:
            return None
        ids = expanded_ids(self._text_ids(text), self._token, found[0].token_runs)
        return None if ids is None else ReusedPrompt(ids, found[0])

    def remember(self, text: str, key: str, token_ids: list[int], kept: ProcessedImages) -> None:
        """Keep what the processor made of the images of `key` (`kept`, its token_runs unset) for this prompt; the
        first time, check that expanding this prompt's text gives its token ids."""
        if self.expands is False:
            return
        runs = tuple(end - start for start, end in media_token_runs(token_ids, self._token))
        if len(runs) != len(kept.image_digests):  # images split in tiles, or placeholders the processor moved
            return
        if self.expands is None:
            self.expands = self._expansion_holds(text, token_ids, runs)
            if not self.expands:
                return
        with self._lock:
            self._kept.put(key, replace(kept, token_runs=runs))

    def _expansion_holds(self, text: str, token_ids: list[int], runs: tuple[int, ...]) -> bool:
        try:
            alone = self._tokenize(text)
        except Exception:  # noqa: BLE001 — a processor that takes no text without its images
            return False
        if set(alone) - TEXT_ARRAYS:  # arrays made of the text (token types...): they would need expanding too
            return False
        return expanded_ids(_ids(alone), self._token, runs) == token_ids

    def _text_ids(self, text: str) -> list[int]:
        return _ids(self._tokenize(text))


def _ids(inputs: dict[str, Any]) -> list[int]:
    return [int(t) for t in np.asarray(inputs["input_ids"]).reshape(-1)]


__all__ = ["ImageReuse", "ProcessedImages", "ReusedPrompt", "expanded_ids", "images_key"]
